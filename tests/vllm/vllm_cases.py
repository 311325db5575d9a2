"""Shared pieces of the vLLM tests: a tiny llama vLLM's CPU attention accepts (head_dim 32),
weights with a clear argmax, the plain-torch reference, and the greedy-equality check."""

from __future__ import annotations

import torch

from nereus.models import tensor_table
from nereus.ir.model import Model
from nereus.models.llama import hidden_states, local_logits
from nereus.models.parallel import TpGroup

TINY = Model("actor", "llama", layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, vocab=256, dtype="fp32")
TOL = 1e-3  # logits: a token within TOL of the reference maximum counts as an argmax


def tiny_weights(seed: int, model: Model = TINY) -> dict:
    """Whole weights by global name; std 0.1 (not 0.02) so that logits spread and greedy
    decoding is not decided by float reduction order."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for spec in tensor_table(model):
        if spec.name.endswith("norm.weight"):
            out[f"actor/{spec.name}"] = 1.0 + 0.1 * torch.randn(spec.shape, generator=gen)
        else:
            out[f"actor/{spec.name}"] = 0.1 * torch.randn(spec.shape, generator=gen)
    return out


def fixed_prompts(batch: int = 4, length: int = 40, seed: int = 123, vocab: int = 256) -> torch.Tensor:
    """Prompts longer than one KV block (the tests use block_size 32), so that after a
    weight push without reset_prefix_cache vLLM would reuse stale cached blocks (checked
    by hand: outputs then differ from the reference)."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def local(weights: dict) -> dict:
    return {k.split("/", 1)[1]: v for k, v in weights.items()}


@torch.no_grad()
def torch_greedy(weights: dict, prompts: torch.Tensor, new_tokens: int, model: Model = TINY) -> torch.Tensor:
    """Greedy tokens of the plain torch llama (nereus.models.llama, tp 1), recomputing
    the whole sequence each step: an independent reference for vLLM's greedy output that
    shares no code path with any KV cache."""
    w = local(weights)
    seqs = prompts
    for _ in range(new_tokens):
        hidden = hidden_states(model, w, seqs, TpGroup())[:, -1]
        seqs = torch.cat([seqs, local_logits(w, hidden, TpGroup()).argmax(-1, keepdim=True)], dim=1)
    return seqs[:, prompts.shape[1]:]


@torch.no_grad()
def argmax_gaps(weights: dict, prompts: torch.Tensor, tokens: torch.Tensor, model: Model = TINY):
    """Teacher-forced on prompts+tokens: (reference max logit − logit of the chosen token,
    reference top-1 − top-2 gap), each [B, new_tokens]."""
    seqs = torch.cat([prompts, tokens], dim=1)
    w = local(weights)
    hidden = hidden_states(model, w, seqs[:, :-1], TpGroup())[:, prompts.shape[1] - 1:]
    logits = local_logits(w, hidden, TpGroup())
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - chosen, top2[..., 0] - top2[..., 1]


def assert_greedy_matches(weights: dict, prompts: torch.Tensor, got: torch.Tensor) -> None:
    """vLLM's greedy tokens equal the torch reference's exactly, except where the
    reference itself has a near-tie (top-1 − top-2 < TOL): from there on each vLLM token
    must still be a reference argmax within TOL on vLLM's own prefix."""
    want = torch_greedy(weights, prompts, got.shape[1])
    lag, gap = argmax_gaps(weights, prompts, got)
    assert (lag <= TOL).all(), f"vLLM chose a non-argmax token: logit lag {lag.max():.3g} > {TOL}"
    for row in range(got.shape[0]):
        if not torch.equal(got[row], want[row]):
            first = int((got[row] != want[row]).nonzero()[0])
            assert gap[row, first] < TOL, f"row {row} differs at {first} without a near-tie: " \
                f"{got[row].tolist()} vs {want[row].tolist()}"
