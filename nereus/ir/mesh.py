"""The arithmetic of mesh layouts (docs/ir.md, "Mesh layouts"): which index ranges of a
tensor the GPU at a mesh coordinate holds, with torch.distributed.tensor's semantics.

- `replicate`: every rank of the mesh dimension holds what the dimensions before gave it;
- `shard(d)`: dimension d of that is cut as `torch.chunk` cuts it: chunks of
  ceil(n / size) indices, the last ones short or empty (DTensor's `Shard(d)`);
- `strided(d, s)`: dimension d is first cut into s chunks, each of them into one chunk per
  rank, and rank i holds the i-th piece of every one of the s chunks, in order (DTensor's
  `_StridedShard(d, split_factor=s)`, which FSDP2 uses over tensor parallelism).

Mesh dimensions apply outermost first, each to what the previous ones left, as DTensor
applies placements left to right. The result on a GPU is, per tensor dimension, an
ordered list of index ranges; the GPU's local tensor is the tensor at the product of those
lists. The programs' local shard contract (boxes stacked along dim 0) expresses it when at
most dimension 0 has more than one range (`shard_boxes`). Pure Python: the compiler, the
validator and nereus.interop (which checks it against the local tensors DTensor gives)
share it.
"""

from __future__ import annotations

import fnmatch
from functools import lru_cache
from typing import Optional

from .model import LayoutRule, Mesh, MeshLayout, Placement

Range = tuple[int, int]
Box = tuple[Range, ...]


def chunk(length: int, count: int, index: int) -> Range:
    """Range [lo, hi) of chunk `index` when `length` indices are cut as torch.chunk cuts
    them into `count` chunks (missing chunks are empty)."""
    size = -(-length // count)
    lo = min(index * size, length)
    return lo, min(lo + size, length)


def _select(ranges: list[Range], local: list[Range]) -> list[Range]:
    """The global ranges that positions `local` (ranges over the concatenation of
    `ranges`) cover, in order, adjacent ones merged."""
    out: list[Range] = []
    for a, b in local:
        offset = 0
        for lo, hi in ranges:
            n = hi - lo
            x, y = max(a, offset), min(b, offset + n)
            if x < y:
                piece = (lo + x - offset, lo + y - offset)
                if out and out[-1][1] == piece[0]:
                    out[-1] = (out[-1][0], piece[1])
                else:
                    out.append(piece)
            offset += n
    return out


def local_ranges(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
                 placements) -> tuple[tuple[Range, ...], ...]:
    """Per tensor dimension, the ordered global index ranges the GPU at mesh coordinate
    `coord` holds (empty ranges dropped: a dimension without any means no shard)."""
    ranges = [[(0, n)] if n else [] for n in shape]
    for size, c, placement in zip(mesh_shape, coord, placements):
        if placement.kind == "replicate":
            continue
        d = placement.dim
        length = sum(hi - lo for lo, hi in ranges[d])
        if placement.kind == "shard":
            local = [chunk(length, size, c)]
        else:  # strided: split chunks, each cut over the mesh dimension
            local = []
            for j in range(placement.split):
                a, b = chunk(length, placement.split, j)
                lo, hi = chunk(b - a, size, c)
                local.append((a + lo, a + hi))
        ranges[d] = _select(ranges[d], [r for r in local if r[0] < r[1]])
    return tuple(tuple(r) for r in ranges)


class StridedLayoutError(ValueError):
    """A layout whose local tensor is strided along a dimension other than 0."""

    def __init__(self, dim: int):
        super().__init__(f"its shards take several ranges of dimension {dim}")
        self.dim = dim


def shard_boxes(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
                placements) -> tuple[Box, ...]:
    """The boxes of the GPU at `coord`, stacked along dim 0 in local order (the programs'
    local shard contract); () when it holds nothing. Raises StridedLayoutError when a
    dimension other than 0 has several ranges (the contract cannot express it)."""
    ranges = local_ranges(shape, mesh_shape, coord, placements)
    if any(not r for r in ranges):
        return ()
    for d, r in enumerate(ranges):
        if d > 0 and len(r) > 1:
            raise StridedLayoutError(d)
    if not shape:
        return ((),)
    rest = tuple(r[0] for r in ranges[1:])
    return tuple((r,) + rest for r in ranges[0])


def rule_for(layout: MeshLayout, name: str) -> Optional[tuple[int, LayoutRule]]:
    """(index, rule) of the first rule whose pattern matches tensor `name`, or None."""
    for i, rule in enumerate(layout.rules):
        if fnmatch.fnmatchcase(name, rule.pattern):
            return i, rule
    return None


def rule_mesh(rule: LayoutRule, placement: Placement) -> Mesh:
    """The mesh a rule splits over: its own sub-mesh, or the placement's."""
    return rule.mesh if rule.mesh is not None else placement.layout_mesh()


def mesh_boxes(name: str, shape: tuple[int, ...], placement: Placement, rank: int) -> tuple[Box, ...]:
    """Boxes of tensor `name` (of `shape`) on the GPU at index `rank` of a mesh-layout
    placement's GPU list; () where its rule's mesh leaves that GPU out or its shard is
    empty. Raises StridedLayoutError (validation refuses such layouts)."""
    return _mesh_boxes(name, shape, placement.layout, placement.gpus, rank)


@lru_cache(maxsize=1 << 16)
def _mesh_boxes(name: str, shape: tuple[int, ...], layout: MeshLayout, gpus: tuple[int, ...],
                rank: int) -> tuple[Box, ...]:
    found = rule_for(layout, name)
    if found is None:
        return ()
    rule = found[1]
    mesh = rule.mesh if rule.mesh is not None else Mesh(layout.dims, gpus)
    coord = mesh.coordinate(gpus[rank])
    if coord is None:
        return ()
    return shard_boxes(shape, mesh.shape, coord, rule.placements)
