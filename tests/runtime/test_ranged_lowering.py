"""The runtime lowers a v2 part's ranges as ranges (nereus.runtime.pieces): a segment with
`at` becomes pieces that each move one slice of every member of the range, so the work
list of an expert-parallel part has as many pieces for 48 layers as for 2; expanded
member by member, its pieces are those of the v1 part of the same compile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes"))

from test_passes_moe import TRANSITIONS, transitions_module  # noqa: E402

import nereus.ir as ir  # noqa: E402
from nereus.backends.rank_json import rank_program_json  # noqa: E402
from nereus.ir.program import expand_ranges  # noqa: E402
from nereus.passes import compile_transition  # noqa: E402
from nereus.runtime.program import rank_program  # noqa: E402


@pytest.fixture(scope="module")
def moe_module():
    return transitions_module(experts=8)


def _member_pieces(pieces) -> list:
    """Each piece once per tensor it moves, as comparable tuples (a v1 piece moves one)."""
    return sorted((name, p.src_unit, p.dst_unit, p.src_slices, p.dst_slices, p.numel, p.nbytes, p.box, p.direct,
                   p.src_whole, p.dst_whole, p.parts) for p in pieces for name in p.tensors)


def _by_message(prog) -> dict:
    out = {}
    for work in prog.rounds:
        out[(work.index, "copy")] = _member_pieces(work.copies)
        out[(work.index, "alias")] = sorted((n, a.src_unit, a.dst_unit) for a in work.aliases for n in a.tensors)
        for side, messages in (("send", work.sends), ("recv", work.recvs)):
            for m in messages:
                out[(work.index, side, m.peer, m.op_index)] = (m.nbytes, _member_pieces(m.pieces))
    return out


@pytest.mark.parametrize("name", sorted(TRANSITIONS))
def test_ranges_lower_to_the_pieces_of_the_v1_part(moe_module, name):
    compiled = compile_transition(moe_module, f"{name}_a", f"{name}_b")
    for rank in range(8):
        part = rank_program_json(compiled, rank)
        ranged, v1 = rank_program(part, rank), rank_program(expand_ranges(part), rank)
        assert _by_message(ranged) == _by_message(v1)
        assert (ranged.send_bytes, ranged.recv_bytes, ranged.copy_bytes, ranged.keep_bytes) == \
            (v1.send_bytes, v1.recv_bytes, v1.copy_bytes, v1.keep_bytes)
        assert ranged.before == v1.before and ranged.after == v1.after


def _qwen(layers: int, after: str) -> ir.Module:
    return ir.parse_source(f"""
cluster c {{ nodes 1 gpus_per_node 2 gpu {{ mem 80GB flops 1TFLOPS hbm 100GB/s }} intra 10GB/s inter 1GB/s host_mem 64GB }}
model actor = qwen3_moe {{ layers {layers} hidden 64 heads 4 kv_heads 2 head_dim 16 ffn 128 vocab 256 dtype bf16
                          experts 16 experts_per_token 2 expert_ffn 32 }}
workload w {{ batch 4 prompt 4 response 4 microbatch 1 training: actor }}
plan A {{ actor.training dp 1 ep 2 on 0..1 }}
plan B {{ actor.training {after} on 0..1 }}
""", "ranged.nir")


def _counts(layers: int, after: str, rank: int = 0) -> tuple:
    """(pieces, tensors they move) of rank `rank`'s work list, v2 as lowered."""
    prog = rank_program(rank_program_json(compile_transition(_qwen(layers, after), "A", "B"), rank), rank)
    pieces = [p for w in prog.rounds for p in w.copies + tuple(p for m in w.sends + w.recvs for p in m.pieces)]
    return len(pieces), sum(p.count for p in pieces)


@pytest.mark.parametrize("after", ["dp 1 tp 2", "dp 2"])
def test_the_pieces_of_a_moe_part_do_not_grow_with_layers_and_experts(after):
    few, few_members = _counts(2, after)
    many, many_members = _counts(12, after)
    assert many_members > 5 * few_members  # the members grow with the layers ...
    assert many == few  # ... the pieces that move them do not


def test_a_part_restricted_to_some_model_stages_stays_ranged(moe_module):
    """restrict_program (a job that registered fewer model-stages than the program moves)
    keeps a v2 part's ranges; lowered, it gives the pieces of its v1 expansion restricted."""
    from nereus.runtime.program import restrict_program

    compiled = compile_transition(moe_module, "ep_to_tp_a", "ep_to_tp_b")
    for rank in range(4):
        part = rank_program_json(compiled, rank)
        restricted = restrict_program(part, ["actor.training"])
        assert restricted["version"] == 2
        assert any("at" in seg for rnd in restricted["rounds"] for op in rnd["ops"] for seg in op.get("segments", ()))
        assert {u["model_stage"] for side in ("before", "after") for u in restricted["units"][side]} == \
            {"actor.training"}
        expanded = restrict_program(expand_ranges(part), ["actor.training"])
        assert _by_message(rank_program(restricted, rank)) == _by_message(rank_program(expanded, rank))
