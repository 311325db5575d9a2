"""Adam on tensors the runtime holds, and the DP gradient all-reduce.

A training unit's state is, per weight `{model}/{name}`, the weight (model dtype) and fp32
`#master`, `#exp_avg`, `#exp_avg_sq`, all local shards with the same layout (under
`zero 1`/`zero 3` the optimizer state is a dp chunk of it: nereus.rl.zero). The step
updates them in place, so after it the runtime still owns every byte of optimizer state
and a transition moves it along with the weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nereus.models import optimizer_name


def all_reduce_grads(grads: dict[str, torch.Tensor], group) -> None:
    """Sum gradients over the DP group in one flat message (in place). The losses are
    partial sums over the global token count, so the sum is the global-mean gradient."""
    if group is None or not grads:
        return
    names = sorted(grads)
    flat = torch.cat([grads[n].reshape(-1) for n in names])
    dist.all_reduce(flat, group=group)
    offset = 0
    for n in names:
        count = grads[n].numel()
        grads[n].copy_(flat[offset:offset + count].view_as(grads[n]))
        offset += count


@torch.no_grad()
def reduce_replicated_kv_grads(grads: dict[str, torch.Tensor], model, tp) -> None:
    """Sum the gradients of replicated KV-head rows over the TP ranks that share them (in
    place); a no-op unless tp > kv_heads.

    With tp > kv_heads each KV head is replicated on tp/kv_heads consecutive TP ranks (the
    compiler's layout, nereus.models.tensors) and each copy only sees the gradient through
    its own rank's q heads: the true gradient of the shared rows is the sum over the copies.
    One all-reduce over the whole TP group does every layer: rank t writes its k and v rows
    into slot t // (tp / kv_heads) of a zero buffer, so slot j sums exactly head j's sharers.
    Invariant: afterwards every copy of a KV head has the same gradient (so Adam keeps the
    copies equal)."""
    if tp.size <= model.kv_heads:
        return
    names = sorted(n for n in grads if n.endswith(".attn.qkv.weight"))
    if not names:
        return
    kv_rows = model.head_dim  # one local KV head: head_dim k rows then head_dim v rows
    q_rows = (model.heads // tp.size) * model.head_dim
    head = tp.rank // (tp.size // model.kv_heads)
    sample = grads[names[0]]
    slots = torch.zeros((len(names), model.kv_heads, 2 * kv_rows, sample.shape[1]), dtype=sample.dtype,
                        device=sample.device)
    for layer, name in enumerate(names):
        slots[layer, head] = grads[name][q_rows:q_rows + 2 * kv_rows]
    tp.all_reduce(slots)
    for layer, name in enumerate(names):
        grads[name][q_rows:q_rows + 2 * kv_rows] = slots[layer, head]


@torch.no_grad()
def adam_step(state: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], step: int,
              lr: float, betas: tuple[float, float], eps: float) -> None:
    """One Adam step (Kingma & Ba, bias-corrected, no weight decay) on `state` in place.

    grads: {global weight name: fp32 gradient of the local shard}; step counts from 1.
    Invariant: weight == master.to(weight dtype) afterwards."""
    b1, b2 = betas
    c1, c2 = 1 - b1 ** step, 1 - b2 ** step
    for name, grad in grads.items():
        master = state[optimizer_name(name, "master")]
        m = state[optimizer_name(name, "exp_avg")]
        v = state[optimizer_name(name, "exp_avg_sq")]
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        master.addcdiv_(m / c1, (v / c2).sqrt_().add_(eps), value=-lr)
        state[name].copy_(master)
