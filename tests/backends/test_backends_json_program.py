"""JSON program v1: required fields, plan layouts for the runtime, per-rank lists."""

import pytest

from builders import fig5_module
from nereus.backends.json_program import plan_units_json, program_from_json, rank_program
from nereus.ir.diagnostics import ProgramError
from nereus.passes import compile_transition
from nereus.backends.json_program import program_json


def test_required_fields_and_round_trip():
    data = program_json(compile_transition(fig5_module(), "S1", "tp_up"), version=1)
    for key in ("format", "version", "transition", "gpus", "tensors", "units", "resident_bytes", "rounds"):
        assert key in data
    assert program_from_json(data).to_json() is data
    unit = data["units"]["after"][0]
    assert {"id", "model_stage", "replica", "gpus", "shards"} <= set(unit)
    op_keys = {"alloc": {"gpu", "unit", "bytes"}, "keep": {"gpu", "segments"}, "copy": {"gpu", "segments", "bytes"},
               "send": {"src", "dst", "segments", "bytes"}, "free": {"gpu", "unit", "bytes"}}
    for rnd in data["rounds"]:
        for op in rnd["ops"]:
            assert op_keys[op["op"]] <= set(op)
            for seg in op.get("segments", ()):
                assert set(seg) == {"tensor", "box", "src_unit", "dst_unit"}
    with pytest.raises(ProgramError, match="version"):
        program_from_json(dict(data, version=3))


def test_plan_units_match_program_units():
    m = fig5_module()
    data = program_json(compile_transition(m, "S1", "tp_up"), version=1)
    assert plan_units_json(m, "S1", "actor.training") == data["units"]["before"]
    assert plan_units_json(m, "tp_up") == data["units"]["after"]


def test_every_send_has_its_recv_in_the_same_round():
    data = program_json(compile_transition(fig5_module(), "S1", "split"), version=1)
    per_rank = [rank_program(data, g) for g in range(len(data["gpus"]))]
    for k in range(len(data["rounds"])):
        sends = sorted((op["id"], op["src"], op["dst"]) for ops in per_rank for op in ops[k] if op["op"] == "send")
        recvs = sorted((op["id"], op["src"], op["dst"]) for ops in per_rank for op in ops[k] if op["op"] == "recv")
        assert sends == recvs and sends
