"""Scale blocks of a block-quantized shard, as pure box arithmetic (no torch).

A quantized after-shard (docs/program.md, "Weight-sync codecs") is cut into blocks of
B x B from the origin of its *local* tensor (the shard's boxes stacked along dim 0, the
local shard contract): block (i, j) holds local rows [iB, min((i+1)B, rows)) and columns
[jB, min((j+1)B, cols)). Blocks therefore never straddle the receiving shard; one may
straddle the shard's boxes (a fused q|k|v whose parts are not multiples of B) and the
senders' shards (a training split that is not a multiple of B), which the sync program's
`amax` exchange is for. The compiler (nereus.passes.quantize), the verifier
(nereus.passes.verify_codec) and the runtime (nereus.runtime.codec_work) all take their
geometry from here, so they agree by construction.

A *rect* is a local rectangle (r0, r1, c0, c1): rows [r0, r1), columns [c0, c1).
"""

from __future__ import annotations

from typing import Iterator, Sequence

Box = tuple[tuple[int, int], ...]
Rect = tuple[int, int, int, int]
Blocks = tuple[int, int, int, int]  # block rows [i0, i1), block columns [j0, j1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def local_shape(boxes: Sequence[Box]) -> tuple[int, int]:
    """(rows, cols) of a 2-D shard's local tensor."""
    return sum(b[0][1] - b[0][0] for b in boxes), boxes[0][1][1] - boxes[0][1][0]


def grid(shape: tuple[int, int], block: int) -> tuple[int, int]:
    """The number of block rows and block columns of a local tensor of `shape`."""
    return _cdiv(shape[0], block), _cdiv(shape[1], block)


def to_local(boxes: Sequence[Box], box: Box) -> list[Rect]:
    """The local rects of a global 2-D box inside the shard of `boxes` (one per shard box it
    meets, in shard order); a part of `box` outside the shard has no rect."""
    out, offset = [], 0
    for (lo, hi), (clo, chi) in boxes:
        r0, r1 = max(lo, box[0][0]), min(hi, box[0][1])
        c0, c1 = max(clo, box[1][0]), min(chi, box[1][1])
        if r0 < r1 and c0 < c1:
            out.append((offset + r0 - lo, offset + r1 - lo, c0 - clo, c1 - clo))
        offset += hi - lo
    return out


def to_global(boxes: Sequence[Box], rect: Rect) -> list[Box]:
    """The global boxes of a local rect of the shard of `boxes` (inverse of `to_local`)."""
    out, offset = [], 0
    r0, r1, c0, c1 = rect
    for (lo, hi), (clo, _) in boxes:
        a, b = max(r0, offset), min(r1, offset + hi - lo)
        if a < b:
            out.append(((lo + a - offset, lo + b - offset), (clo + c0, clo + c1)))
        offset += hi - lo
    return out


def block_rect(i: int, j: int, shape: tuple[int, int], block: int) -> Rect:
    """The local rect of block (i, j), clipped at the shard's edge."""
    return i * block, min((i + 1) * block, shape[0]), j * block, min((j + 1) * block, shape[1])


def touched(rect: Rect, block: int) -> Blocks:
    """The blocks a rect meets."""
    r0, r1, c0, c1 = rect
    return r0 // block, _cdiv(r1, block), c0 // block, _cdiv(c1, block)


def interior(rect: Rect, shape: tuple[int, int], block: int) -> Blocks:
    """The blocks that lie wholly inside a rect (a block clipped by the shard's edge is
    whole when the rect reaches that edge); possibly empty (i0 >= i1 or j0 >= j1)."""
    r0, r1, c0, c1 = rect
    rows, cols = grid(shape, block)
    i1 = rows if r1 == shape[0] else r1 // block
    j1 = cols if c1 == shape[1] else c1 // block
    return _cdiv(r0, block), i1, _cdiv(c0, block), j1


def origins(rect: Rect, block: int) -> Blocks:
    """The blocks whose first element (their origin) lies in a rect: the scales a segment
    covering the rect carries (each block's origin is written exactly once, so each scale
    travels exactly once)."""
    r0, r1, c0, c1 = rect
    return _cdiv(r0, block), _cdiv(r1, block), _cdiv(c0, block), _cdiv(c1, block)


def count(blocks: Blocks) -> int:
    i0, i1, j0, j1 = blocks
    return max(0, i1 - i0) * max(0, j1 - j0)


def boundary(rect: Rect, shape: tuple[int, int], block: int) -> Iterator[tuple[int, int]]:
    """The blocks a rect meets without holding them whole: only those can need the
    elements of another sender for their scale. Empty when the rect's edges lie on block
    boundaries or on the shard's edge (every block of a real model's TP split)."""
    ti0, ti1, tj0, tj1 = touched(rect, block)
    ii0, ii1, ij0, ij1 = interior(rect, shape, block)
    for i in range(ti0, ti1):
        row_inside = ii0 <= i < ii1
        for j in range(tj0, tj1):
            if not (row_inside and ij0 <= j < ij1):
                yield i, j


def intersect(a: Rect, b: Rect):
    """The intersection of two rects, or None."""
    r0, r1, c0, c1 = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return (r0, r1, c0, c1) if r0 < r1 and c0 < c1 else None


def uncovered(target: Rect, rects: Sequence[Rect]):
    """A cell of `target` that no rect of `rects` covers (as a rect), or None when their
    union covers it. Exact for any rects (overlaps allowed): the target is cut at every
    rect edge inside it and each cell is tested."""
    parts = [r for r in (intersect(target, r) for r in rects) if r is not None]
    rows = sorted({target[0], target[1]} | {r[0] for r in parts} | {r[1] for r in parts})
    cols = sorted({target[2], target[3]} | {r[2] for r in parts} | {r[3] for r in parts})
    for a, b in zip(rows, rows[1:]):
        for c, d in zip(cols, cols[1:]):
            if not any(r[0] <= a and b <= r[1] and r[2] <= c and d <= r[3] for r in parts):
                return a, b, c, d
    return None


def scales_in(boxes: Sequence[Box], box: Box, block: int) -> int:
    """The scales a segment `box` written into the shard of `boxes` carries (the blocks
    whose origin it holds)."""
    return sum(count(origins(rect, block)) for rect in to_local(boxes, box))


def shard_scales(boxes: Sequence[Box], block: int) -> int:
    """The scales of a whole quantized shard."""
    rows, cols = grid(local_shape(boxes), block)
    return rows * cols
