"""Zero 3 compute gathers one layer at a time (nereus.rl.zero3.LayerGather) and
reduce-scatters gradients (reduce_scatter_chunks).

- One process (dp 1): a 6-layer llama's forward and backward through a LayerGather give
  the loss and gradients of the plain whole weights bit for bit, while at most two
  layers' whole weights are alive at once (one in the forward, two at a layer boundary of
  the backward), counted by weak references to every gathered tensor. Without the
  saved-tensor hooks autograd keeps every layer alive: the count is the whole stage (the
  check can fail).
- Two gloo processes (dp 2): each replica holds half the rows; the forward reads the same
  bytes as the whole weights, and the reduce-scattered gradient chunks equal the
  all-reduced whole gradients' rows bit for bit, also through the all-reduce fallback.
"""

import pytest
import torch

from nereus.ir.model import Model
from nereus.models.llama import embed, final_norm, init_full_weights, local_logits, run_layers
from nereus.models.parallel import TpGroup
from nereus.passes.layout import chunk_rows
from nereus.rl.zero3 import LayerGather, group_of, reduce_scatter_chunks

from rl_harness import run_world

MODEL = Model("actor", "llama", layers=6, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=16, dtype="fp32")


def _loss(w, tokens):
    tp = TpGroup()
    x = run_layers(MODEL, w, embed(MODEL, w, tokens, tp), (0, MODEL.layers), tp)
    return local_logits(w, final_norm(w, x, MODEL), tp).float().logsumexp(-1).sum()


def _weights(seed: int = 0) -> dict:
    return init_full_weights(MODEL, torch.Generator().manual_seed(seed))


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, MODEL.vocab, (2, 5), generator=torch.Generator().manual_seed(seed))


def _reference(full, tokens):
    leaves = {k: t.detach().clone().requires_grad_() for k, t in full.items()}
    loss = _loss(leaves, tokens)
    loss.backward()
    return loss.detach(), {k: t.grad.float() for k, t in leaves.items()}


def _gather(full, replica=0, dp=1, group=None, dp_ranks=(0,)):
    chunks = {}
    for name, t in full.items():
        lo, hi = chunk_rows(t.shape[0], dp, replica)
        if hi > lo:
            chunks[name] = t[lo:hi].clone()
    shapes = {k: tuple(t.shape) for k, t in full.items()}
    return LayerGather(chunks, shapes, torch.float32, torch.device("cpu"), replica=replica, dp=dp, group=group,
                       dp_ranks=dp_ranks, grad=True)


def test_one_layer_at_a_time_and_the_same_numbers():
    full, tokens = _weights(), _tokens(1)
    want_loss, want_grads = _reference(full, tokens)
    w = _gather(full)
    with w.saving():
        loss = _loss(w, tokens)
    loss.backward()
    grads = w.finish()
    assert torch.equal(loss.detach(), want_loss)
    assert set(grads) == set(want_grads)
    for name in grads:
        assert torch.equal(grads[name], want_grads[name]), name
    layer = max(sum(1 for n in full if group_of(n) == f"layers.{i}") for i in range(MODEL.layers))
    assert w.peak_live <= 2 * layer < len(full) - 2  # two layers at most, of six (+ embed, norm, head)
    # every group once in the forward and once in the backward, but the embedding (its
    # backward reads only the token ids)
    assert w.gathers == 2 * (MODEL.layers + 3) - 1


def test_without_the_hooks_autograd_keeps_every_layer():
    full, tokens = _weights(), _tokens(1)
    w = _gather(full)
    loss = _loss(w, tokens)  # no saving(): the saved tensors are the gathered weights themselves
    layer = sum(1 for n in full if group_of(n) == "layers.0")
    assert w.peak_live >= MODEL.layers * layer  # every layer's whole weights held until the backward
    loss.backward()
    w.finish()


def test_a_weight_without_gradient_gets_a_zero_chunk():
    """As the trainer gives a zero 0 leaf without `.grad` a zero gradient: the head is
    not read by this loss, its chunk's gradient is zeros (and Adam steps it alike)."""
    full, tokens = _weights(), _tokens(2)
    w = _gather(full)
    with w.saving():
        tp = TpGroup()
        loss = final_norm(w, run_layers(MODEL, w, embed(MODEL, w, tokens, tp), (0, MODEL.layers), tp), MODEL).sum()
    loss.backward()
    grads = w.finish()
    assert set(grads) == set(full)
    assert torch.equal(grads["lm_head.weight"], torch.zeros_like(full["lm_head.weight"]))


def _two_replicas():
    import torch.distributed as dist

    rank = dist.get_rank()
    full = _weights()
    tokens = _tokens(10 + rank)  # each replica its own rows of the batch
    _, plain = _reference(full, tokens)
    for name in plain:
        dist.all_reduce(plain[name])
    group = dist.new_group([0, 1])
    w = _gather(full, replica=rank, dp=2, group=group, dp_ranks=(0, 1))
    with w.saving():
        loss = _loss(w, tokens)
    loss.backward()
    grads = w.finish()
    out = {"peak": w.peak_live, "mismatch": []}
    for name, g in plain.items():
        lo, hi = chunk_rows(g.shape[0], 2, rank)
        if hi > lo and not torch.equal(grads[name], g[lo:hi]):
            out["mismatch"].append(name)
    # the fallback for a backend without reduce_scatter_tensor: the same sums
    original = dist.reduce_scatter_tensor

    def refuse(*args, **kwargs):
        raise RuntimeError("no reduce_scatter here")

    dist.reduce_scatter_tensor = refuse
    try:
        local = {k: v.clone() for k, v in _reference(full, tokens)[1].items()}
        fallback = reduce_scatter_chunks(local, rank, 2, group, (0, 1))
    finally:
        dist.reduce_scatter_tensor = original
    out["fallback_mismatch"] = [n for n in fallback if not torch.equal(fallback[n], grads[n])]
    return out


@pytest.mark.multiprocess
def test_two_replicas_reduce_scatter_matches_all_reduce():
    out = run_world(2, _two_replicas, timeout=120)
    assert out["mismatch"] == []
    assert out["fallback_mismatch"] == []
