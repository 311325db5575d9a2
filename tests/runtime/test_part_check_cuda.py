"""A wrong program on one GPU (nereus.runtime.part_check): the runtime refuses it before
any byte moves and the old state stays on the GPU, with the proof off (the rank's own
check names the copy that writes a fused qkv's k rows twice and never its v rows) and
with the proof on (the part differs from the proven one; rank 0's prover process, the
default on CUDA). The same transition untampered commits byte for byte. One rank; runs
on CUDA only (tests/runtime/test_part_check.py runs the multi-rank cases on gloo).
"""

from __future__ import annotations

import copy

import pytest
import torch

import nereus.ir as ir
from nereus.ir.diagnostics import ProgramError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# the weights move from the GPU to host memory (offload): one copy op, whose fused qkv
# travels as its q, k and v segments (k and v 16 rows each)
SOURCE = """
cluster one { nodes 1 gpus_per_node 1 gpu { mem 1GB flops 1TFLOPS hbm 100GB/s } intra 10GB/s inter 1GB/s host_mem 16GB }
model actor = llama { layers 1 hidden 32 heads 4 kv_heads 2 ffn 64 vocab 64 }
workload w { batch 2 prompt 8 response 8 microbatch 1  generation: actor }
plan A { actor.generation dp 1 on 0 }
plan B { actor.generation dp 1 on 0 offload }
"""
QKV = "actor/layers.0.attn.qkv.weight"


def _k_twice(part: dict) -> dict:
    """The copy writes the k rows twice and never the v rows (the part written as v1)."""
    from nereus.ir.program import expand_ranges

    part = copy.deepcopy(expand_ranges(part))
    for rnd in part["rounds"]:
        for op in rnd["ops"]:
            segs = [s for s in op.get("segments", ()) if s["tensor"] == QKV]
            if op["op"] == "copy" and len(segs) == 3:
                segs[2]["box"] = copy.deepcopy(segs[1]["box"])
                return part
    raise AssertionError("no copy of the fused qkv in three segments")


def _runtime(verify_programs: bool):
    from nereus.runtime import Runtime

    from runtime_helpers import single_process_control

    single_process_control()
    rt = Runtime(ir.parse_source(SOURCE, "one.nir"), "A", device=torch.device("cuda", 0), ahead="off",
                 verify_programs=verify_programs)
    gen = torch.Generator().manual_seed(9)
    full = {n: torch.randn(s, generator=gen).to(d) for n, (s, d) in rt.tensor_specs("actor.generation").items()}
    rt.register("actor.generation", rt.shard_state_dict("actor.generation", full))
    return rt, full


@pytest.mark.parametrize("verify_programs", [False, True])
def test_a_copy_writing_k_twice_is_refused_and_the_old_state_stays_on_the_gpu(monkeypatch, verify_programs):
    import nereus.runtime.distribute as distribute

    own = distribute._lower_own_part

    def tampered(*args, **options):
        compiled, part = own(*args, **options)
        return compiled, _k_twice(part)

    monkeypatch.setattr(distribute, "_lower_own_part", tampered)
    rt, full = _runtime(verify_programs)
    try:
        held = {n: t.clone() for n, t in rt.state("actor.generation").items()}
        with pytest.raises(ProgramError) as caught:
            rt.transition("B")
        text = caught.value.message
        if verify_programs:  # the proof came first: the part is not the proven one
            assert "rank 0 refuses its part of the program A -> B: its digest" in text, text
        else:
            assert text.startswith("rank 0 refuses its part of the program A -> B: round 0, op 1 (copy) writes "
                                   "[[32, 48], [0, 32]]"), text
            assert "elements written twice" in text, text
        now = rt.state("actor.generation")
        assert rt.plan == "A" and set(now) == set(held)
        assert all(now[n].is_cuda and torch.equal(now[n], t) for n, t in held.items())
    finally:
        rt.close()


def test_the_same_transition_untampered_commits_exactly():
    rt, full = _runtime(True)
    try:
        report = rt.transition("B")
        now = rt.state("actor.generation")
        assert rt.plan == "B" and report.verify_program_s is not None
        assert set(now) == set(full) and all(now[n].device.type == "cpu" and torch.equal(now[n], full[n])
                                             for n in full)
    finally:
        rt.close()
