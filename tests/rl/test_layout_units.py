"""The loop's layers on the layouts the compiler accepts, checked piece by piece:
causal attention for any cache continuation, TP collectives in TP-rank order for any GPU
order, gradients of replicated KV heads (tp > kv_heads), bf16 pipeline messages."""

import pytest
import torch

from nereus.ir.model import Model
from nereus.models import tensor_table
from nereus.models.llama import KvCache, hidden_states, init_full_weights
from nereus.models.parallel import TpGroup
from nereus.rl.shards import shard

from rl_harness import run_world


def test_chunked_cache_continuation_equals_a_full_forward():
    # 6-token prefill, then a 4-token chunk, then 2 single tokens: every chunk after a
    # non-empty cache must see the cache and its own earlier tokens, never later ones.
    model = Model("m", "llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=16, dtype="fp32")
    w = init_full_weights(model, torch.Generator().manual_seed(11))
    tokens = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(12))
    full = hidden_states(model, w, tokens, TpGroup())
    cache = KvCache.empty(model.layers)
    parts = [hidden_states(model, w, tokens[:, lo:hi], TpGroup(), cache) for lo, hi in ((0, 6), (6, 10), (10, 11), (11, 12))]
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


def _gather_in_tp_order(order):
    import torch.distributed as dist

    from nereus.models.parallel import gather_vocab

    me = dist.get_rank()
    group = dist.new_group(sorted(order))
    tp = TpGroup(len(order), order.index(me), group, tuple(order))
    logits = torch.arange(8, dtype=torch.float32).view(1, 8)
    local = logits[:, tp.rank * 4:(tp.rank + 1) * 4].clone()
    return gather_vocab(local, tp).tolist()  # plain data: tensors do not cross the queue


@pytest.mark.multiprocess
def test_gather_vocab_orders_by_tp_rank_for_a_descending_group():
    full = run_world(2, _gather_in_tp_order, (1, 0))  # `tp 2 on 1, 0`: GPU 1 is TP rank 0
    assert full == [list(range(8))]


def _replicated_kv_grads(model, tokens, full):
    import torch.distributed as dist

    from nereus.models.llama import local_logits
    from nereus.models.parallel import vocab_parallel_logprob
    from nereus.rl.optim import reduce_replicated_kv_grads

    me, world = dist.get_rank(), dist.get_world_size()
    order = tuple(reversed(range(world)))  # and a descending GPU order on top
    tp = TpGroup(world, order.index(me), dist.new_group(list(range(world))), order)
    specs = {s.name: s for s in tensor_table(model)}
    params = {n: shard(t, specs[n], tp.size, tp.rank).requires_grad_() for n, t in full.items()}
    h = hidden_states(model, params, tokens[:, :-1], tp)
    vocab_parallel_logprob(local_logits(params, h, tp), tokens[:, 1:], model.vocab, tp).sum().backward()
    grads = {n: p.grad for n, p in params.items()}
    reduce_replicated_kv_grads(grads, model, tp)
    return {n: (g, shard(full[n], specs[n], tp.size, tp.rank)) for n, g in grads.items() if "qkv" in n}, tp.rank


def _compare_replicated_kv(model, tokens, full):
    import torch.distributed as dist

    got, rank = _replicated_kv_grads(model, tokens, full)
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, (rank, {n: g.numpy() for n, (g, _) in got.items()}))
    return everything


@pytest.mark.multiprocess
def test_replicated_kv_head_gradients_equal_the_single_rank_gradient():
    # tp 2 > kv_heads 1: both ranks hold the only KV head; each sees the gradient from
    # its own q heads, and the sum over the two is the true gradient of those rows.
    model = Model("m", "llama", layers=1, hidden=32, heads=4, kv_heads=1, ffn=64, vocab=16, dtype="fp32")
    full = init_full_weights(model, torch.Generator().manual_seed(13))
    tokens = torch.randint(0, 16, (2, 7), generator=torch.Generator().manual_seed(14))
    ref = {n: t.clone().requires_grad_() for n, t in full.items()}
    from nereus.models.llama import local_logits
    from nereus.models.parallel import vocab_parallel_logprob

    h = hidden_states(model, ref, tokens[:, :-1], TpGroup())
    vocab_parallel_logprob(local_logits(ref, h, TpGroup()), tokens[:, 1:], model.vocab, TpGroup()).sum().backward()
    specs = {s.name: s for s in tensor_table(model)}
    for rank, grads in run_world(2, _compare_replicated_kv, model, tokens, full):
        for name, grad in grads.items():
            expected, grad = shard(ref[name].grad, specs[name], 2, rank), torch.from_numpy(grad)
            assert torch.allclose(grad, expected, atol=1e-6), (name, rank, (grad - expected).abs().max())


def test_replica_rows_cover_the_batch_for_any_dp():
    # dp need not divide the batch (the compiler does not ask it to): contiguous shares
    # that differ by at most one row, together exactly the batch.
    from nereus.rl.pipeline import PipeStage
    from nereus.rl.topology import Role

    for batch, dp in ((8, 3), (4, 4), (7, 2), (12, 5)):
        rows = [Role(r, dp, TpGroup(), None, PipeStage()).rows(batch, offset=10) for r in range(dp)]
        assert [i for s in rows for i in range(s.start, s.stop)] == list(range(10, 10 + batch))
        assert max(s.stop - s.start for s in rows) - min(s.stop - s.start for s in rows) <= 1


def test_a_replica_without_rows_is_refused_at_its_placement():
    from nereus.ir.diagnostics import SemanticError
    from nereus.rl.checks import check_run

    from rl_plans import tiny_module, uniform

    module = tiny_module({"S1": uniform(1, 1, (0,)), "S2": {**uniform(1, 1, (0,)), "actor.training": (3, 1, (0, 1, 2))}},
                         gpus=4, batch=4)
    check_run(module, "ppo", 1, 1, 4)  # 4 rows a minibatch: 3 replicas get 2, 1, 1
    with pytest.raises(SemanticError, match="actor.training has dp 3 but a minibatch has 2 rows"):
        check_run(module, "ppo", 2, 1, 4)


def test_models_the_loop_cannot_use_are_refused_at_their_declaration():
    from dataclasses import replace

    from nereus.ir.diagnostics import SemanticError
    from nereus.rl import reward
    from nereus.rl.checks import TASK_TOKENS, check_run

    from rl_plans import tiny_module, uniform

    assert TASK_TOKENS == reward.BOS + 1  # digits 0..9 and BOS
    module = tiny_module({"S1": uniform(1, 1, (0,))}, gpus=1)
    models = {m.name: m for m in module.models}
    small = replace(module, models=tuple(replace(m, vocab=8) if m.name == "ref" else m for m in module.models))
    with pytest.raises(SemanticError, match="ref has vocab 8 but the tasks use 11 tokens"):
        check_run(small, "ppo", 2, 1, 1)
    no_value = replace(module, models=tuple(replace(m, head="lm") if m.name == "critic" else m for m in module.models))
    with pytest.raises(SemanticError, match="critic needs `head value`"):
        check_run(no_value, "ppo", 2, 1, 1)
    assert models["actor"].head == "lm"


def test_zero_layouts_pass_the_loop_checks_and_vllm_refuses_zero_3_at_the_key(tmp_path):
    """The loop trains `zero 1` and `zero 3` (nereus.rl.zero); the vLLM engine path loads
    the runtime's actor.training shards as they are (dp chunks under zero 3): refused there
    at the key, before any engine starts."""
    import pathlib

    import nereus.ir as ir
    from nereus.ir.diagnostics import SemanticError
    from nereus.rl.checks import check_run
    from nereus.rl.engine import check_vllm_plans

    text = (pathlib.Path(__file__).resolve().parents[2] / "examples/rl/ppo-cpu.nir").read_text()
    line = "  actor.training    dp 2 tp 2  on 0..3"
    for zero in (1, 3):
        path = tmp_path / f"zero{zero}.nir"
        path.write_text(text.replace(line, f"{line} zero {zero}", 1))
        module = ir.parse_file(str(path))
        check_run(module, "ppo", 2, 1, 4)
        if zero == 1:
            continue
        with pytest.raises(SemanticError, match="has zero 3, which the vLLM engine path does not run yet") as err:
            check_vllm_plans(module, cuda=True)
        assert err.value.loc is not None and err.value.loc.line == 33 and err.value.loc.column > len(line)


@pytest.mark.parametrize("tp, dp", [(1, 2), (2, 3), (4, 2), (4, 4), (2, 5)])
def test_the_loops_zero_chunks_are_the_compilers(tp, dp):
    """nereus.rl.zero cuts the chunks the runtime holds (nereus.passes.layout.zero_boxes):
    for every tensor of a GQA llama with a value head (1 row: empty chunks from replica 1
    on), TP rank and replica, chunk_rows of the local tensor cut from the loop's TP boxes
    gives the compiler's rows in the same local order, and the replicas' chunks tile the
    local tensor."""
    from nereus.passes.layout import zero_boxes
    from nereus.rl.shards import local_boxes
    from nereus.rl.zero import chunk_boxes, chunk_rows

    model = Model("m", "llama", layers=1, hidden=32, heads=4, kv_heads=2, ffn=48, vocab=20, dtype="bf16",
                  head="value")
    for spec in tensor_table(model):
        for t in range(tp):
            boxes = local_boxes(spec, tp, t)
            rows = sum(b[0][1] - b[0][0] for b in boxes)
            cuts = [chunk_rows(rows, dp, r) for r in range(dp)]
            assert cuts[0][0] == 0 and cuts[-1][1] == rows and all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
            for r, (lo, hi) in enumerate(cuts):
                assert _merged(chunk_boxes(boxes, lo, hi)) == _merged(zero_boxes(spec, tp, t, dp, r)), (spec.name, t, r)


def _merged(boxes) -> list:
    """Boxes with dim-0 neighbours joined: the same rows in the same local order (at tp 1
    the compiler lists a fused tensor's parts as boxes, the loop the whole tensor as one)."""
    out = []
    for box in boxes:
        box = tuple(tuple(d) for d in box)
        if out and out[-1][0][1] == box[0][0] and out[-1][1:] == box[1:]:
            out[-1] = ((out[-1][0][0], box[0][1]), *box[1:])
        else:
            out.append(box)
    return out
