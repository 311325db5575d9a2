"""End to end on 2 gloo ranks: the actor trains with tp 2 on ranks 0-1 and generates with
tp 1 on rank 1, whose vLLM engine (engine core in a child process) is fed by the compiled
weight sync after every step; vLLM's greedy tokens must equal the torch llama's on the
weights the trainer holds."""

from __future__ import annotations

import pytest
import torch

from vllm_cases import TINY, assert_greedy_matches, fixed_prompts, tiny_weights
from vllm_sync_cases import launch, sync_test_module

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess]
pytest.importorskip("vllm")

STEPS, NEW = 3, 6


def _rank(rank, world, workdir):
    from nereus.backends.json_program import placement_units
    from nereus.runtime.state import shard_unit, unit_on_gpu
    from nereus.runtime.vllm_engine import VllmEngine
    from nereus.runtime.vllm_sync import WeightSync

    a = TINY
    module = sync_test_module((1, 2, 1, (0, 1)), (1, 1, 1, (1,)), gpus=2, layers=a.layers, hidden=a.hidden,
                              heads=a.heads, kv_heads=a.kv_heads, ffn=a.ffn, vocab=a.vocab)
    training = placement_units(module.model("actor"), module.plan("P").placement("actor.training"))
    full = tiny_weights(0)
    # the engine starts first: WeightSync's group creation then waits for it on the
    # default group (long timeout), not on the sync's control group (120 s)
    engine = VllmEngine(TINY, full, workdir=workdir, max_model_len=128) if rank == 1 else None
    sync = WeightSync(module)
    probe = fixed_prompts()
    log = []
    try:
        for step in range(1, STEPS + 1):
            gen = torch.Generator().manual_seed(step)
            # a stand-in for the optimizer: the same update on every rank, applied shard-wise
            full = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in full.items()}
            unit = unit_on_gpu(training, rank)
            weights_only = dict(unit, shards=[s for s in unit["shards"] if "#" not in s["tensor"]])
            shards = shard_unit(weights_only, rank, full)
            result = sync.run("P", shards)
            entry = {"step": step, "sent": result.bytes_sent, "received": result.bytes_received}
            if engine is not None:
                entry["exact"] = set(result.weights) == set(full) and all(
                    torch.equal(result.weights[k], full[k]) for k in full)
                engine.update_weights(result.weights)
                got = engine.generate(probe, NEW, greedy=True)
                assert_greedy_matches(full, probe, got)
                entry["tokens"] = got.tolist()
                entry["in_process"] = engine.in_process
            log.append(entry)
    finally:
        if engine is not None:
            engine.close()
    return log


def test_compiled_sync_feeds_vllm_every_step(tmp_path):
    logs = launch(_rank, 2, str(tmp_path / "ckpt"))
    engine_log = logs[1]
    assert [e["step"] for e in engine_log] == list(range(1, STEPS + 1))
    assert all(e["exact"] for e in engine_log)
    assert not engine_log[0]["in_process"]  # the rank has a gloo world: engine core in a child
    # rank 0 holds half of every TP-split tensor: it must send, and rank 1 receive, each step
    assert all(e["sent"] > 0 for e in logs[0]) and all(e["received"] > 0 for e in engine_log)
    tokens = [e["tokens"] for e in engine_log]
    assert tokens[0] != tokens[1] or tokens[1] != tokens[2]
