"""Every rank checks its own part before any byte moves, proven or not
(nereus.runtime.part_check, docs/program.md "In the runtime"): its receives, copies and
keeps write every element of its new shards once, and every sender packs what its
receiver expects. A wrong program is refused on every rank, old state intact, with the
round and op named; with verify=True the checksums compare the source region the
receiver expects, so a pack from the wrong rows is caught too.

The wrong programs (written as v1, the parts' ranges written out member by member): a
send that writes a fused qkv's k rows twice and never its v rows (the element count per
tensor is right), a sender that packs two segments in another order than its receiver
unpacks them, a sender whose piece reads the v rows for the k rows, and one that labels
the v rows as k rows. One launch of 2 gloo processes runs every multi-process case.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

import nereus.ir as ir
from nereus.backends.json_program import program_json
from nereus.ir.diagnostics import ProgramError
from nereus.ir.program import expand_ranges
from nereus.passes import compile_transition
from nereus.runtime import part_check
from nereus.runtime.program import rank_program

from runtime_helpers import spawn_ok

WORLD = 2
# tp 2 -> dp 2 of the generation weights: each GPU sends the other its q, k and v rows of
# the fused qkv as three segments of one send (k and v: 8 rows each); the sync of plan A
# (training whole on GPU 0 -> generation tp 2) sends GPU 1 its q, k, v rows from GPU 0
SOURCE = """
cluster cpu {
  nodes 1
  gpus_per_node 2
  gpu { mem 1GB  flops 1TFLOPS  hbm 100GB/s }
  intra 10GB/s
  inter 1GB/s
  host_mem 16GB
}
model actor = llama { layers 1 hidden 32 heads 4 kv_heads 2 ffn 64 vocab 64 }
workload w {
  batch 2  prompt 8  response 8  microbatch 1
  generation: actor
  training: actor
}
plan A { actor.generation dp 1 tp 2 on 0, 1   actor.training dp 1 on 0 }
plan B { actor.generation dp 2 on 0, 1   actor.training dp 1 on 0 }
"""
QKV = "actor/layers.0.attn.qkv.weight"


def _qkv_segments(part: dict) -> tuple:
    """(the send 0 -> 1, its q, k, v segments of the fused qkv, in order)."""
    for rnd in part["rounds"]:
        for op in rnd["ops"]:
            if op["op"] == "send" and (op["src"], op["dst"]) == (0, 1):
                segs = [s for s in op["segments"] if s["tensor"] == QKV]
                assert len(segs) == 3, segs
                return op, segs
    raise AssertionError("no send 0 -> 1")


def k_twice(part: dict) -> dict:
    """The send 0 -> 1 writes the k rows twice and never the v rows (same byte count)."""
    part = copy.deepcopy(expand_ranges(part))
    _, (_, k, v) = _qkv_segments(part)
    v["box"] = copy.deepcopy(k["box"])
    return part


def k_v_swapped(part: dict) -> dict:
    """The send 0 -> 1 lists the v segment before the k segment."""
    part = copy.deepcopy(expand_ranges(part))
    op, (_, k, v) = _qkv_segments(part)
    i, j = op["segments"].index(k), op["segments"].index(v)
    op["segments"][i], op["segments"][j] = v, k
    return part


def _whole(source: str, target: str) -> dict:
    """The whole program, its ranges (v2) written out member by member (v1)."""
    return expand_ranges(program_json(compile_transition(ir.parse_source(SOURCE, "check.nir"), source, target)))


# -- one process: the checks themselves ---------------------------------------------------


def test_a_send_writing_k_twice_and_v_never_is_refused_by_its_receiver_naming_the_op():
    program = k_twice(_whole("A", "B"))
    rank_program(program, 0)  # the sender's own shards are written right
    with pytest.raises(ProgramError) as caught:
        rank_program(program, 1)
    text = caught.value.message
    assert text.startswith("rank 1 refuses its part of the program A -> B: round 0, op "), text
    assert "(send 0 -> 1) writes [[32, 40], [0, 32]] of actor/layers.0.attn.qkv.weight" in text, text
    assert "elements written twice" in text, text


def test_what_no_op_writes_and_a_box_outside_its_tensor_are_named():
    program = _whole("A", "B")
    op, (_, _, v) = _qkv_segments(program)
    op["segments"].remove(v)
    op.pop("bytes")
    with pytest.raises(ProgramError, match=r"no op writes 256 of the 512 elements of box \[\[48, 64\], \[0, 32\]\]"):
        rank_program(program, 1)
    program = _whole("A", "B")
    _qkv_segments(program)[1][2]["box"] = [[56, 72], [0, 32]]  # qkv has 64 rows
    with pytest.raises(ProgramError, match=r"moves box \[\[56, 72\], \[0, 32\]\] of .*qkv.* no box inside the tensor"):
        rank_program(program, 1)


def test_a_read_after_its_free_is_refused_and_a_receive_from_a_peers_shard_is_not():
    program = _whole("A", "B")
    ops = program["rounds"][0]["ops"]
    late = [op for op in ops if (op["op"] == "send" and op["src"] == 0) or (op["op"] == "free" and op["gpu"] == 0)]
    program["rounds"] = [{"ops": [op for op in ops if op not in late]}, {"ops": late}]
    rank_program(program, 1)  # GPU 1 freed its shard of the unit in round 0; round 1 receives GPU 0's
    rank_program(program, 0)
    free = next(op for op in late if op["op"] == "free")
    program["rounds"][1]["ops"].remove(free)
    program["rounds"][0]["ops"].append(free)
    with pytest.raises(ProgramError, match=r"round 1, op 0 \(send 0 -> 1\) reads .* from before unit "
                                           r"actor.generation/0, which round 0 freed"):
        rank_program(program, 0)


def test_sender_and_receiver_digests_differ_when_they_order_a_message_apart():
    program = _whole("A", "B")
    sender, receiver = rank_program(k_v_swapped(program), 0), rank_program(program, 1)
    views = [sender.pair_digests, receiver.pair_digests]
    assert (part_check.balance(views[0], 0) + part_check.balance(views[1], 1)) % (1 << 64) != 0
    right = [rank_program(program, 0).pair_digests, receiver.pair_digests]
    assert (part_check.balance(right[0], 0) + part_check.balance(right[1], 1)) % (1 << 64) == 0
    assert part_check.first_disagreeing_pair(right) is None
    assert part_check.first_disagreeing_pair(views) == (0, 1)
    why = part_check.disagreement(0, 1, part_check.pair_messages(sender, 0, 1),
                                  part_check.pair_messages(receiver, 0, 1))
    assert why.startswith("round 0, op ") and "(send 0 -> 1): rank 0 packs its segments in another order" in why, why


# -- two gloo processes: refused on every rank, before any byte moves ---------------------


def _tampered(tamper, ranks):
    """distribute._lower_own_part, with `tamper` applied to the parts of `ranks`."""
    import nereus.runtime.distribute as distribute

    own = distribute._lower_own_part

    def lower(*args, **options):
        compiled, part = own(*args, **options)
        return compiled, tamper(part) if dist.get_rank() in ranks else part

    return own, lower


def _runtime_case(rank, tamper, ranks) -> dict:
    import nereus.runtime.distribute as distribute
    from nereus.runtime import Runtime

    own, distribute._lower_own_part = _tampered(tamper, ranks)
    try:
        rt = Runtime(ir.parse_source(SOURCE, "check.nir"), "A", rank=rank, world_size=WORLD, verify_programs=False)
        gen = torch.Generator().manual_seed(5)
        full = {n: torch.randn(shape, generator=gen).to(dtype) for n, (shape, dtype) in
                rt.tensor_specs("actor.generation").items()}
        rt.register("actor.generation", rt.shard_state_dict("actor.generation", full))
        held = {n: t.clone() for n, t in rt.state("actor.generation").items()}
        try:
            rt.transition("B")
            return {"error": None, "plan": rt.plan}
        except ProgramError as error:
            now = rt.state("actor.generation")
            return {"error": error.message, "plan": rt.plan,
                    "unchanged": set(now) == set(held) and all(torch.equal(now[n], t) for n, t in held.items())}
    finally:
        distribute._lower_own_part = own


def _sync_case(rank, tamper, ranks) -> dict:
    import nereus.runtime.distribute as distribute
    from nereus.backends.json_program import placement_units
    from nereus.models import OPTIMIZER_STATES, optimizer_name, tensor_table
    from nereus.runtime.executor import TORCH_DTYPES
    from nereus.runtime.state import shard_unit, unit_on_gpu
    from nereus.runtime.vllm_sync import WeightSync

    module = ir.parse_source(SOURCE, "check.nir")
    model = module.model("actor")
    gen = torch.Generator().manual_seed(6)
    full = {f"actor/{s.name}": torch.randn(s.shape, generator=gen).to(TORCH_DTYPES[s.dtype]) for s in tensor_table(model)}
    full.update({optimizer_name(k, s): torch.zeros_like(t) for k, t in list(full.items()) for s in OPTIMIZER_STATES})
    unit = unit_on_gpu(placement_units(model, module.plan("A").placement("actor.training")), rank)
    source = shard_unit(unit, rank, full) if unit is not None else {}
    held = {n: t.clone() for n, t in source.items()}
    own, distribute._lower_own_part = _tampered(tamper, ranks)
    try:
        sync = WeightSync(module, verify_programs=False)
        try:
            sync.run("A", source)
            return {"error": None}
        except ProgramError as error:
            return {"error": error.message, "unchanged": all(torch.equal(source[n], t) for n, t in held.items())}
    finally:
        distribute._lower_own_part = own


def _checksum_case(rank, control, tamper) -> dict:
    """Executor level, verify=True: rank 0's work list is made wrong after lowering (the
    runtime's own checks do not see it); the checksums must."""
    from nereus.runtime import TransitionAborted
    from nereus.runtime.executor import TORCH_DTYPES, execute
    from nereus.runtime.state import shard_of

    program = _whole("A", "B")
    gen = torch.Generator().manual_seed(7)
    full = {t["name"]: torch.randn(t["shape"], generator=gen).to(TORCH_DTYPES[t["dtype"]]) for t in program["tensors"]}
    before = {u["id"]: {s["tensor"]: shard_of(full[s["tensor"]], s["boxes"]) for s in u["shards"] if s["gpu"] == rank}
              for u in program["units"]["before"] if rank in u["gpus"]}
    held = {u: {n: t.clone() for n, t in shards.items()} for u, shards in before.items()}
    if tamper == "box" and rank == 0:  # the sender's k segment names the v rows: it packs v for k
        _, (_, k, v) = _qkv_segments(program)
        k["box"] = copy.deepcopy(v["box"])
    prog = rank_program(program, rank)
    if tamper == "rows" and rank == 0:  # the k piece reads the v rows of the source shard
        prog = _reading_v_for_k(prog)
    try:
        result = execute(prog, before, group=None, control=control, device=torch.device("cpu"), verify=True)
    except TransitionAborted as error:
        return {"error": str(error), "unchanged": all(torch.equal(before[u][n], t) for u, s in held.items()
                                                      for n, t in s.items())}
    unit = next(iter(result.state))
    return {"error": None, "exact": torch.equal(result.state[unit][QKV], full[QKV])}


def _reading_v_for_k(prog):
    work = prog.rounds[0]
    (msg,) = [m for m in work.sends if m.peer == 1]
    qkv = [p for p in msg.pieces if p.tensors == (QKV,)]
    k, v = qkv[1], qkv[2]
    assert k.src_slices[0].stop - k.src_slices[0].start == v.src_slices[0].stop - v.src_slices[0].start
    pieces = tuple(dataclasses.replace(p, src_slices=v.src_slices) if p is k else p for p in msg.pieces)
    sends = tuple(dataclasses.replace(m, pieces=pieces) if m is msg else m for m in work.sends)
    return dataclasses.replace(prog, rounds=(dataclasses.replace(work, sends=sends),) + prog.rounds[1:])


def _run(rank, world):
    control = dist.new_group(backend="gloo")
    return {
        "runtime k twice": _runtime_case(rank, k_twice, (0, 1)),
        "runtime order": _runtime_case(rank, k_v_swapped, (0,)),
        "sync k twice": _sync_case(rank, k_twice, (0, 1)),
        "checksum rows": _checksum_case(rank, control, "rows"),
        "checksum box": _checksum_case(rank, control, "box"),
        "checksum none": _checksum_case(rank, control, None),
    }


@pytest.fixture(scope="module")
def per_rank():
    return spawn_ok(_run, WORLD)


@pytest.mark.multiprocess
def test_k_twice_with_verify_programs_off_is_refused_on_both_ranks_and_nothing_changes(per_rank):
    for rank, cases in enumerate(per_rank):
        out = cases["runtime k twice"]
        assert out["error"] is not None and out["plan"] == "A" and out["unchanged"], (rank, out)
        assert "round 0, op " in out["error"] and "(send 0 -> 1) writes [[32, 40], [0, 32]]" in out["error"], out
        if rank == 0:
            assert out["error"].startswith("rank 1 refused its part of the program A -> B; no rank runs it"), out
        else:
            assert out["error"].startswith("rank 1 refuses its part of the program A -> B: round 0, op "), out


@pytest.mark.multiprocess
def test_a_weight_sync_whose_program_writes_k_twice_is_refused_on_both_ranks(per_rank):
    for rank, cases in enumerate(per_rank):
        out = cases["sync k twice"]
        assert out["error"] is not None and out["unchanged"], (rank, out)
        assert "of the program sync.from -> sync.to" in out["error"], out
        assert "(send 0 -> 1) writes [[40, 48], [0, 32]]" in out["error"] and "written twice" in out["error"], out


@pytest.mark.multiprocess
def test_a_sender_ordering_its_segments_apart_from_its_receiver_is_refused_on_both_ranks(per_rank):
    errors = set()
    for rank, cases in enumerate(per_rank):
        out = cases["runtime order"]
        assert out["error"] is not None and out["plan"] == "A" and out["unchanged"], (rank, out)
        errors.add(out["error"])
    (error,) = errors  # every rank raises the same error
    assert error.startswith("the parts of the program A -> B disagree: round 0, op "), error
    assert "(send 0 -> 1): rank 0 packs its segments in another order than rank 1 unpacks them" in error, error


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["checksum rows", "checksum box"])
def test_verify_catches_a_pack_from_the_wrong_source_region(per_rank, case):
    """Fails when the comparison in rounds.run_round is removed: the transition then
    commits with v's values in k's rows."""
    for rank, cases in enumerate(per_rank):
        out = cases[case]
        assert out["error"] is not None, (rank, out)
        assert "checksum mismatch in the message from 0" in out["error"], (rank, out)
        assert out["unchanged"], (rank, out)
    if case == "checksum rows":
        assert "piece 2 (actor/layers.0.attn.qkv.weight [[32, 40], [0, 32]])" in per_rank[1][case]["error"]
    assert per_rank[0]["checksum none"]["error"] is None and per_rank[0]["checksum none"]["exact"]
    assert per_rank[1]["checksum none"]["exact"]
