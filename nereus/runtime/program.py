"""Lowering of a JSON program v1 (docs/program.md) into one rank's work list.

Pure Python, no torch: `rank_program(program, gpu)` reads only the JSON contract (never
compiler internals) and returns a frozen `RankProgram` that the executor runs. Every
byte count is derived from the program alone, so the sender and the receiver of a
message compute the same size (gloo aborts the process on a size mismatch).

Ops: alloc, keep, copy, send, stage_out (a before-unit's shard moves to host memory and
later sends read it from there), free. Also here: `restrict_program(program,
model_stages)` (drop units of model-stages the embedding code did not hand to Nereus).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Optional

from nereus.ir.diagnostics import ProgramError
from nereus.ir.model import DTYPE_BYTES
from nereus.ir.program import expand_ranges, expand_segment_units

from .boxes import Box, as_box, box_numel, cut_segment, local_slices, shard_shape
from .part_check import check_writes, pair_digests

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

# JSON dtype names → bytes per element (the runtime also moves int64 step counters).
ELEMENT_BYTES = dict(DTYPE_BYTES, int64=8, int32=4, uint8=1, fp64=8)


@dataclass(frozen=True)
class Piece:
    """One strided slice moved from a source shard to a destination shard."""

    tensor: str
    src_unit: str
    dst_unit: str
    src_slices: tuple[slice, ...]
    dst_slices: tuple[slice, ...]
    numel: int
    nbytes: int
    box: Box  # global box, for error messages and checksums
    direct: bool = False  # sent from / received into the local tensors in place, no packing
    src_whole: bool = False  # the slices cover the whole source shard (the view is the tensor)
    dst_whole: bool = False  # the slices cover the whole destination shard
    # parts > 1: the slices are the first of `parts` equal regions, part k shifted by
    # k x step rows in each local tensor (a split expert's gate half and up half: one
    # piece); numel, nbytes cover every part, box is the first part's
    parts: int = 1
    src_step: int = 0
    dst_step: int = 0


@dataclass(frozen=True)
class Message:
    """One point-to-point message: its pieces packed back to back as bytes."""

    peer: int
    op_index: int  # position of the op in its round; also the p2p tag
    pieces: tuple[Piece, ...]
    nbytes: int


@dataclass(frozen=True)
class Alias:
    """An after-shard that reuses a before-shard's tensor in place (keep)."""

    tensor: str
    src_unit: str
    dst_unit: str


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
    """Everything rank `gpu` does in a transition; shards are keyed unit → tensor."""

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


def _shards(units: list, gpu: int, tensors: dict, phase: str) -> dict:
    out: dict = {}
    for unit in units:
        for shard in unit.get("shards", ()):
            if shard["gpu"] != gpu:
                continue
            name = shard["tensor"]
            if name not in tensors:
                raise ProgramError(f"{phase} unit {unit['id']} holds tensor {name!r}, which the program does not declare")
            boxes = tuple(as_box(b) for b in shard["boxes"])
            try:
                shape = shard_shape(boxes)
            except ValueError as error:
                raise ProgramError(f"{phase} unit {unit['id']} on GPU {gpu}: {error}") from None
            dtype = tensors[name]["dtype"]
            numel = sum(box_numel(b) for b in boxes)
            out.setdefault(unit["id"], {})[name] = ShardInfo(boxes, shape, dtype, numel * ELEMENT_BYTES[dtype])
    return out


def _all_shards(units: list, tensors: dict) -> dict:
    """(unit id, gpu, tensor) → boxes, for every GPU (senders need the receiver's cut)."""
    out = {}
    for unit in units:
        for shard in unit.get("shards", ()):
            out[(unit["id"], shard["gpu"], shard["tensor"])] = tuple(as_box(b) for b in shard["boxes"])
    return out


def _pieces(seg: dict, src_gpu: int, dst_gpu: int, before: dict, after: dict, tensors: dict, where: str,
            direct_min: int = DIRECT_MIN_BYTES) -> list[Piece]:
    name = seg["tensor"]
    box = as_box(seg["box"])
    src = before.get((seg["src_unit"], src_gpu, name))
    dst = after.get((seg["dst_unit"], dst_gpu, name))
    if src is None or dst is None:
        side = "source" if src is None else "destination"
        unit = seg["src_unit"] if src is None else seg["dst_unit"]
        gpu = src_gpu if src is None else dst_gpu
        raise ProgramError(f"{where}: {side} unit {unit} holds no shard of {name} on GPU {gpu}")
    cut = _geometry(box, src, dst, ELEMENT_BYTES[tensors[name]["dtype"]], direct_min)
    if cut is None:
        raise ProgramError(f"{where}: segment {name} {list(box)} is not covered by both the source and destination shards")
    src_unit, dst_unit = seg["src_unit"], seg["dst_unit"]
    return [Piece(name, src_unit, dst_unit, *g) for g in cut]


@functools.lru_cache(maxsize=1 << 16)
def _geometry(box: Box, src: tuple, dst: tuple, itemsize: int, direct_min: int) -> Optional[tuple]:
    """Each piece of segment `box` between shards of boxes `src` and `dst` as the fields of
    a Piece after its tensor and units (slices, numel, bytes, box, direct, whole), or None
    when the shards do not both cover the segment. Once per distinct geometry: an
    expert-parallel program moves thousands of segments that differ only in the tensor
    (128 experts of one shape per layer, and the same boxes every layer)."""
    cut = cut_segment(box, src, dst)
    if sum(box_numel(p) for _, _, p in cut) != box_numel(box):
        return None
    out = []
    src_shape, dst_shape = _shape(src), _shape(dst)
    for i, j, p in cut:
        src_slices, dst_slices = local_slices(src, i, p), local_slices(dst, j, p)
        numel = box_numel(p)
        nbytes = numel * itemsize
        direct = nbytes >= direct_min and _rows_only(src_slices, src_shape) and _rows_only(dst_slices, dst_shape)
        out.append((src_slices, dst_slices, numel, nbytes, p, direct, _whole(src_slices, src_shape),
                    _whole(dst_slices, dst_shape)))
    return tuple(out)


# a shard's local shape, once per distinct box list (thousands of pieces share a few)
_shape = functools.lru_cache(maxsize=1 << 16)(shard_shape)


def joined(pieces: Iterable[Piece], src_gpu: int, dst_gpu: int, before: dict, after: dict,
           direct_min: int = DIRECT_MIN_BYTES) -> list:
    """`pieces` with each piece joined into the latest earlier piece of the same tensor
    and unit pair that it continues along dim 0 in the source shard, in the destination
    shard and globally (same ranges elsewhere): a fused tensor moving whole (gate|up
    rows, q|k|v rows, each its own segment, with the optimizer states' segments between
    them) becomes one piece, not one per part, so an expert-parallel transition handles
    one piece per expert tensor. A piece that repeats the latest one further down instead
    (same extent, a positive shift on both sides and globally: the gate half and the up
    half of a TP-split expert) makes it a two-part piece (`Piece.parts`) when JOIN_PARTS. The order is
    that of the first parts; both sides of a message join alike (same input).
    before/after: (unit, gpu, tensor) -> boxes, as `_all_shards` gives."""
    out: list = []
    latest: dict = {}
    for p in pieces:
        key = (p.tensor, p.src_unit, p.dst_unit)
        at = latest.get(key)
        if at is not None:
            q = out[at]
            if q.parts == 1 and _continues(q.src_slices, p.src_slices) and _continues(q.dst_slices, p.dst_slices) \
                    and q.box[0][1] == p.box[0][0] and q.box[1:] == p.box[1:]:
                src = (slice(q.src_slices[0].start, p.src_slices[0].stop),) + p.src_slices[1:]
                dst = (slice(q.dst_slices[0].start, p.dst_slices[0].stop),) + p.dst_slices[1:]
                nbytes = q.nbytes + p.nbytes
                src_shape = _shape(before[(p.src_unit, src_gpu, p.tensor)])
                dst_shape = _shape(after[(p.dst_unit, dst_gpu, p.tensor)])
                direct = nbytes >= direct_min and _rows_only(src, src_shape) and _rows_only(dst, dst_shape)
                out[at] = Piece(p.tensor, p.src_unit, p.dst_unit, src, dst, q.numel + p.numel, nbytes,
                                ((q.box[0][0], p.box[0][1]),) + p.box[1:], direct, _whole(src, src_shape),
                                _whole(dst, dst_shape))
                continue
            if JOIN_PARTS and q.parts == 1 and _second_part(q, p):
                out[at] = Piece(p.tensor, p.src_unit, p.dst_unit, q.src_slices, q.dst_slices, q.numel + p.numel,
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


def _whole(slices: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    return len(slices) == len(shape) and all(sl.start == 0 and sl.stop == n for sl, n in zip(slices, shape))


def _rows_only(slices: tuple[slice, ...], shape: tuple[int, ...]) -> bool:
    """True when the slices select whole rows of a contiguous local tensor (a contiguous
    region): every dimension but the first is taken in full."""
    return all(sl.start == 0 and sl.stop == n for sl, n in zip(slices[1:], shape[1:]))


def _aliasable(program: dict, gpu: int, before: dict, after: dict) -> set:
    """(dst_unit, tensor) after-shards on `gpu` produced only by keeps from one source
    shard with the very same boxes: those reuse the source tensor in place."""
    producers: dict = {}
    for rnd in program["rounds"]:
        for op in rnd["ops"]:
            kind = op["op"]
            if kind in ("keep", "copy") and op["gpu"] == gpu:
                for seg in op["segments"]:
                    producers.setdefault((seg["dst_unit"], seg["tensor"]), []).append((kind, seg))
            elif kind == "send" and op["dst"] == gpu:
                for seg in op["segments"]:
                    producers.setdefault((seg["dst_unit"], seg["tensor"]), []).append((kind, seg))
    out = set()
    for (dst_unit, name), segs in producers.items():
        srcs = {seg["src_unit"] for _, seg in segs}
        if any(kind != "keep" for kind, _ in segs) or len(srcs) != 1:
            continue
        src_boxes = before.get((next(iter(srcs)), gpu, name))
        dst_boxes = after.get((dst_unit, gpu, name))
        covered = sum(box_numel(as_box(seg["box"])) for _, seg in segs)
        if src_boxes is not None and src_boxes == dst_boxes and covered == sum(box_numel(b) for b in dst_boxes):
            out.add((dst_unit, name))
    return out


def rank_program(program: dict, gpu: int, direct_min_bytes: int = DIRECT_MIN_BYTES) -> RankProgram:
    """Input: a JSON program (v1, or v2 read member by member) and this rank's GPU id.
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


def _rank_program(program: dict, gpu: int, direct_min_bytes: int) -> RankProgram:
    version = program.get("version")
    if program.get("format") != "nereus-program" or type(version) is not int or version not in (1, 2):
        raise ProgramError("not a nereus-program version 1 or 2", hint="compile it with `nereusc FILE --emit json`")
    program = expand_segment_units(expand_ranges(program))  # v2: member by member; units per segment
    check_writes(program, gpu)  # every element of this GPU's new shards written once (part_check)
    tensors = {t["name"]: t for t in program["tensors"]}
    units = program["units"]
    before_all, after_all = _all_shards(units["before"], tensors), _all_shards(units["after"], tensors)
    alias_ok = _aliasable(program, gpu, before_all, after_all)
    unit_stage = {("before", u["id"]): u["model_stage"] for u in units["before"]}
    unit_stage.update({("after", u["id"]): u["model_stage"] for u in units["after"]})
    rounds = []
    totals = dict(send=0, recv=0, copy=0, keep=0)
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
                cut = []
                for seg in op["segments"]:
                    if kind == "keep" and (seg["dst_unit"], seg["tensor"]) in alias_ok:
                        if Alias(seg["tensor"], seg["src_unit"], seg["dst_unit"]) not in aliases:
                            aliases.append(Alias(seg["tensor"], seg["src_unit"], seg["dst_unit"]))
                        totals["keep"] += box_numel(as_box(seg["box"])) * ELEMENT_BYTES[tensors[seg["tensor"]]["dtype"]]
                        continue
                    cut.extend(_pieces(seg, gpu, gpu, before_all, after_all, tensors, where))
                pieces = joined(cut, gpu, gpu, before_all, after_all)  # across the op's segments, as sends
                copies.extend(pieces)
                totals["keep" if kind == "keep" else "copy"] += sum(p.nbytes for p in pieces)
            elif kind == "send" and gpu in (op["src"], op["dst"]):
                if op["src"] == op["dst"]:
                    pieces = joined((p for seg in op["segments"]
                                     for p in _pieces(seg, gpu, gpu, before_all, after_all, tensors, where)),
                                    gpu, gpu, before_all, after_all)
                    copies.extend(pieces)
                    totals["copy"] += sum(p.nbytes for p in pieces)
                    continue
                pieces = tuple(joined((p for seg in op["segments"]
                                       for p in _pieces(seg, op["src"], op["dst"], before_all, after_all, tensors,
                                                        where, direct_min_bytes)),
                                      op["src"], op["dst"], before_all, after_all, direct_min_bytes))
                nbytes = sum(p.nbytes for p in pieces)
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
        before=_shards(units["before"], gpu, tensors, "before"), after=_shards(units["after"], gpu, tensors, "after"),
        unit_stage=unit_stage, rounds=tuple(rounds), send_bytes=totals["send"], recv_bytes=totals["recv"],
        copy_bytes=totals["copy"], keep_bytes=totals["keep"], pair_digests=pair_digests(rounds, gpu),
    )


def program_model_stages(program: dict) -> set[str]:
    return {u["model_stage"] for phase in ("before", "after") for u in program["units"][phase]}


def restrict_program(program: dict, model_stages: Iterable[str]) -> dict:
    """The program restricted to units of `model_stages`.

    Ops and segments that touch other units are dropped (their bytes recomputed from the
    remaining segments). Raises ProgramError when a kept unit would be fed from a dropped
    one (a segment crossing model-stages), since that data would be missing."""
    keep = set(model_stages)
    program = expand_segment_units(expand_ranges(program))
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
                    op["bytes"] = sum(box_numel(as_box(s["box"])) * ELEMENT_BYTES[tensors[s["tensor"]]["dtype"]] for s in segs)
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
