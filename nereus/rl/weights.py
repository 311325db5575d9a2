"""The RL loop's initial weights: read from Hugging Face checkpoints, or seeded.

Input: the module, the runtime (a nereus Runtime or the restart baseline), the
model-stages to fill and the seed. Output: every model-stage's local shards registered in
the runtime; training stages with an fp32 master copy, zeroed Adam moments and step 0.
Invariant: a model that starts from a checkpoint is read per rank, only this rank's boxes
(`shard_hf_checkpoint`): no rank holds the whole model, and no random draw is spent on it.

Where each model's weights come from:
- a model declared `hf("dir")`, or an alias of one (`model ref = actor`,
  `model critic = actor { head value }`), reads its checkpoint; a value head missing from
  a causal-LM checkpoint starts at zero (a critic that predicts 0; a reward model without
  one is refused before launch, nereus.rl.checks);
- `ref` and `critic` declared by hand with the actor's architecture start from the
  actor's checkpoint when the actor has one (the reference policy is the initial actor);
- every other model is drawn from the seeded generator in the order actor, ref (a copy of
  the actor when their architectures agree), reward, critic — the same draws as before
  checkpoints existed, so hand-written plans train bit for bit as they did.
"""

from __future__ import annotations

from typing import Optional

import torch

from nereus.ir.model import Model, Module
from nereus.models import OPTIMIZER_STATES, optimizer_name
from nereus.models.llama import init_full_weights

from .restart import TORCH_DTYPES

# Fields that decide the tensor table and numerics, the head and dtype aside: a model
# that agrees with the actor on these can start from the actor's checkpoint.
_BODY = ("architecture", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "rope_theta", "rope_scaling",
         "norm_eps", "head_dim", "tie_embeddings", "qkv_bias", "qk_norm", "experts", "experts_per_token", "expert_ffn",
         "norm_topk_prob")
_FROM_ACTOR = ("ref", "critic")


def _body(model: Model) -> tuple:
    return tuple(getattr(model, key) for key in _BODY)


def _architecture(model: Model) -> tuple:
    return (model.layers, model.hidden, model.heads, model.kv_heads, model.ffn, model.vocab, model.head, model.dtype,
            model.architecture, model.experts, model.experts_per_token, model.expert_ffn)


def checkpoint_source(module: Module, name: str) -> Optional[str]:
    """The checkpoint directory model `name` starts from, None for a seeded start."""
    model = module.model(name)
    if model.checkpoint_dir is not None:
        return model.checkpoint_dir
    actor = module.model("actor")
    if name in _FROM_ACTOR and actor.checkpoint_dir is not None and _body(model) == _body(actor):
        return actor.checkpoint_dir
    return None


def seeded_full_weights(module: Module, models: set[str], seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """{model: full fp32 weights by local name} for the seeded `models` (the draw order of
    the module docstring; a model loaded from a checkpoint takes no draws)."""
    gen = torch.Generator().manual_seed(seed)
    full: dict[str, dict[str, torch.Tensor]] = {}
    if "actor" in models:
        full["actor"] = init_full_weights(module.model("actor"), gen)
    if "ref" in models:
        same = "actor" in full and _architecture(module.model("ref")) == _architecture(module.model("actor"))
        full["ref"] = ({k: v.clone() for k, v in full["actor"].items()} if same
                       else init_full_weights(module.model("ref"), gen))
    if "reward" in models:
        full["reward"] = init_full_weights(module.model("reward"), gen, zero_value_head=False)
    if "critic" in models:
        full["critic"] = init_full_weights(module.model("critic"), gen)
    return full


def _seeded_shards(rt, module: Module, ms: str, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model, _, stage = ms.partition(".")
    dtype = TORCH_DTYPES[module.model(model).dtype]
    named = {f"{model}/{k}": v.to(dtype) for k, v in full.items()}  # init is fp32
    if stage == "training":
        for name in list(named):
            named[optimizer_name(name, "master")] = full[name.partition("/")[2]].float().clone()
            for state in OPTIMIZER_STATES[1:]:
                named[optimizer_name(name, state)] = torch.zeros_like(named[name], dtype=torch.float32)
    for name, (shape, spec_dtype) in rt.tensor_specs(ms).items():  # e.g. the runtime's Adam step
        if name not in named:
            named[name] = torch.zeros(shape, dtype=TORCH_DTYPES.get(spec_dtype, spec_dtype))
    return rt.shard_state_dict(ms, named)


def register_initial_weights(rt, module: Module, stages: list[str], seed: int) -> dict[str, Optional[str]]:
    """Register every model-stage of `stages` in `rt` (see the module docstring); returns
    {model: checkpoint directory or None (seeded)} for the log."""
    models = sorted({ms.partition(".")[0] for ms in stages})
    sources = {name: checkpoint_source(module, name) for name in models}
    full = seeded_full_weights(module, {name for name, source in sources.items() if source is None}, seed)
    for ms in sorted(stages):
        model = ms.partition(".")[0]
        if sources[model] is not None:
            local = rt.shard_hf_checkpoint(ms, sources[model])
        else:
            local = _seeded_shards(rt, module, ms, full[model])
        rt.register(ms, local)
    return sources
