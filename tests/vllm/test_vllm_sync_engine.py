"""End to end on 2 gloo ranks with VllmGeneration: the actor trains with tp 2 on ranks
0-1; in plan P it generates with tp 1 on rank 1, in plan Q (after a plan change) on
rank 0. Each step the compiled weight sync feeds the driver's vLLM engine (engine core in
a child process, since the rank has a gloo world), and vLLM's greedy tokens must equal
the torch llama's on the weights the trainer holds."""

from __future__ import annotations

import pytest
import torch

from vllm_cases import TINY, assert_greedy_matches, fixed_prompts, tiny_weights
from vllm_sync_cases import launch, sync_test_module

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess]
pytest.importorskip("vllm")

NEW = 6
SCHEDULE = ("P", "P", "Q")  # the plan of each step: the engine moves from rank 1 to rank 0


def _rank(rank, world, workdir):
    from nereus.backends.json_program import placement_units
    from nereus.runtime.state import shard_unit, unit_on_gpu
    from nereus.runtime.vllm_engine import VllmGeneration

    a = TINY
    module = sync_test_module((1, 2, 1, (0, 1)), (1, 1, 1, (1,)), gpus=2, layers=a.layers, hidden=a.hidden,
                              heads=a.heads, kv_heads=a.kv_heads, ffn=a.ffn, vocab=a.vocab,
                              more_plans={"Q": ((1, 2, 1, (0, 1)), (1, 1, 1, (0,)))})
    training = placement_units(module.model("actor"), module.plan("P").placement("actor.training"))
    unit = unit_on_gpu(training, rank)
    weights_only = dict(unit, shards=[s for s in unit["shards"] if "#" not in s["tensor"]])
    full = tiny_weights(0)
    generation = VllmGeneration(module, "P", workdir=workdir, max_model_len=128, block_size=32)
    probe = fixed_prompts()
    log = []
    try:
        for step, plan in enumerate(SCHEDULE, start=1):
            gen = torch.Generator().manual_seed(step)
            # a stand-in for the optimizer: the same update on every rank, applied shard-wise
            full = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in full.items()}
            result = generation.push(plan, shard_unit(weights_only, rank, full))
            entry = {"step": step, "plan": plan, "sent": result.bytes_sent, "received": result.bytes_received,
                     "driver": generation.engine is not None}
            if generation.engine is not None:
                entry["exact"] = set(result.weights) == set(full) and all(
                    torch.equal(result.weights[k], full[k]) for k in full)
                got = generation.generate(probe, NEW, greedy=True)
                assert_greedy_matches(full, probe, got)
                entry["tokens"] = got.tolist()
                entry["in_process"] = generation.engine.in_process
            log.append(entry)
    finally:
        generation.close()
    return log


def test_compiled_sync_feeds_vllm_every_step_and_follows_plan_changes(tmp_path):
    logs = launch(_rank, 2, str(tmp_path / "ckpt"))
    assert [e["driver"] for e in logs[1]] == [True, True, False]
    assert [e["driver"] for e in logs[0]] == [False, False, True]
    engine_steps = logs[1][:2] + logs[0][2:]
    assert all(e["exact"] for e in engine_steps)
    assert not any(e["in_process"] for e in engine_steps)  # ranks have a gloo world: engine core in a child
    # the non-driver holds half of every TP-split tensor: it sends, the driver receives
    assert all(e["sent"] > 0 for e in logs[0][:2]) and all(e["received"] > 0 for e in logs[1][:2])
    assert all(e["sent"] > 0 for e in logs[1][2:]) and all(e["received"] > 0 for e in logs[0][2:])
    tokens = [e["tokens"] for e in engine_steps]
    assert tokens[0] != tokens[1] or tokens[1] != tokens[2]
