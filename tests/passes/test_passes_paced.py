"""Paced rounds (resources._pace): where memory forces several rounds on a few full GPUs,
every other GPU spreads its transfers over those rounds instead of finishing early and
leaving the full GPUs' rounds to run alone. A scaled-down copy of the DeepSeek-V3-sized
refit (examples/moe-dsv3-256.nir: PP x EP -> TP x DP, the first and last pipeline stages
fuller: embedding and head with their training state)."""

import pytest

from nereus.backends.json_program import program_json
from nereus.cli.compile import summary_text
from nereus.ir import parse_source
from nereus.passes import compile_transition
from nereus.passes.cost import link_bounds
from nereus.passes.resources import _unpaced, schedule_seconds
from nereus.passes.verify import verify_program

SOURCE = """
cluster c32 { nodes 4 gpus_per_node 8 gpu { mem MEM flops 989TFLOPS hbm 4.8TB/s }
  intra 900GB/s inter 400GB/s host_mem 2TB reserve 5% }
model actor = qwen3_moe { layers 8 hidden 2048 heads 16 kv_heads 8 ffn 4096 vocab 65536 dtype bf16 head_dim 128
  experts 32 experts_per_token 4 expert_ffn 1024 }
workload grpo { batch 64 prompt 256 response 256 microbatch 1 recompute full generation: actor training: actor }
plan Train { actor.training dp 1 pp 4 ep 8 on 0..31  actor.generation dp 1 pp 4 ep 8 on 0..31 }
plan Generate = Train { actor.generation dp 4 tp 8 on 0..31 }
"""


def _compile(mem: str):
    module = parse_source(SOURCE.replace("MEM", mem), "<paced>")
    return module, compile_transition(module, "Train", "Generate")


def test_memory_bound_rounds_are_paced_and_say_who_waits():
    module, compiled = _compile("5GB")
    schedule = compiled.program.schedule
    unpaced, _ = _unpaced(compiled.dag, staging=True)
    assert len(schedule.rounds) > 1
    # predicted faster than the greedy schedule it replaces (0.0151 s against 0.0247 s)
    assert compiled.cost.seconds < 0.75 * schedule_seconds(compiled.dag, unpaced)
    assert compiled.cost.seconds == pytest.approx(schedule_seconds(compiled.dag, schedule))
    notes = " ".join(schedule.notes)
    assert "paced rounds" in notes
    # the full GPUs are the first and last pipeline stages' (embedding, head), and the
    # after units (TP groups) that wait for their data are named with their last round
    assert "memory sets" in notes and "GPU(s) 0-7, 24-31" in notes
    assert "actor.generation replicas 0-3 until round" in notes
    # proven: the whole program verifies against the plans, memory included
    verify_program(program_json(compiled), against=module)
    bounds = link_bounds(compiled.program, compiled.cost)
    assert compiled.summary["bounds"]["busiest_nic_seconds"] == bounds.busiest_nic_seconds
    assert compiled.summary["bounds"]["average_nic_seconds"] <= bounds.busiest_nic_seconds
    assert "link bounds: busiest NIC" in summary_text(compiled.summary)


def test_a_schedule_memory_does_not_split_is_not_paced():
    _, compiled = _compile("8GB")
    assert len(compiled.program.schedule.rounds) == 1
    assert not any("paced" in n or "memory sets" in n for n in compiled.program.schedule.notes)


def test_a_paced_round_counts_each_buffer_once():
    """A round whose remaining transfers fit in one go gets no pace (`_pace` returns {}),
    and then nothing limits a GPU but its free memory. The scheduler used to charge every
    GPU missing from the pace twice for each buffer in such a round, which split it: at
    4.5 GB the paced schedule then lost to the greedy one (0.0347 s), and the greedy one
    was kept; counted once, the paced one wins (0.0324 s)."""
    module, compiled = _compile("4500MB")
    schedule = compiled.program.schedule
    assert any("paced rounds" in n for n in schedule.notes)
    unpaced, _ = _unpaced(compiled.dag, staging=True)
    assert compiled.cost.seconds < 0.95 * schedule_seconds(compiled.dag, unpaced)
    verify_program(program_json(compiled), against=module)
