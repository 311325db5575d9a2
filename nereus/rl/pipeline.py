"""Pipeline parallelism with the simplest correct schedule: one microbatch per replica,
forward stage by stage, backward in reverse (GPipe with M = 1; no overlap — the bubble is
(pp−1)/pp of the time, which is fine for checking that Nereus moves PP state right).

Each TP rank talks to the same TP rank of the neighbouring stage (the activations are
identical on every TP rank of a stage). Shapes are known to both ends (batch rows,
tokens, hidden), so every send has a matching receive of the same size by construction.
Generation returns the last stage's sampled token to the first stage each decode step.

Messages travel in the model's dtype (bf16 activations and their gradients for a bf16
model, as Megatron-LM sends them); the head runs on the last stage, which computes
log-probs and losses in fp32 itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from nereus.ir.model import Model

from nereus.models.llama import KvCache, Weights, embed, final_norm, run_layers
from nereus.models.parallel import TpGroup

from .restart import TORCH_DTYPES


@dataclass(frozen=True)
class PipeStage:
    """This rank's pipeline stage: `index` of `size`, its layers, and the global ranks of
    the same TP rank in the previous/next/first/last stage (None where there is none)."""

    index: int = 0
    size: int = 1
    layers: tuple[int, int] = (0, 0)
    prev: Optional[int] = None
    next: Optional[int] = None
    first: Optional[int] = None
    last: Optional[int] = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1


def _recv(shape, src: int, device, dtype=torch.float32) -> torch.Tensor:
    buffer = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buffer, src=src)
    return buffer


def forward(model: Model, w: Weights, tokens: torch.Tensor, tp: TpGroup, pipe: PipeStage,
            head: Callable[[torch.Tensor], torch.Tensor], cache: Optional[KvCache] = None, ep=None,
            pad: Optional[torch.Tensor] = None):
    """Run this rank's stage on `tokens` [B, T] (every stage knows the tokens' shape); a
    MoE model's layers dispatch tokens over the EP group `ep` (None: ep 1). `pad` [B]:
    each row's leading pad tokens (left-padded prompts; every stage knows them), None
    where no row is padded.

    Returns (head(final-normed hidden) on the last stage else None, stage input, stage
    output); the input is a leaf that requires grad on non-first stages when grad is on,
    so `backward` can hand its gradient to the previous stage."""
    if pipe.is_first:
        x_in = None
        x = embed(model, w, tokens, tp)
    else:
        x_in = _recv((*tokens.shape, model.hidden), pipe.prev, tokens.device, TORCH_DTYPES[model.dtype])
        if torch.is_grad_enabled():
            x_in.requires_grad_()
        x = x_in
    y = run_layers(model, w, x, pipe.layers, tp, cache, ep, pad)
    if not pipe.is_last:
        dist.send(y.detach().contiguous(), dst=pipe.next)
        return None, x_in, y
    return head(final_norm(w, y, model)), x_in, y


def backward(pipe: PipeStage, loss: Optional[torch.Tensor], x_in: Optional[torch.Tensor], y: torch.Tensor) -> None:
    """Backward of one stage: the last starts from the loss, the others from the gradient
    the next stage sends; every stage but the first sends its input's gradient back."""
    if pipe.is_last:
        loss.backward()
    else:
        # (y·g).sum() has gradient g w.r.t. y exactly; y.backward(g) would do the same but
        # torch checks g's shape by importing sympy on first use (~2.5 s, once per process).
        (y * _recv(y.shape, pipe.next, y.device, y.dtype)).sum().backward()
    if not pipe.is_first:
        grad = x_in.grad if x_in.grad is not None else torch.zeros_like(x_in)
        dist.send(grad.contiguous(), dst=pipe.prev)


def pass_token(pipe: PipeStage, token: Optional[torch.Tensor], batch: int, device=None) -> Optional[torch.Tensor]:
    """Decode step: the last stage's sampled tokens [B] go to the first stage."""
    if pipe.size == 1:
        return token
    if pipe.is_last:
        dist.send(token.contiguous(), dst=pipe.first)
        return token
    if pipe.is_first:
        return _recv((batch,), pipe.last, device, torch.long)
    return None

