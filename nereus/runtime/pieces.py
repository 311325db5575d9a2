"""The pieces of a program's segments, range by range (pure Python, no torch).

A segment (docs/program.md) names a global box of one tensor, or with an `at` range of
version 2 the same box of every member of a tensor family. Each side holds a member in
a shard whose boxes the part lists per family entry (`shard_entries`). `segment_pieces`
cuts a segment into `Piece`s by the two shards' boxes (boxes.cut_segment), once per
run of consecutive members held with the same boxes on both sides, not once per member:
a `Piece` of a range moves the same slices of each of its `tensors` (the members, in
row-major order). An expert-parallel part whose experts x layers x states are a few
dozen ranges lowers in a few dozen cuts instead of tens of thousands.

Invariant: the pieces depend on the segment and on each member's boxes on both sides,
not on how a part groups members into entries (the sender's part lists the receiver's
shards as the receiver's does, but a member held in two entries with equal boxes gives
the same pieces either way), so the sender and the receiver of a message cut it alike.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

from nereus.ir.diagnostics import ProgramError
from nereus.ir.model import DTYPE_BYTES
from nereus.ir.ranges import contains as at_contains, member_name, member_names, members, parse_at

from .boxes import Box, as_box, box_numel, cut_segment, local_slices, shard_shape

# JSON dtype names → bytes per element (the runtime also moves int64 step counters).
ELEMENT_BYTES = dict(DTYPE_BYTES, int64=8, int32=4, uint8=1, fp64=8)


@dataclass(frozen=True)
class Piece:
    """One strided slice moved from a source shard to a destination shard, in each of
    `tensors`: one tensor for a plain segment; for a v2 range, its members in order, all
    held with the same boxes on each side, so the slices (and every field below but
    `tensors`) are the same for each. `numel` and `nbytes` are per tensor; `count`,
    `total_numel` and `total_bytes` count every tensor."""

    tensors: tuple
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

    @property
    def count(self) -> int:
        return len(self.tensors)

    @property
    def tensor(self) -> str:
        """The tensor of a one-tensor piece (code that moves each tensor apart, as the weight
        sync's codecs do, first cuts ranged pieces with `single_tensor_pieces`)."""
        if len(self.tensors) != 1:
            raise ValueError(f"a piece of {len(self.tensors)} tensors has no single tensor")
        return self.tensors[0]

    @property
    def total_numel(self) -> int:
        return self.numel * len(self.tensors)

    @property
    def total_bytes(self) -> int:
        return self.nbytes * len(self.tensors)


def single_tensor_pieces(pieces) -> tuple:
    """`pieces` with every ranged piece (a v2 range's members) cut into one piece per tensor,
    in order; each keeps the per-tensor fields it had."""
    out = []
    for p in pieces:
        out.extend((p,) if len(p.tensors) == 1 else (replace(p, tensors=(name,)) for name in p.tensors))
    return tuple(out)

def members_of(pieces) -> list:
    """[(tensor, piece)] of `pieces`, each piece once per tensor it moves, in order (for
    code and tests that look at one tensor at a time)."""
    return [(name, p) for p in pieces for name in p.tensors]


# -- shards, entry by entry --------------------------------------------------------------

def shard_entries(units: list) -> dict:
    """(unit id, gpu, tensor or family) -> [(at or None, boxes)], for every GPU, as the
    part lists them (senders need the receiver's cut). `at` is parsed (nereus.ir.ranges);
    equal box lists are one tuple (the cuts are cached per box list, and a MoE part
    repeats a few lists thousands of times)."""
    out: dict = {}
    seen: dict = {}
    for unit in units:
        for shard in unit.get("shards", ()):
            at = parse_at(shard["at"], f"unit {unit['id']}, shard of {shard['tensor']}") if "at" in shard else None
            key = repr(shard["boxes"])
            boxes = seen.get(key)
            if boxes is None:
                boxes = seen[key] = tuple(as_box(b) for b in shard["boxes"])
            out.setdefault((unit["id"], shard["gpu"], shard["tensor"]), []).append((at, boxes))
    return out


def holding(found: list, index: tuple) -> Optional[tuple]:
    """The boxes of the entry in `found` whose `at` holds member `index`, or None."""
    for at, boxes in found:
        if at is not None and all(lo <= i < hi and (i - lo) % step == 0 for i, (lo, hi, step) in zip(index, at)):
            return boxes
    return None


def member_runs(name: str, at, src: Optional[list], dst: Optional[list]):
    """[(tensors, source boxes, destination boxes)]: the members a segment names (`at`
    of family `name`; None: the plain tensor `name`) in row-major order, as runs of
    consecutive members held with the same boxes on both sides (`src`, `dst`: the
    entries of `shard_entries` on each side). A string saying which side holds no shard
    of some member when one does not."""
    if src is None or dst is None:
        return "source" if src is None else "destination"
    if at is None:
        sb = next((b for a, b in src if a is None), None)
        db = next((b for a, b in dst if a is None), None)
        if sb is None or db is None:
            return "source" if sb is None else "destination"
        return [((name,), sb, db)]
    sb = next((b for a, b in src if a is not None and at_contains(a, at)), None)
    db = next((b for a, b in dst if a is not None and at_contains(a, at)), None)
    if sb is not None and db is not None:  # the common case: one entry on each side
        return [(member_names(name, at), sb, db)]
    runs: list = []  # member by member (members spread over several entries)
    for index in members(at):
        sb, db = holding(src, index), holding(dst, index)
        if sb is None or db is None:
            return "source" if sb is None else "destination"
        if runs and runs[-1][1] == sb and runs[-1][2] == db:
            runs[-1][0].append(member_name(name, index))
        else:
            runs.append(([member_name(name, index)], sb, db))
    return [(tuple(names), sb, db) for names, sb, db in runs]


def segment_pieces(seg: dict, src_unit: str, dst_unit: str, src_gpu: int, dst_gpu: int, before: dict, after: dict,
                   tensors: dict, where: str, direct_min: int) -> list:
    """[(Piece, source shard shape, destination shard shape)]: the pieces of segment
    `seg` (its tensor or family, its `at` if any, its box) between the shards `before`
    and `after` (`shard_entries` of each side) hold: per run of `member_runs`, per
    (source box, destination box) cut of `boxes.cut_segment`, one Piece for the run.
    Raises ProgramError at `where` when a side holds no shard of a member or the shards
    do not cover the box."""
    name = seg["tensor"]
    if name not in tensors:
        raise ProgramError(f"{where}: segment of tensor {name!r}, which the program does not declare")
    at = parse_at(seg["at"], where) if "at" in seg else None
    box = as_box(seg["box"])
    runs = member_runs(name, at, before.get((src_unit, src_gpu, name)), after.get((dst_unit, dst_gpu, name)))
    if isinstance(runs, str):
        unit, gpu = (src_unit, src_gpu) if runs == "source" else (dst_unit, dst_gpu)
        what = name if at is None else f"{name} at {seg['at']}"
        raise ProgramError(f"{where}: {runs} unit {unit} holds no shard of {what} on GPU {gpu}")
    itemsize = ELEMENT_BYTES[tensors[name]["dtype"]]
    out = []
    for names, src_boxes, dst_boxes in runs:
        cut = geometry(box, src_boxes, dst_boxes, itemsize, direct_min)
        if cut is None:
            raise ProgramError(f"{where}: segment {name} {list(box)} is not covered by both the source and "
                               "destination shards")
        src_shape, dst_shape = shape(src_boxes), shape(dst_boxes)
        out += [(Piece(names, src_unit, dst_unit, *g), src_shape, dst_shape) for g in cut]
    return out


@functools.lru_cache(maxsize=1 << 16)
def geometry(box: Box, src: tuple, dst: tuple, itemsize: int, direct_min: int) -> Optional[tuple]:
    """Each piece of segment `box` between shards of boxes `src` and `dst` as the fields of
    a Piece after its tensors and units (slices, numel, bytes, box, direct, whole), or None
    when the shards do not both cover the segment. Once per distinct geometry: the
    segments of an expert-parallel program repeat a few geometries (the same boxes every
    layer and expert)."""
    cut = cut_segment(box, src, dst)
    if sum(box_numel(p) for _, _, p in cut) != box_numel(box):
        return None
    out = []
    src_shape, dst_shape = shape(src), shape(dst)
    for i, j, p in cut:
        src_slices, dst_slices = local_slices(src, i, p), local_slices(dst, j, p)
        numel = box_numel(p)
        nbytes = numel * itemsize
        direct = nbytes >= direct_min and rows_only(src_slices, src_shape) and rows_only(dst_slices, dst_shape)
        out.append((src_slices, dst_slices, numel, nbytes, p, direct, whole(src_slices, src_shape),
                    whole(dst_slices, dst_shape)))
    return tuple(out)


# a shard's local shape, once per distinct box list (thousands of pieces share a few)
shape = functools.lru_cache(maxsize=1 << 16)(shard_shape)


def whole(slices: tuple[slice, ...], shard: tuple[int, ...]) -> bool:
    return len(slices) == len(shard) and all(sl.start == 0 and sl.stop == n for sl, n in zip(slices, shard))


def rows_only(slices: tuple[slice, ...], shard: tuple[int, ...]) -> bool:
    """True when the slices select whole rows of a contiguous local tensor (a contiguous
    region): every dimension but the first is taken in full."""
    return all(sl.start == 0 and sl.stop == n for sl, n in zip(slices[1:], shard[1:]))


def segment_units(seg: dict, op: dict) -> tuple:
    """(src_unit, dst_unit) of a segment: its own, or those its op states once (rank parts)."""
    return (seg["src_unit"] if "src_unit" in seg else op["src_unit"],
            seg["dst_unit"] if "dst_unit" in seg else op["dst_unit"])
