"""Model architectures expanded into their global tensor tables.

The `llama` builtin (Llama-2/3 family: RMSNorm, GQA attention with fused qkv, SwiGLU MLP
with fused gate_up, untied embedding and lm_head) gives, per model (hd = head_dim):

    embed.weight                       [vocab, hidden]                 vocab       (first PP stage)
    layers.{i}.input_norm.weight       [hidden]                        replicated
    layers.{i}.attn.qkv.weight         [(heads+2*kv_heads)*hd, hidden] column, parts q|k|v
    layers.{i}.attn.o.weight           [hidden, heads*hd]              row
    layers.{i}.post_attn_norm.weight   [hidden]                        replicated
    layers.{i}.mlp.gate_up.weight      [2*ffn, hidden]                 column, parts gate|up
    layers.{i}.mlp.down.weight         [hidden, ffn]                   row
    final_norm.weight                  [hidden]                        replicated  (last PP stage)
    lm_head.weight                     [vocab, hidden]                 vocab       (last PP stage)
 or value_head.weight                  [1, hidden]                     replicated  (critic, `head value`)

`tie_embeddings` drops lm_head (the head reads embed.weight); `qkv_bias` (qwen2) adds
layers.{i}.attn.qkv.bias [(heads+2*kv_heads)*hd], column with the weight's parts;
`qk_norm` (qwen3) adds layers.{i}.attn.{q,k}_norm.weight [hd], replicated. The family
files (llama.py, qwen2.py, qwen3.py) hold the details.

Global names are `{model}/{local name}`. Training units also hold optimizer state with
the same shape and sharding, in fp32, named `{model}/{local name}#{state}` for state in
OPTIMIZER_STATES.

Sharding rules (Megatron-LM, vLLM): column splits dim 0 into tp equal parts, part-wise for
fused tensors (a TP shard of qkv is three boxes: its q rows, its k rows, its v rows); when
tp > kv_heads each KV head is replicated on tp/kv_heads consecutive TP ranks. row splits
dim 1. vocab splits dim 0. replicated tensors are whole on every TP rank.

Parameter counts equal transformers' num_parameters() for the published configs
(tests/models/test_parameter_counts.py): Llama-3.1-8B 8,030,261,248, Llama-3.1-70B
70,553,706,496, Llama-3.2-1B 1,235,814,400, Qwen2.5-7B 7,615,616,512, Qwen3-8B
8,190,735,360, Qwen3-30B-A3B 30,532,122,624. The mixture-of-experts family (qwen3_moe.py)
replaces the MLP by a router and per-expert gate_up/down tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import importlib

from nereus.ir.model import Model

OPTIMIZER_STATES: tuple[str, ...] = ("master", "exp_avg", "exp_avg_sq")
OPTIMIZER_DTYPE = "fp32"

COLUMN, ROW, VOCAB, REPLICATED = "column", "row", "vocab", "replicated"

# architecture name (the IR's `= llama {...}`) -> the module holding its family
FAMILIES: dict[str, str] = {
    "llama": "nereus.models.llama", "qwen2": "nereus.models.qwen2", "qwen3": "nereus.models.qwen3",
    "qwen3_moe": "nereus.models.qwen3_moe", "tensors": "nereus.models.table",
}


@dataclass(frozen=True)
class FusedPart:
    """A part of a column-sharded fused tensor: `rows` rows along dim 0 made of `groups`
    equal groups, the smallest units TP may not split (attention heads for q/k/v, single
    rows for gate/up). TP splits the groups; with fewer groups than ranks (GQA with
    tp > kv_heads) each rank holds one whole group, replicated on tp/groups ranks."""

    name: str
    rows: int
    groups: int


@dataclass(frozen=True)
class TensorSpec:
    """One global tensor of a model.

    name: local name (`layers.3.attn.qkv.weight`); `layer` is None for embed, final norm
    and head. `parts` is set for column tensors (one part when not fused). `expert` is the
    index of the routed expert the tensor belongs to (None for everything else), out of
    `experts` per layer: with expert parallelism ep, expert e lives whole (TP-sharded by
    its `sharding`) on EP rank e // (experts / ep) only."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    sharding: str
    layer: Optional[int]
    parts: tuple[FusedPart, ...] = ()
    role: str = "layer"  # "embed", "layer", "final_norm", "head"
    expert: Optional[int] = None
    experts: int = 0

    def ep_owner(self, ep: int) -> Optional[int]:
        """The EP rank (of ep) that holds this tensor, or None when every EP rank does."""
        return None if self.expert is None else self.expert // (self.experts // ep)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def family(model: Model):
    """The module of `model`'s architecture family (its tensor table and forward)."""
    try:
        name = FAMILIES[model.architecture]
    except KeyError:
        raise ValueError(f"unknown architecture {model.architecture!r}; families: {', '.join(FAMILIES)}") from None
    return importlib.import_module(name)


def layer_tensors(model: Model) -> tuple[TensorSpec, ...]:
    """The tensors of one transformer layer, with `layers.{i}` left as a `{i}` pattern
    (layer None): all layers share this pattern, which the compiler exploits."""
    return family(model).layer_tensors(model)


def edge_tensors(model: Model) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(tensors before the first layer, tensors after the last layer)."""
    return family(model).edge_tensors(model)


def tensor_table(model: Model) -> tuple[TensorSpec, ...]:
    """Every weight tensor of `model`, in execution order, with local names."""
    first, last = edge_tensors(model)
    pattern = layer_tensors(model)
    layers = tuple(
        replace(t, name=t.name.format(i=i), layer=i)
        for i in range(model.layers)
        for t in pattern
    )
    return first + layers + last


def parameter_count(model: Model) -> int:
    first, last = edge_tensors(model)
    per_layer = sum(t.numel for t in layer_tensors(model))
    return sum(t.numel for t in first + last) + model.layers * per_layer


def layer_parameter_count(model: Model) -> int:
    return sum(t.numel for t in layer_tensors(model))


def optimizer_name(tensor_name: str, state: str) -> str:
    return f"{tensor_name}#{state}"


def pp_layer_range(layers: int, pp: int, stage: int) -> tuple[int, int]:
    """Half-open layer range of pipeline stage `stage`: contiguous chunks, the first
    `layers % pp` stages one layer longer (Megatron's uneven split)."""
    base, extra = divmod(layers, pp)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (1 if stage < extra else 0)
