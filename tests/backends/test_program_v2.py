"""JSON program v2 (docs/program.md, "Version 2: ranges"): tensor families and `at`
ranges stand for exactly the v1 program of the same compile, the verifier proves them
without expanding them, and rank parts are the whole v2 program cut per rank."""

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "passes"))

from builders import cluster, module, place, workload  # noqa: E402
from test_passes_moe import TRANSITIONS, transitions_module  # noqa: E402

from nereus.backends.json_program import program_json  # noqa: E402
from nereus.backends.rank_json import rank_program_json, split_by_rank  # noqa: E402
from nereus.ir.diagnostics import ProgramError  # noqa: E402
from nereus.ir.program import expand_ranges, expand_segment_units, program_from_json  # noqa: E402
from nereus.passes import compile_transition  # noqa: E402
from nereus.passes.verify import verify_program  # noqa: E402


@pytest.fixture(scope="module")
def moe_module():
    return transitions_module(experts=8)  # 8 experts: runs of several experts per EP rank


def _canonical(program: dict) -> dict:
    """A v1 dict with each op's segments and each unit's shards as sorted lists: v2 lists
    a message's segments family by family, v1 layer by layer (same members, same boxes)."""
    program = expand_segment_units(program)
    out = dict(program, tensors=sorted(program["tensors"], key=lambda t: t["name"]))
    out["units"] = {side: [dict(u, shards=sorted(u["shards"], key=json.dumps)) for u in units]
                    for side, units in program["units"].items()}
    out["rounds"] = [{"ops": [dict(op, segments=sorted(op["segments"], key=json.dumps)) if "segments" in op else op
                              for op in rnd["ops"]]} for rnd in program["rounds"]]
    return out


@pytest.mark.parametrize("name", sorted(TRANSITIONS))
def test_v2_stands_for_the_v1_program_of_the_same_compile(moe_module, name):
    compiled = compile_transition(moe_module, f"{name}_a", f"{name}_b")
    v1, v2 = program_json(compiled, version=1), program_json(compiled)
    assert v1["version"] == 1 and v2["version"] == 2
    assert _canonical(expand_ranges(v2)) == _canonical(v1)
    # fewer segments: one per family, box and expert run instead of one per member
    count = lambda p: sum(len(op.get("segments", ())) for rnd in p["rounds"] for op in rnd["ops"])  # noqa: E731
    assert count(v2) < count(v1)
    r1, r2 = verify_program(v1, against=moe_module), verify_program(v2, against=moe_module)
    assert (r2.rounds, r2.ops, r2.bytes_moved, r2.peak_bytes) == (r1.rounds, r1.ops, r1.bytes_moved, r1.peak_bytes)
    assert r2.warnings == ()
    # the expansion is itself a v1 program that verifies
    verify_program(expand_ranges(v2), against=moe_module)


@pytest.mark.parametrize("name", ["ep_to_tp", "pp_ep_to_tp_dp"])
def test_v2_rank_parts_are_the_whole_v2_program_cut_per_rank(moe_module, name):
    compiled = compile_transition(moe_module, f"{name}_a", f"{name}_b")
    whole = program_json(compiled)
    parts = split_by_rank(whole)
    for rank in range(4):
        mine = rank_program_json(compiled, rank)
        assert mine["version"] == 2
        assert mine == parts[rank]
        # and it expands to the v1 part of the same compile: the same ops, the same own
        # shards; of a peer's shards v2 lists whole families where v1 lists the members
        # its messages name
        v2, v1 = _canonical(expand_ranges(mine)), _canonical(rank_program_json(compiled, rank, version=1))
        assert v2["rounds"] == v1["rounds"]
        for side in ("before", "after"):
            shards2 = {(u["id"], json.dumps(s)) for u in v2["units"][side] for s in u["shards"]}
            shards1 = {(u["id"], json.dumps(s)) for u in v1["units"][side] for s in u["shards"]}
            assert shards1 <= shards2
            assert {x for x in shards2 if f'"gpu": {rank},' in x[1]} == {x for x in shards1 if f'"gpu": {rank},' in x[1]}


def _first_ranged(program: dict, kind: str):
    for k, rnd in enumerate(program["rounds"]):
        for i, op in enumerate(rnd["ops"]):
            if op["op"] == kind:
                for j, seg in enumerate(op["segments"]):
                    if "at" in seg and len(seg["at"]) == 2:
                        return k, i, j
    raise AssertionError("no ranged segment")


def test_the_verifier_catches_ranged_errors(moe_module):
    compiled = compile_transition(moe_module, "ep_to_tp_a", "ep_to_tp_b")
    good = program_json(compiled)
    k, i, j = _first_ranged(good, "send")

    def broken(change) -> dict:
        program = copy.deepcopy(good)
        change(program["rounds"][k]["ops"][i], program["rounds"][k]["ops"][i]["segments"][j])
        return program

    cases = {
        # one member more: an expert the source does not hold (or written twice)
        "widened": lambda op, seg: seg["at"][1].__setitem__(1, seg["at"][1][1] + 1),
        # one member less: the byte count no longer matches, or a box stays unwritten
        "narrowed": lambda op, seg: seg["at"][0].__setitem__(1, seg["at"][0][1] - 1) if seg["at"][0][1] - 1 >
        seg["at"][0][0] else seg["at"][1].__setitem__(1, seg["at"][1][1] - 1),
        "outside": lambda op, seg: seg.__setitem__("at", [[0, 99], seg["at"][1]]),
        "not a range": lambda op, seg: seg.__setitem__("at", [[3, 1], seg["at"][1]]),
        "no at": lambda op, seg: seg.pop("at"),
        "twice": lambda op, seg: op["segments"].append(copy.deepcopy(seg)),
    }
    for label, change in cases.items():
        with pytest.raises(ProgramError) as error:
            verify_program(broken(change))
        assert f"round {k}, op {i}" in str(error.value) or "after round" in str(error.value), label


def test_v1_programs_still_read_and_a_v3_is_refused(moe_module):
    compiled = compile_transition(moe_module, "ep_to_dp_a", "ep_to_dp_b")
    v1 = program_json(compiled, version=1)
    assert program_from_json(v1).data is v1 and expand_ranges(v1) is v1
    verify_program(v1, against=moe_module)
    with pytest.raises(ProgramError, match="reads versions 1 and 2"):
        program_from_json(dict(v1, version=3))


def test_a_v1_program_may_not_use_ranges(moe_module):
    compiled = compile_transition(moe_module, "ep_to_dp_a", "ep_to_dp_b")
    # v2 text relabelled v1: its families are unknown tensor names there
    with pytest.raises(ProgramError):
        verify_program(dict(program_json(compiled), version=1))


def test_dense_programs_range_over_layers_too():
    c = cluster(1, 4, mem=10**12)
    w = workload({"training": ["actor"]})
    from nereus.ir.model import Model

    model = Model("actor", "llama", 6, 64, 4, 2, 96, 128, "bf16")
    m = module(c, [model], w, {"A": [place("actor.training", 2, 2, 1, range(4))],
                               "B": [place("actor.training", 1, 2, 2, range(4))]})
    compiled = compile_transition(m, "A", "B")
    v2 = program_json(compiled)
    assert any("at" in s for rnd in v2["rounds"] for op in rnd["ops"] for s in op.get("segments", ()))
    assert _canonical(expand_ranges(v2)) == _canonical(program_json(compiled, version=1))
    verify_program(v2, against=m)
