"""Box arithmetic for the local shard contract (pure Python, no torch).

A BOX is a list of global half-open ranges, one per dimension: [[lo, hi], ...].
A *shard* is the list of boxes one GPU holds of one global tensor for one unit.
Local shard contract: the local tensor of a shard is the concatenation along dim 0 of
its boxes, in the listed order (a TP shard of fused qkv is one tensor made of its q, k
and v rows, as a TP linear layer uses it). So every box of a shard has the same extent
in every dimension but the first.

A segment of a JSON program names a global box to move from a source shard to a
destination shard. The two shards may cut it differently (the sender's q|k|v boxes are
not the receiver's), so both sides cut it into the same *pieces*: the non-empty
intersections segment ∩ src_box[i] ∩ dst_box[j], ordered by (i, j). Each piece lies in
one box on each side and is therefore one strided slice of each local tensor. Both
ranks derive the pieces from the same program, so message sizes agree by construction.
"""

from __future__ import annotations

from typing import Optional, Sequence

Box = tuple[tuple[int, int], ...]


def as_box(raw: Sequence[Sequence[int]]) -> Box:
    """A JSON box ([[lo, hi], ...]) as a hashable tuple of (lo, hi) pairs."""
    return tuple((int(lo), int(hi)) for lo, hi in raw)


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= max(0, hi - lo)
    return n


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The intersection of two boxes of the same rank, or None when it is empty."""
    out = []
    for (alo, ahi), (blo, bhi) in zip(a, b):
        lo, hi = max(alo, blo), min(ahi, bhi)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def contains(outer: Box, inner: Box) -> bool:
    return all(olo <= ilo and ihi <= ohi for (olo, ohi), (ilo, ihi) in zip(outer, inner))


def shard_shape(boxes: Sequence[Box]) -> tuple[int, ...]:
    """Shape of the local tensor of a shard: boxes stacked along dim 0.

    Raises ValueError when the boxes disagree on a trailing dimension (the shard then
    has no local tensor under the contract)."""
    if not boxes:
        raise ValueError("a shard needs at least one box")
    if not boxes[0]:  # a 0-d tensor: one box with no ranges
        return ()
    tail = tuple(hi - lo for lo, hi in boxes[0][1:])
    rows = 0
    for box in boxes:
        if tuple(hi - lo for lo, hi in box[1:]) != tail:
            raise ValueError(f"boxes {list(boxes)} differ beyond dim 0; they cannot be stacked along dim 0")
        rows += box[0][1] - box[0][0]
    return (rows,) + tail


def local_slices(boxes: Sequence[Box], index: int, piece: Box) -> tuple[slice, ...]:
    """Slices of a shard's local tensor that hold `piece`, which lies inside boxes[index].

    Input: the shard's boxes, the index of the box containing the piece, the piece.
    Output: one slice per dimension; dim 0 is offset by the rows of the earlier boxes."""
    box = boxes[index]
    offset = sum(b[0][1] - b[0][0] for b in boxes[:index])
    out = []
    for d, ((plo, phi), (blo, _)) in enumerate(zip(piece, box)):
        base = offset if d == 0 else 0
        out.append(slice(base + plo - blo, base + phi - blo))
    return tuple(out)


def cut_segment(segment: Box, src_boxes: Sequence[Box], dst_boxes: Sequence[Box]) -> list[tuple[int, int, Box]]:
    """The pieces of a segment: (src box index, dst box index, piece), ordered by (i, j).

    Invariant checked by the caller: the pieces' sizes add up to the segment's size when
    both shards cover it (boxes of one shard never overlap)."""
    pieces = []
    for i, a in enumerate(src_boxes):
        sa = intersect(segment, a)
        if sa is None:
            continue
        for j, b in enumerate(dst_boxes):
            p = intersect(sa, b)
            if p is not None:
                pieces.append((i, j, p))
    return pieces
