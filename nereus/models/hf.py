"""Transformers parameter names ↔ Nereus tensors, declared once per family.

A Hugging Face checkpoint keeps q/k/v (weights and biases) and gate/up as separate
tensors; Nereus fuses them (`layers.{i}.attn.qkv.weight` = q rows | k rows | v rows,
`mlp.gate_up` = gate rows | up rows, see nereus.models). Each HF name therefore maps to a
global Nereus tensor and a row range of it:

    model.layers.3.self_attn.k_proj.weight  →  actor/layers.3.attn.qkv.weight rows [q, q+kv)

Each family file declares `HF_NAMES` (HF pattern, Nereus pattern, fused part); `hf_targets`,
`hf_to_nereus` and `nereus_to_hf` derive everything else from it and the tensor table. A
critic's value head is HF's `score.weight` (a ...ForSequenceClassification with one
label). A tied model's `lm_head.weight` is the embedding: accepted and ignored on input
when it equals the embedding, refused when it differs (transformers would untie the model
and compute with it).

The names are torch-free (the compiler may read them); the two converters use torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from nereus.ir.diagnostics import NereusError
from nereus.ir.model import Model

from ._lazy import LazyModule
from .tensors import family, tensor_table

torch = LazyModule("torch")


@dataclass(frozen=True)
class Target:
    """Where a user tensor lives in Nereus: a global tensor and a row range of it."""

    tensor: str
    rows: tuple[int, int]
    shape: tuple[int, ...]  # the user tensor's shape


def hf_names(model: Model) -> tuple[tuple[str, str, Optional[str]], ...]:
    """The (HF pattern, Nereus pattern, part) declarations of `model`'s family: its
    `HF_NAMES`, or what its `hf_names(model)` gives when they depend on the model (one
    entry per expert for a mixture of experts)."""
    module = family(model)
    if hasattr(module, "hf_names"):
        return module.hf_names(model)
    names = getattr(module, "HF_NAMES", None)
    if names is None:
        raise NereusError(f"no parameter-name mapping for architecture {model.architecture!r}",
                          hint="declare HF_NAMES in its family file under nereus/models")
    return names


def hf_targets(model: Model) -> dict[str, Target]:
    """Input: a model. Output: {HF name: Target} for every weight of the model.
    Invariant: the targets of one Nereus tensor tile its rows exactly once."""
    specs = {spec.name: spec for spec in tensor_table(model)}
    out = {}
    for hf, local, part in hf_names(model):
        layers = range(model.layers) if "{i}" in hf else [None]
        for i in layers:
            name = local.format(i=i) if i is not None else local
            spec = specs.get(name)
            if spec is None:  # e.g. lm_head on a critic, a bias the family lacks
                continue
            lo, hi = 0, spec.shape[0]
            if part is not None:
                for p in spec.parts:
                    if p.name == part:
                        hi = lo + p.rows
                        break
                    lo += p.rows
            shape = (hi - lo,) + tuple(spec.shape[1:])
            out[hf.format(i=i) if i is not None else hf] = Target(f"{model.name}/{name}", (lo, hi), shape)
    return out


def tied_alias(model: Model) -> Optional[str]:
    """The HF name a tied model's checkpoint may carry for its head (the embedding again)."""
    return "lm_head.weight" if model.tie_embeddings and model.head == "lm" else None


TIED_HEAD_HINT = ("if the head is its own tensor, set tie_word_embeddings false in config.json (transformers then "
                  "reads it the same way); else save the checkpoint again without lm_head.weight")


def embedding_name(model: Model) -> str:
    """The HF name of `model`'s token embedding."""
    return next(hf for hf, t in hf_targets(model).items() if t.tensor == f"{model.name}/embed.weight")


def tied_head_mismatch(model: Model) -> str:
    """What is wrong with a tied model's weights that hold a head other than the embedding."""
    return (f"holds {tied_alias(model)}, which differs from {embedding_name(model)}, while config.json ties the "
            f"head to the embedding (tie_word_embeddings true): transformers computes with {tied_alias(model)} then "
            f"(it unties them), {model.name}'s tied head would be the embedding")


def hf_to_nereus(model: Model, hf_state: dict) -> dict:
    """Input: an HF-named state dict of `model`. Output: full Nereus tensors by global
    name (fused tensors assembled). Raises NereusError naming a missing, unknown or
    mis-shaped tensor."""
    targets = hf_targets(model)
    hf_state = unstack_experts(model, hf_state)
    unknown = sorted(set(hf_state) - set(targets) - {tied_alias(model)})
    missing = sorted(set(targets) - set(hf_state))
    if unknown or missing:
        raise NereusError(f"{model.name}: unknown parameters {unknown[:3]}, missing {missing[:3]}",
                          hint=f"names follow transformers' {model.architecture} models (or score.weight for a critic)")
    alias = tied_alias(model)
    if alias in hf_state and not torch.equal(hf_state[alias], hf_state[embedding_name(model)]):
        raise NereusError(f"{model.name}: the state dict {tied_head_mismatch(model)}", hint=TIED_HEAD_HINT)
    out: dict = {}
    specs = {f"{model.name}/{s.name}": s for s in tensor_table(model)}
    for hf, target in targets.items():
        value = hf_state[hf]
        if tuple(value.shape) != target.shape:
            raise NereusError(f"{hf}: shape {tuple(value.shape)}, {model.name} needs {target.shape}")
        if not value.is_floating_point():
            raise NereusError(f"{hf}: {str(value.dtype).replace('torch.', '')}, not a floating-point weight",
                              hint="is this a model's state dict?")
        if target.tensor not in out:
            spec = specs[target.tensor]
            out[target.tensor] = torch.empty(spec.shape, dtype=value.dtype, device=value.device)
        out[target.tensor][target.rows[0]:target.rows[1]].copy_(value)
    return out


# transformers 5 stacks a Qwen3-MoE layer's experts (a live model's state_dict(), and files
# saved from it): `<prefix>.gate_up_proj` [E, 2F, H] and `<prefix>.down_proj` [E, H, F]
STACKED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def unstack_experts(model: Model, hf_state: dict) -> dict:
    """`hf_state` with transformers 5's stacked experts (a live Qwen3MoeForCausalLM's
    `state_dict()`: `mlp.experts.gate_up_proj` [E, 2F, hidden], gate rows then up rows,
    and `mlp.experts.down_proj` [E, hidden, F]) as the per-expert names of the published
    checkpoints (`mlp.experts.{e}.gate_proj.weight`, ...), views of the stacked tensors;
    other entries as they are."""
    if not getattr(model, "experts", 0) or not any(STACKED_EXPERTS.search(k) for k in hf_state):
        return hf_state
    out = {}
    for name, value in hf_state.items():
        match = STACKED_EXPERTS.search(name)
        if match is None:
            out[name] = value
            continue
        prefix, kind = match.groups()
        if value.dim() != 3 or value.shape[0] != model.experts:
            raise NereusError(f"{name}: shape {tuple(value.shape)}, {model.name} needs [{model.experts}, ...] "
                              f"(one slice per expert)")
        for e in range(model.experts):
            if kind == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = value[e]
            else:
                half = value.shape[1] // 2
                out[f"{prefix}.{e}.gate_proj.weight"] = value[e, :half]
                out[f"{prefix}.{e}.up_proj.weight"] = value[e, half:]
    return out


def nereus_to_hf(model: Model, full: dict) -> dict:
    """Inverse of hf_to_nereus: HF-named views of full Nereus tensors (no copy)."""
    return {hf: full[t.tensor][t.rows[0]:t.rows[1]] for hf, t in hf_targets(model).items()}


def parse_layer(name: str) -> Optional[int]:
    """The layer index in an HF or Nereus parameter name, or None."""
    match = re.search(r"layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None
