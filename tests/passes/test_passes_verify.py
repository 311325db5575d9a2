"""Verifier: passes compiled programs, fails corrupted ones with the right message."""

import copy
import json

import pytest

from builders import colocated_module, fig5_module
from nereus.ir.diagnostics import ProgramError
from nereus.passes import compile_transition
from nereus.backends.json_program import program_json
from nereus.passes.verify import verify_program

TARGETS = ["tp_up", "extend", "destroy", "split", "moved"]


@pytest.fixture(scope="module")
def programs():
    m = fig5_module()
    return {t: program_json(compile_transition(m, "S1", t), version=1) for t in TARGETS}


@pytest.mark.parametrize("target", TARGETS)
def test_compiled_programs_verify(programs, target):
    report = verify_program(programs[target])
    assert report.rounds >= 1 and report.segments > 0


def _first(program, kind):
    for k, rnd in enumerate(program["rounds"]):
        for i, op in enumerate(rnd["ops"]):
            if op["op"] == kind:
                return k, i, op
    raise LookupError(kind)


def _volume(box):
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _seg_bytes(program, seg):
    dtype = {t["name"]: t["dtype"] for t in program["tensors"]}[seg["tensor"]]
    return _volume(seg["box"]) * (4 if dtype == "fp32" else 2)


def test_double_write_fails(programs):
    p = copy.deepcopy(programs["tp_up"])
    _, _, op = _first(p, "send")
    op["segments"].append(dict(op["segments"][0]))
    op["bytes"] += _seg_bytes(p, op["segments"][0])
    with pytest.raises(ProgramError, match="written twice"):
        verify_program(p)


def test_missing_box_fails(programs):
    p = copy.deepcopy(programs["tp_up"])
    _, _, op = _first(p, "send")
    seg = op["segments"].pop()
    op["bytes"] -= _seg_bytes(p, seg)
    with pytest.raises(ProgramError, match="missing box"):
        verify_program(p)


def test_bytes_mismatch_fails(programs):
    p = copy.deepcopy(programs["split"])
    _, _, op = _first(p, "send")
    op["bytes"] += 2
    with pytest.raises(ProgramError, match="declares"):
        verify_program(p)


def test_read_after_free_fails(programs):
    p = copy.deepcopy(programs["tp_up"])
    k, i, op = _first(p, "send")
    src_unit = op["segments"][0]["src_unit"]
    frees = [o for o in p["rounds"][k]["ops"] if o["op"] == "free" and o["unit"] == src_unit and o["gpu"] == op["src"]]
    p["rounds"][k]["ops"].remove(frees[0])
    p["rounds"].insert(0, {"ops": [frees[0]]})
    for index, rnd in enumerate(p["rounds"]):  # each op's `round` field follows it
        for o in rnd["ops"]:
            o["round"] = index
    with pytest.raises(ProgramError, match="read after free"):
        verify_program(p)


def test_over_capacity_fails(programs):
    p = copy.deepcopy(programs["extend"])
    for g in p["gpus"]:
        g["capacity_bytes"] = 1000
    with pytest.raises(ProgramError, match="capacity"):
        verify_program(p)


def test_layout_that_misses_a_tensor_fails(programs):
    p = copy.deepcopy(programs["destroy"])
    unit = p["units"]["after"][0]
    unit["shards"] = [s for s in unit["shards"] if s["tensor"] != "actor/embed.weight"]
    with pytest.raises(ProgramError, match="do not cover its tensors"):
        verify_program(p)


def test_partial_keep_fails(programs):
    p = copy.deepcopy(programs["extend"])
    _, _, op = _first(p, "keep")
    op["segments"][0]["box"] = [[0, 1]] + op["segments"][0]["box"][1:]
    with pytest.raises(ProgramError):
        verify_program(p)


def test_errors_name_round_and_op(programs):
    p = copy.deepcopy(programs["split"])
    k, i, op = _first(p, "send")
    op["bytes"] += 2
    with pytest.raises(ProgramError, match=rf"round {k}, op {i} \(send\)"):
        verify_program(p)


def test_compile_is_deterministic():
    m = fig5_module()
    a = json.dumps(program_json(compile_transition(m, "S1", "tp_up"), version=1))
    b = json.dumps(program_json(compile_transition(m, "S1", "tp_up"), version=1))
    assert a == b


def test_colocated_actor_and_critic_with_optimizer_state():
    m = colocated_module()
    program = program_json(compile_transition(m, "A", "B"), version=1)
    names = {t["name"] for t in program["tensors"]}
    assert "critic/value_head.weight#exp_avg_sq" in names and "actor/lm_head.weight" in names
    verify_program(program)


def test_identical_programs_across_hash_seeds():
    """Every rank compiles on its own: output must not depend on PYTHONHASHSEED."""
    import os
    import subprocess
    import sys

    code = ("import sys, json, hashlib; sys.path.insert(0, %r); from builders import fig5_module;"
            "from nereus.passes import compile_transition; from nereus.backends.json_program import program_json;"
            "print(hashlib.sha256(json.dumps(program_json(compile_transition(fig5_module(), 'S1', 'tp_up'), version=1))"
            ".encode()).hexdigest())") % os.path.dirname(__file__)
    digests = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1
