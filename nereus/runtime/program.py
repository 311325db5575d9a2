"""Lowering of a JSON program (v1 or v2, docs/program.md) into one rank's work list.

Pure Python, no torch: `rank_program(program, gpu)` reads only the JSON contract (never
compiler internals) and returns a frozen `RankProgram` that the executor runs. Every
byte count is derived from the program alone, so the sender and the receiver of a
message compute the same size (gloo aborts the process on a size mismatch).

A v2 part's ranges are lowered as ranges (pieces.py): a segment with `at` becomes
`Piece`s that each move the same slices of every member of a run of the range, so the
work here, and the execution plan built from it, grows with the part's entries, not
with its members (experts x layers x states). Member names appear only where the
executor needs tensors by name (the shards of this rank, a piece's `tensors`).

Ops: alloc, keep, copy, send, stage_out (a before-unit's shard moves to host memory and
later sends read it from there), free. Also here: `restrict_program(program,
model_stages)` (drop units of model-stages the embedding code did not hand to Nereus).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from nereus.ir.diagnostics import ProgramError
from nereus.ir.program import expand_segment_units
from nereus.ir.ranges import count, member_names, parse_at

from .boxes import Box, as_box, box_numel, shard_shape
from .keeps import Alias, aliasable, keep_aliases
from .part_check import check_writes, pair_digests
from .pieces import ELEMENT_BYTES, Piece, members_of, rows_only, segment_pieces, segment_units, shard_entries, whole

__all__ = ["DIRECT_MIN_BYTES", "ELEMENT_BYTES", "JOIN_PARTS", "Alias", "Message", "PartFacts", "Piece", "RankProgram",
           "RoundWork", "ShardInfo", "joined", "lower_text", "members_of", "offloaded_units", "part_facts",
           "program_model_stages", "rank_program", "restrict_program", "unit_of_stage"]

# Pieces at least this large that are contiguous on both sides (whole rows of the local
# tensors) travel as their own p2p messages straight from and into the shards: no pack,
# no unpack, no buffer. Smaller ones are packed per message.
DIRECT_MIN_BYTES = 256 * 1024

# Whether `joined` makes the gate half and the up half of a TP-split fused tensor one
# two-part piece ([rows, 2, cols] views). Off: on 2 H200s (session 4, moe_reshard.py
# --layers 6) two-part views made Qwen3-30B-A3B ep2 -> tp2 14x slower (1.34 s against
# 94 ms): the fused Triton pack reduces a 3-D view whose dims do not merge to one copy
# run per row, built on the host. Two 2-D halves take the pack as one strided box each.
# nereus.passes.cost.JOIN_PARTS mirrors it (tests/passes/test_cost_pieces.py checks).
JOIN_PARTS = False


@dataclass(frozen=True)
class Message:
    """One point-to-point message: its pieces packed back to back as bytes (a piece of
    several tensors: each tensor's slice in turn)."""

    peer: int
    op_index: int  # position of the op in its round; also the p2p tag
    pieces: tuple[Piece, ...]
    nbytes: int


@dataclass(frozen=True)
class RoundWork:
    index: int
    allocs: tuple[str, ...]  # after-units whose shards on this GPU are allocated now
    aliases: tuple[Alias, ...]
    copies: tuple[Piece, ...]  # same-GPU moves (copy ops and keeps that cannot alias)
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    frees: tuple[str, ...]  # before-units whose shards on this GPU are released now
    stage_outs: tuple[str, ...] = ()  # before-units whose shards on this GPU move to host memory


@dataclass(frozen=True)
class ShardInfo:
    boxes: tuple[Box, ...]
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class RankProgram:
    """Everything rank `gpu` does in a transition; shards are keyed unit → tensor (every
    member of a v2 family by its name)."""

    gpu: int
    source: str
    target: str
    before: dict  # unit id → {tensor: ShardInfo} on this GPU
    after: dict
    unit_stage: dict  # (phase, unit id) → model-stage
    rounds: tuple[RoundWork, ...]
    send_bytes: int
    recv_bytes: int
    copy_bytes: int
    keep_bytes: int
    # ((src, dst, digest), ...): this rank's messages per pair of ranks, as it lowered
    # them (part_check.pair_digests); the agreement compares every sender's with its receiver's
    pair_digests: tuple = ()


def _shards(entries: dict, gpu: int, tensors: dict, phase: str) -> dict:
    """unit id → {tensor: ShardInfo} of this GPU's shards (`entries` from
    pieces.shard_entries): one ShardInfo per entry, shared by its members."""
    out: dict = {}
    for (unit, on, name), found in entries.items():
        if on != gpu:
            continue
        if name not in tensors:
            raise ProgramError(f"{phase} unit {unit} holds tensor {name!r}, which the program does not declare")
        dtype = tensors[name]["dtype"]
        slot = out.setdefault(unit, {})
        for at, boxes in found:
            try:
                shape = shard_shape(boxes)
            except ValueError as error:
                raise ProgramError(f"{phase} unit {unit} on GPU {gpu}: {error}") from None
            info = ShardInfo(boxes, shape, dtype, sum(box_numel(b) for b in boxes) * ELEMENT_BYTES[dtype])
            slot.update(dict.fromkeys(member_names(name, at) if at is not None else (name,), info))
    return out


def joined(cut: Iterable[tuple], direct_min: int = DIRECT_MIN_BYTES) -> list:
    """The pieces of `cut` ((Piece, source shard shape, destination shard shape), as
    pieces.segment_pieces gives them) with each piece joined into the latest earlier
    piece of the same tensors and unit pair that it continues along dim 0 in the source
    shard, in the destination shard and globally (same ranges elsewhere): a fused tensor
    moving whole (gate|up rows, q|k|v rows, each its own segment, with the optimizer
    states' segments between them) becomes one piece, not one per part, so an
    expert-parallel transition handles one piece per expert tensor (per range of them).
    A piece that repeats the latest one further down instead (same extent, a positive
    shift on both sides and globally: the gate half and the up half of a TP-split expert)
    makes it a two-part piece (`Piece.parts`) when JOIN_PARTS. The order is that of the
    first parts; both sides of a message join alike (same input)."""
    out: list = []
    latest: dict = {}
    for p, src_shape, dst_shape in cut:
        key = (p.tensors, p.src_unit, p.dst_unit)
        at = latest.get(key)
        if at is not None:
            q = out[at]
            if q.parts == 1 and _continues(q.src_slices, p.src_slices) and _continues(q.dst_slices, p.dst_slices) \
                    and q.box[0][1] == p.box[0][0] and q.box[1:] == p.box[1:]:
                src = (slice(q.src_slices[0].start, p.src_slices[0].stop),) + p.src_slices[1:]
                dst = (slice(q.dst_slices[0].start, p.dst_slices[0].stop),) + p.dst_slices[1:]
                nbytes = q.nbytes + p.nbytes
                direct = nbytes >= direct_min and rows_only(src, src_shape) and rows_only(dst, dst_shape)
                out[at] = Piece(p.tensors, p.src_unit, p.dst_unit, src, dst, q.numel + p.numel, nbytes,
                                ((q.box[0][0], p.box[0][1]),) + p.box[1:], direct, whole(src, src_shape),
                                whole(dst, dst_shape))
                continue
            if JOIN_PARTS and q.parts == 1 and _second_part(q, p):
                out[at] = Piece(p.tensors, p.src_unit, p.dst_unit, q.src_slices, q.dst_slices, q.numel + p.numel,
                                q.nbytes + p.nbytes, q.box, False, False, False, 2,
                                p.src_slices[0].start - q.src_slices[0].start,
                                p.dst_slices[0].start - q.dst_slices[0].start)
                continue
        latest[key] = len(out)
        out.append(p)
    return out


def _second_part(q: Piece, p: Piece) -> bool:
    """Whether p is q shifted along dim 0 by a positive number of rows in the source, in
    the destination and globally (same extent, same ranges elsewhere): the two halves of
    a TP-split fused tensor (gate rows and up rows), which one two-part piece moves."""
    rows = q.src_slices[0].stop - q.src_slices[0].start
    return bool(q.src_slices) and p.src_slices[0].stop - p.src_slices[0].start == rows and \
        p.src_slices[1:] == q.src_slices[1:] and p.dst_slices[1:] == q.dst_slices[1:] and \
        p.box[1:] == q.box[1:] and p.src_slices[0].start > q.src_slices[0].start and \
        p.dst_slices[0].start > q.dst_slices[0].start and p.box[0][0] > q.box[0][0]


def _continues(before: tuple, after: tuple) -> bool:
    return bool(before) and before[0].stop == after[0].start and before[1:] == after[1:]


def rank_program(program: dict, gpu: int, direct_min_bytes: int = DIRECT_MIN_BYTES) -> RankProgram:
    """Input: a JSON program (v1, or v2 with its ranges) and this rank's GPU id.
    Output: this rank's work list.

    Invariant: for every message, the sender's and the receiver's RankProgram list the
    same pieces in the same order, hence the same byte count (when both lowered the same
    program: `pair_digests` lets the runtime check that they did). Raises ProgramError
    when the program is malformed (unknown tensor, a segment not covered by its shards,
    a byte count that disagrees with the boxes, a field missing or of the wrong type) or
    wrong on this GPU (part_check.check_writes: a new shard not written exactly once)."""
    if not isinstance(program, dict):
        raise ProgramError("a program is a JSON object", hint="compile it with `nereusc FILE --emit json`")
    try:
        return _rank_program(program, gpu, direct_min_bytes)
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as error:
        # a field missing or of the wrong type: named, not a KeyError from deep inside
        raise ProgramError(f"malformed program ({type(error).__name__}: {error})",
                           hint="`nereusc verify PROGRAM.json` names the field; docs/program.md lists them") from None


def _cut_op(op: dict, segments: list, src_gpu: int, dst_gpu: int, before: dict, after: dict, tensors: dict,
            where: str, direct_min: int) -> list:
    """The joined pieces of an op's segments between src_gpu and dst_gpu."""
    cut = []
    for seg in segments:
        src_unit, dst_unit = segment_units(seg, op)
        cut += segment_pieces(seg, src_unit, dst_unit, src_gpu, dst_gpu, before, after, tensors, where, direct_min)
    return joined(cut, direct_min)


def _rank_program(program: dict, gpu: int, direct_min_bytes: int) -> RankProgram:
    version = program.get("version")
    if program.get("format") != "nereus-program" or type(version) is not int or version not in (1, 2):
        raise ProgramError("not a nereus-program version 1 or 2", hint="compile it with `nereusc FILE --emit json`")
    check_writes(program, gpu)  # every element of this GPU's new shards written once (part_check), v2 as ranges
    tensors = {t["name"]: t for t in program["tensors"]}
    units = program["units"]
    before_all, after_all = shard_entries(units["before"]), shard_entries(units["after"])
    alias_ok = aliasable(program, gpu, before_all, after_all)
    unit_stage = {("before", u["id"]): u["model_stage"] for u in units["before"]}
    unit_stage.update({("after", u["id"]): u["model_stage"] for u in units["after"]})
    rounds = []
    totals = dict(send=0, recv=0, copy=0, keep=0)
    aliased: dict = {}
    for r, rnd in enumerate(program["rounds"]):
        allocs, aliases, copies, sends, recvs, frees, stage_outs = [], [], [], [], [], [], []
        for k, op in enumerate(rnd["ops"]):
            kind = op["op"]
            where = f"round {r}, op {k} ({kind})"
            if kind == "alloc" and op["gpu"] == gpu:
                allocs.append(op["unit"])
            elif kind == "free" and op["gpu"] == gpu:
                frees.append(op["unit"])
            elif kind == "stage_out" and op["gpu"] == gpu:
                stage_outs.append(op["unit"])
            elif kind in ("keep", "copy") and op["gpu"] == gpu:
                segments = op["segments"]
                if kind == "keep":
                    segments, kept = keep_aliases(op, alias_ok, tensors, aliases, aliased, where)
                    totals["keep"] += kept
                # joined across the op's segments, as sends
                pieces = _cut_op(op, segments, gpu, gpu, before_all, after_all, tensors, where, DIRECT_MIN_BYTES)
                copies.extend(pieces)
                totals["keep" if kind == "keep" else "copy"] += sum(p.total_bytes for p in pieces)
            elif kind == "send" and gpu in (op["src"], op["dst"]):
                if op["src"] == op["dst"]:
                    pieces = _cut_op(op, op["segments"], gpu, gpu, before_all, after_all, tensors, where,
                                     DIRECT_MIN_BYTES)
                    copies.extend(pieces)
                    totals["copy"] += sum(p.total_bytes for p in pieces)
                    continue
                pieces = tuple(_cut_op(op, op["segments"], op["src"], op["dst"], before_all, after_all, tensors,
                                       where, direct_min_bytes))
                nbytes = sum(p.total_bytes for p in pieces)
                if "bytes" in op and op["bytes"] != nbytes:
                    raise ProgramError(f"{where}: says {op['bytes']} bytes but its segments hold {nbytes}")
                # the tag: a rank program's ops carry their position in the whole round
                tag = op.get("index", k)
                if op["src"] == gpu:
                    sends.append(Message(op["dst"], tag, pieces, nbytes))
                    totals["send"] += nbytes
                else:
                    recvs.append(Message(op["src"], tag, pieces, nbytes))
                    totals["recv"] += nbytes
            elif kind not in ("alloc", "free", "keep", "copy", "send", "stage_out"):
                raise ProgramError(f"{where}: unknown op {kind!r}",
                                   hint="this runtime executes alloc, keep, copy, send, stage_out and free")
        rounds.append(RoundWork(r, tuple(allocs), tuple(aliases), tuple(copies), tuple(sends), tuple(recvs),
                                tuple(frees), tuple(stage_outs)))
    return RankProgram(
        gpu=gpu, source=program["transition"]["from"], target=program["transition"]["to"],
        before=_shards(before_all, gpu, tensors, "before"), after=_shards(after_all, gpu, tensors, "after"),
        unit_stage=unit_stage, rounds=tuple(rounds), send_bytes=totals["send"], recv_bytes=totals["recv"],
        copy_bytes=totals["copy"], keep_bytes=totals["keep"], pair_digests=pair_digests(rounds, gpu),
    )


def program_model_stages(program: dict) -> set[str]:
    return {u["model_stage"] for phase in ("before", "after") for u in program["units"][phase]}


def restrict_program(program: dict, model_stages: Iterable[str]) -> dict:
    """The program restricted to units of `model_stages`.

    Ops and segments that touch other units are dropped (their bytes recomputed from the
    remaining segments). Raises ProgramError when a kept unit would be fed from a dropped
    one (a segment crossing model-stages), since that data would be missing. A v2
    program stays v2: its ranges are kept as they are (a range's segment names one unit
    pair for all its members)."""
    keep = set(model_stages)
    program = expand_segment_units(program)
    units = {phase: [u for u in program["units"][phase] if u["model_stage"] in keep] for phase in ("before", "after")}
    ids = {phase: {u["id"] for u in units[phase]} for phase in units}
    tensors = {t["name"]: t for t in program["tensors"]}
    rounds = []
    for r, rnd in enumerate(program["rounds"]):
        ops = []
        for op in rnd["ops"]:
            if op["op"] == "alloc" and op["unit"] not in ids["after"]:
                continue
            if op["op"] in ("free", "stage_out") and op["unit"] not in ids["before"]:
                continue
            if "segments" in op:
                segs = []
                for seg in op["segments"]:
                    if seg["dst_unit"] not in ids["after"]:
                        continue
                    if seg["src_unit"] not in ids["before"]:
                        raise ProgramError(f"round {r}: unit {seg['dst_unit']} is fed from {seg['src_unit']}, "
                                           "whose model-stage is not registered",
                                           hint="register every model-stage the transition reads from")
                    segs.append(seg)
                if not segs:
                    continue
                op = dict(op, segments=segs)
                if "bytes" in op:
                    op["bytes"] = sum(box_numel(as_box(s["box"])) * ELEMENT_BYTES[tensors[s["tensor"]]["dtype"]]
                                      * (count(parse_at(s["at"], f"round {r}")) if "at" in s else 1) for s in segs)
            ops.append(op)
        rounds.append(dict(rnd, ops=ops))
    return dict(program, units=units, rounds=rounds)


def unit_of_stage(units: dict, unit_stage: dict, phase: str, model_stage: str) -> Optional[str]:
    """The unit of `model_stage` in `units` (this rank's shards), or None."""
    for unit_id in units:
        if unit_stage.get((phase, unit_id)) == model_stage:
            return unit_id
    return None


def offloaded_units(program: dict) -> frozenset:
    """{("before" | "after", unit id)} of the units a JSON program flags `offload`."""
    units = program.get("units", {})
    return frozenset((phase, unit["id"]) for phase in ("before", "after")
                     for unit in units.get(phase, ()) if unit.get("offload", False))


@dataclass(frozen=True)
class PartFacts:
    """What a runtime derives from its part's JSON dict, so that the dict itself need not
    be kept (a MoE part is ~10^5 container objects, each scanned by every full garbage
    collection of the process)."""

    untouched: frozenset  # model-stages the program leaves alone
    model_stages: frozenset  # model-stages of its units
    resident_bytes: int  # this rank's resident bytes in the program
    capacity_bytes: Optional[int]  # this GPU's capacity in the program (None if absent)
    offloaded: frozenset  # offload.offloaded_units of the part


def part_facts(program: dict, rank: int) -> PartFacts:
    capacity = None
    for gpu in program.get("gpus", ()):
        if gpu.get("id") == rank:
            capacity = int(gpu.get("capacity_bytes", gpu.get("mem_bytes")))
            break
    return PartFacts(frozenset(program.get("untouched", ())), frozenset(program_model_stages(program)),
                     int(program.get("resident_bytes", {}).get(str(rank), 0)), capacity,
                     offloaded_units(program))


def lower_text(text: str, rank: int, direct_min_bytes: int) -> tuple:
    """(PartFacts, this rank's RankProgram) of a part's canonical JSON text: what the
    lowering-ahead thread and the lowering process make of a new part (torch-free)."""
    import json

    program = json.loads(text)
    return part_facts(program, rank), rank_program(program, rank, direct_min_bytes)
