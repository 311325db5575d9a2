"""rollback="auto" (the CUDA default): an old shard the program frees stays on its device
until the commit when the memory replay has room for it, and is parked in host memory
only when a later round needs the room. Same programs and CPU-as-device trick as
test_rollback_memory.py; one launch of 4 gloo processes runs every case.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from nereus.passes.verify import verify_program
from nereus.runtime.parking import park_plan, park_replay, replay
from nereus.runtime.program import rank_program

from nereus.ir.model import Model

from runtime_helpers import naive_program, oracle_units, reference_state, spawn, tensor_list
from test_rollback_memory import MODEL, WORLD, _executor_case, early_frees

CRITIC = Model("critic", "llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)
REWARD = Model("reward", "llama", layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)


def _one(model, before, after) -> dict:
    stage = f"{model.name}.training"
    return early_frees(naive_program(oracle_units(model, stage, *before), oracle_units(model, stage, *after),
                         tensor_list(model, training=True), rounds=2, gpus=WORLD))


def _chain(models) -> dict:
    """Each model tp 2 on GPUs 0, 1 -> tp 4 on 0..3, one after the other."""
    parts = [_one(model, (1, 2, 1, [0, 1]), (1, 4, 1, [0, 1, 2, 3])) for model in models]
    out = dict(parts[0])
    out["tensors"] = [t for p in parts for t in p["tensors"]]
    out["units"] = {k: [u for p in parts for u in p["units"][k]] for k in ("before", "after")}
    out["rounds"] = [r for p in parts for r in p["rounds"] if r["ops"]]
    return out


def _programs() -> dict:
    """"split": the actor, then the critic, one after the other: GPUs 0 and 1 free the
    actor's old shards (round 1) before the critic's new shards arrive (rounds 2-3), so at
    the replay's peak the actor's old shards must have left. "three": the actor, the
    critic, then a reward model: GPUs 0 and 1 release three old units (rounds 1, 3, 5)."""
    return {"split": _chain((MODEL, CRITIC)), "three": _chain((MODEL, CRITIC, REWARD))}

pytestmark = pytest.mark.multiprocess


def _tight(program: dict, rank: int) -> int:
    """This rank's replay peak: no freed shard may stay on the device while a later round
    reaches it."""
    peaks, final = replay(rank_program(program, rank))
    return max(peaks + [final])


def _room_for_one(program: dict, rank: int):
    """A capacity with room beyond the replay for the first old unit this rank releases
    and nothing more at that unit's later peak (None where it releases none)."""
    replayed = park_replay(rank_program(program, rank))
    if not replayed.released:
        return None
    return replayed.later[0] + replayed.released[0][2]


def _within_the_replay(program: dict, rank: int, capacity: int, held_by_round: list) -> list:
    """(round, bytes) where the replay's peak plus the old shards held on the device since
    earlier rounds exceed `capacity` (and "final" for the state after the last round)."""
    peaks, final = replay(rank_program(program, rank))
    over = [(i, peaks[i] + held_by_round[i - 1]) for i in range(1, len(peaks))
            if peaks[i] + held_by_round[i - 1] > capacity]
    if final + held_by_round[-1] > capacity:
        over.append(("final", final + held_by_round[-1]))
    return over


def _run(rank, world, programs):
    control = dist.new_group(backend="gloo")
    full = reference_state(tensor_list(MODEL, training=True) + tensor_list(CRITIC, training=True))
    split = programs["split"]
    last = len(split["rounds"]) - 1
    return {
        "roomy": _executor_case(rank, control, split, full, "auto"),
        "host": _executor_case(rank, control, split, full, "host"),
        "tight": _executor_case(rank, control, split, full, "auto", capacity=_tight(split, rank)),
        "fault tight": _executor_case(rank, control, split, full, "auto", (1, last, "pack"),
                                      capacity=_tight(split, rank)),
        "fault roomy": _executor_case(rank, control, split, full, "auto", (1, last, "pack")),
        "room for one": _executor_case(rank, control, programs["three"], reference_state(
            tensor_list(MODEL, training=True) + tensor_list(CRITIC, training=True) +
            tensor_list(REWARD, training=True)), "auto", capacity=_room_for_one(programs["three"], rank)),
    }


@pytest.fixture(scope="module")
def per_rank():
    programs = _programs()
    results = spawn(_run, WORLD, programs)
    for r, res in enumerate(results):
        assert res is not None and res[0] == "ok", f"rank {r}: {res}"
    return [res[1] for res in results]


def test_replay_matches_the_verifier():
    program = _programs()["split"]
    assert any(op["op"] == "free" for op in program["rounds"][1]["ops"]) and len(program["rounds"]) == 4
    replayed = verify_program(program)
    for rank in range(WORLD):
        peaks, _ = replay(rank_program(program, rank))
        assert max(peaks) == replayed.peak_bytes.get(rank, 0), rank


def test_park_plan_parks_nothing_with_room_and_what_a_later_peak_needs_without():
    program = _programs()["split"]
    parked_somewhere = False
    for rank in range(WORLD):
        prog = rank_program(program, rank)
        released = {u for w in prog.rounds for u in w.frees + w.stage_outs}
        assert park_plan(prog, 0, None) == set()
        assert park_plan(prog, 0, 10**15) == set()
        tight = park_plan(prog, 0, _tight(program, rank))
        assert tight <= released
        parked_somewhere |= bool(tight)
        # a unit freed in the last round never has to leave: nothing comes after it
        last = prog.rounds[-1].frees
        assert not (tight & set(last)) or len(prog.rounds) == 1
    assert parked_somewhere


def test_auto_with_room_parks_nothing_and_holds_the_freed_shards(per_rank):
    for rank, cases in enumerate(per_rank):
        roomy, host = cases["roomy"], cases["host"]
        assert roomy["mismatched"] == [] and roomy["rollback"] == "auto", (rank, roomy)
        assert roomy["parked_bytes"] == 0, (rank, roomy)
        assert roomy["held_bytes"] == host["parked_bytes"], (rank, roomy, host)
        # the old tensors outlive their free round (held for the commit), as with rollback="device"
        assert bool(roomy["hook"]["dead_too_late"]) == (roomy["held_bytes"] > 0), (rank, roomy["hook"])
    assert sum(cases["roomy"]["held_bytes"] for cases in per_rank) > 0


def test_auto_on_a_full_gpu_parks_only_part_and_stays_within_the_replay(per_rank):
    parked = held = 0
    for rank, cases in enumerate(per_rank):
        tight, host = cases["tight"], cases["host"]
        assert tight["mismatched"] == [], (rank, tight)
        assert tight["parked_bytes"] + tight["held_bytes"] == host["parked_bytes"], (rank, tight, host)
        parked += tight["parked_bytes"]
        held += tight["held_bytes"]
        split = _programs()["split"]
        assert _within_the_replay(split, rank, _tight(split, rank), tight["held_by_round"]) == [], (rank, tight)
    assert parked > 0 and held > 0, (parked, held)


def test_the_room_for_one_case_releases_three_old_units_and_its_replay_fits():
    """The setup of the next test: three old units leave GPUs 0 and 1 (rounds 1, 3, 5),
    and the replay alone fits the capacity that has room for the first one beyond it."""
    program = _programs()["three"]
    for rank in range(WORLD):
        capacity = _room_for_one(program, rank)
        if capacity is not None:
            assert len(park_replay(rank_program(program, rank)).released) == 3
            assert max(replay(rank_program(program, rank))[0]) <= capacity  # the replay itself fits


def test_auto_on_a_gpu_with_room_for_one_old_unit_holds_one_and_stays_within_it(per_rank):
    """The bytes held on the device never take a round (or the final state) past the
    capacity. Fails when park_plan forgets the bytes it already holds (it then keeps the
    second unit too: round 4's peak plus two units exceeds it)."""
    program = _programs()["three"]
    parked = held = 0
    for rank, cases in enumerate(per_rank):
        out = cases["room for one"]
        assert out["mismatched"] == [], (rank, out)
        capacity = _room_for_one(program, rank)
        if capacity is None:
            continue
        assert _within_the_replay(program, rank, capacity, out["held_by_round"]) == [], (rank, out)
        parked += out["parked_bytes"]
        held += out["held_bytes"]
    assert parked > 0 and held > 0, (parked, held)


@pytest.mark.parametrize("case", ["fault tight", "fault roomy"])
def test_auto_aborts_restore_the_old_state_exactly(per_rank, case):
    for rank, cases in enumerate(per_rank):
        result = cases[case]
        assert "injected fault" in result["aborted"], (rank, result)
        assert result["restored_exact"] and result["restored_names"], (rank, result)
    if case == "fault roomy":  # nothing was parked: every old tensor is the caller's own
        assert all(cases[case]["restored"] == 0 for cases in per_rank)
    else:
        assert sum(cases[case]["restored"] for cases in per_rank) > 0
