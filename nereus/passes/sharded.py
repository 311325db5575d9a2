"""sharded: box geometry of state sharded over dp replicas (`zero 1` / `zero 3`), for `dag`.

Input: a tensor pattern and the (tp, dp, zero, ep) meshes of both sides. Output: the
boxes an after (replica, stage rank) holds of a state group, cut into pieces each held by
one set of before holders (`sharded_pieces`). A side that shards the group has ep 1
(validation refuses zero with ep > 1), so its stage rank is its TP rank; the other side
may have ep > 1 (experts whole on their EP rank, `rank_boxes`). Invariant: the pieces tile the after boxes, and
each piece lies inside a box of every holder named for it. Pure and cached: the same for
every layer.
"""

from __future__ import annotations

from functools import lru_cache

from nereus.ir.model import Placement

from .layout import Box, is_sharded, rank_boxes, tp_boxes, zero_boxes


def _cut(box: Box, holders: list[tuple[object, Box]]) -> list[tuple[Box, tuple]]:
    """`box` cut into boxes each held by one set of holders ((id, held box) pairs):
    the grid of every holder boundary inside `box`, cells merged along each dimension
    (last first) while their holder sets agree."""
    inside = []
    for who, held in holders:
        clip = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, held))
        for lo, hi in clip:
            if lo >= hi:
                break
        else:
            inside.append((who, clip))
    if all(clip == box for _, clip in inside):  # every holder holds all of `box`: one cell (the common case)
        return [(box, tuple(sorted(w for w, _ in inside)))]
    cuts = [sorted({lo, hi} | {x for _, c in inside for x in c[d] if lo < x < hi}) for d, (lo, hi) in enumerate(box)]
    cells: list[tuple[Box, tuple]] = []

    def grid(prefix: tuple, d: int) -> None:
        if d == len(box):
            ids = tuple(sorted(w for w, c in inside if all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(prefix, c))))
            cells.append((prefix, ids))
            return
        for lo, hi in zip(cuts[d], cuts[d][1:]):
            grid(prefix + ((lo, hi),), d + 1)

    grid((), 0)
    for d in reversed(range(len(box))):
        merged: list[tuple[Box, tuple]] = []
        for cell, ids in cells:
            if merged:
                prev, prev_ids = merged[-1]
                if (prev_ids == ids and prev[d][1] == cell[d][0]
                        and prev[:d] + prev[d + 1:] == cell[:d] + cell[d + 1:]):
                    merged[-1] = (prev[:d] + ((prev[d][0], cell[d][1]),) + prev[d + 1:], ids)
                    continue
            merged.append((cell, ids))
        cells = merged
    return cells


def mesh_key(placement: Placement, states: tuple[str, ...]) -> tuple[int, int, int, int]:
    """(tp, dp, 1 if `states` are sharded over dp else 0, ep): all that the boxes of a
    state group depend on (a cache key that does not hash the GPU list)."""
    return placement.tp, placement.dp, int(is_sharded(placement, states)), placement.ep


def group_boxes(spec, mesh: tuple[int, int, int, int], replica: int, rank: int) -> tuple[Box, ...]:
    """Boxes of `spec` that (replica, stage rank) holds of a state group with `mesh_key`
    `mesh`."""
    tp, dp, zero, ep = mesh
    return zero_boxes(spec, tp, rank, dp, replica) if zero >= 1 else rank_boxes(spec, tp, ep, rank)


@lru_cache(maxsize=None)
def sharded_pieces(spec, before: tuple[int, int, int, int], after: tuple[int, int, int, int], replica: int,
                   rank: int) -> tuple[tuple[Box, tuple], ...]:
    """The boxes of `spec`'s state group that (replica, stage rank `rank`) of the `after`
    mesh (`mesh_key`) holds, cut by their holders in the `before` mesh: ((box, holders),
    ...), holders being stage ranks of any replica when `before` replicates the state,
    (replica, TP rank) pairs when it shards it. Pure, cached."""
    mine = group_boxes(spec, after, replica, rank)
    if not mine:
        return ()
    tp, dp, zero, ep = before
    if zero >= 1:
        return _cut_by_chunks(spec, tp, dp, mine, _ranks_meeting(spec, tp, after[0], after[3], rank))
    holders = [(t, b) for t in range(tp * ep) for b in rank_boxes(spec, tp, ep, t)]
    return tuple(cell for box in mine for cell in _cut(box, holders))


@lru_cache(maxsize=None)
def _cut_by_chunks(spec, tp: int, dp: int, mine: tuple[Box, ...], ranks: tuple[int, ...]) -> tuple:
    """`mine` cut by the dp chunks of the before TP ranks `ranks` that hold parts of it.
    Keyed by the boxes, not the after position: a replicated tensor's chunk is the same
    for every TP rank of a replica, so its cut (by every before TP rank) is made once."""
    holders = []
    rows = _local_rows(spec, tp)
    for t in ranks:
        for d in _chunks_touching(rows[t], dp, mine):
            holders.extend(((d, t), b) for b in zero_boxes(spec, tp, t, dp, d))
    return tuple(cell for box in mine for cell in _cut(box, holders))


def _chunks_touching(local: tuple, dp: int, boxes: tuple[Box, ...]) -> list[int]:
    """Replicas whose chunk of a TP rank's local tensor (`zero_boxes`; `local` is that
    rank's `_local_rows` entry) meets `boxes`: computed from local row offsets instead of
    testing all dp chunks."""
    placed, rows = local
    size = -(-rows // dp)
    found: set[int] = set()
    for b, offset in placed:
        for m in boxes:
            for (x0, x1), (y0, y1) in zip(b, m):  # _touches, inlined: ~10^5 calls at 4,096 GPUs
                if not (x0 < y1 and y0 < x1):
                    break
            else:
                lo = offset + max(b[0][0], m[0][0]) - b[0][0]
                hi = offset + min(b[0][1], m[0][1]) - b[0][0]
                found.update(range(lo // size, (hi - 1) // size + 1))
    return sorted(found)


@lru_cache(maxsize=None)
def _local_rows(spec, tp: int) -> tuple:
    """Per TP rank: ((box, its first row in the local tensor), ...) and the local row
    count; what `_chunks_touching` needs, once per (spec, tp) instead of once per (after
    replica, stage rank, before TP rank)."""
    out = []
    for rank in range(tp):
        placed, offset = [], 0
        for b in tp_boxes(spec, tp, rank):
            placed.append((b, offset))
            offset += b[0][1] - b[0][0]
        out.append((tuple(placed), offset))
    return tuple(out)


@lru_cache(maxsize=None)
def _ranks_meeting(spec, tp_before: int, tp_after: int, ep_after: int, rank_after: int) -> tuple[int, ...]:
    """TP ranks of a `tp_before` mesh whose boxes meet those of stage rank `rank_after`
    of the after mesh (`rank_boxes`, which contain every zero chunk of that rank): the
    only ranks whose chunks can hold a piece of it. Usually one (when both sides split
    the tensor alike), all for a replicated tensor; once per rank, not per replica."""
    outer = rank_boxes(spec, tp_after, ep_after, rank_after)
    return tuple(t for t in range(tp_before)
                 if any(_meets(b, m) for b in tp_boxes(spec, tp_before, t) for m in outer))


def _meets(x: Box, y: Box) -> bool:
    for (a, b), (c, d) in zip(x, y):
        if not (a < d and c < b):
            return False
    return True
