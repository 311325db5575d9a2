"""A stream's packed views cut into chunks, by shape alone (streams.py moves them).

    cut(views, chunk_bytes, alone_bytes, counts) -> [[(first view, segment, count)]]
    plan(views, chunk_bytes, alone_bytes, in_place, counts) -> (ChunkPlan, ...)
    ring(sizes, depth) -> [bytes of each ring slot]

Input: the views a stream packs, in order (meta tensors do: only shapes, strides and
dtypes are read), optionally with `counts` (view i stands for that many views of the
same shape, one after the other: a piece of a v2 range, one region of each of its
tensors). Output: the chunks, each a list of segments (views of whole rows), and their
plans. Invariant: a sender and its receiver cut the same views alike; a run of whole
views that share a chunk is one segment, so the work is per run, not per view.
streams.py's `chunk_views` and `plan_chunks` call these with its switches (ALONE_BYTES,
IN_PLACE).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from . import packing


def nbytes_of(view: torch.Tensor) -> int:
    return view.numel() * view.element_size()


def aligned(n: int) -> int:
    """A view's packed bytes in a chunk of several (packing.layout aligns each)."""
    return (n + packing.ALIGN - 1) // packing.ALIGN * packing.ALIGN


def cut(views: list, chunk_bytes: int, alone_bytes: int, counts: Optional[list] = None) -> list:
    """[[(index of the first view it cuts, segment, how many views)]]: `views` in order,
    cut into chunks of at most `chunk_bytes` packed bytes (a row larger than a chunk
    travels alone); a view is split along its first dimension, so each segment is a view
    of whole rows. A view of `alone_bytes` or more (0: no such rule) shares no chunk: its
    chunks hold it alone. `counts[i]` (default 1) says view i stands for that many views
    of the same shape, one after the other (a piece of a v2 range moves one region of
    each of its tensors): cut as that many views would be, with each run of whole views
    that share a chunk one segment, so the work is per run, not per view. A view cut
    where a chunk ends is cut after a multiple of packing.ALIGN bytes (`step` rows), so its parts
    take no more packed bytes than the whole view (the bound the memory model proves,
    nereus.passes.memory_model); where not even `step` rows fit an empty chunk, it takes
    `step` (as a row larger than a chunk travels alone)."""
    chunks, current, used, flat = [], [], 0, 0
    for view, n in zip(views, counts if counts is not None else [1] * len(views)):
        first, flat = flat, flat + n
        if view.numel() == 0:
            continue
        rows = view.shape[0] if view.dim() else 1
        size = nbytes_of(view)
        row_bytes = size // rows
        step = packing.ALIGN // math.gcd(row_bytes, packing.ALIGN)  # rows of a multiple of ALIGN bytes
        alone = 0 < alone_bytes <= size
        k = 0
        while k < n:
            if not alone and size <= chunk_bytes - used:  # whole views from here, as many as fit
                spacing = aligned(size)
                fit = min(n - k, (chunk_bytes - used - size) // spacing + 1)
                current.append((first + k, view, fit))
                used += fit * spacing
                k += fit
                if used >= chunk_bytes:
                    chunks.append(current)
                    current, used = [], 0
                continue
            # one view that does not fit whole: cut along its rows
            if alone and current:
                chunks.append(current)
                current, used = [], 0
            start = 0
            while start < rows:
                take = min(rows - start, max(0, chunk_bytes - used) // row_bytes)
                if take < rows - start:
                    take -= take % step
                if take == 0 and current:
                    chunks.append(current)
                    current, used = [], 0
                    continue
                take = max(take, min(step, rows - start))
                current.append((first + k, view if take == rows else view[start:start + take], 1))
                used += aligned(take * row_bytes)
                start += take
                if used >= chunk_bytes or alone:
                    chunks.append(current)
                    current, used = [], 0
            k += 1
    if current:
        chunks.append(current)
    return chunks


@dataclass(frozen=True)
class SegmentPlan:
    """A chunk segment by shape alone: a view (shape, stride, `offset` elements past the
    tensor's storage offset) of the contiguous local tensor of the stream's view `view`,
    and with `count` > 1 the same view of each of the `count` stream views from `view`
    on, packed one after the other `spacing` bytes apart."""

    view: int
    shape: tuple
    stride: tuple
    offset: int
    count: int = 1
    spacing: int = 0


@dataclass(frozen=True)
class ChunkPlan:
    """A chunk by shape alone (see `plan`); `offsets` holds each segment's first view's
    offset (`member_offsets` each view's)."""

    segments: tuple  # SegmentPlan
    offsets: tuple
    nbytes: int
    fused: bool
    single: bool  # one contiguous segment: travels in place where it lies in the stream's memory

    @property
    def views(self) -> int:
        """How many views (stream tensors' regions) the chunk packs."""
        return sum(s.count for s in self.segments)

    def member_offsets(self) -> tuple:
        """The byte offset of every view of the chunk, in order."""
        return tuple(o + i * s.spacing for s, o in zip(self.segments, self.offsets) for i in range(s.count))


def plan(views: list, chunk_bytes: int, alone_bytes: int, in_place: bool, counts: Optional[list] = None) -> tuple:
    """The ChunkPlans of `cut`'s chunks: each segment's shape, stride and offset, each
    chunk's packed layout (a chunk of one view: its exact bytes), whether the fused
    kernels pack it (`fused`) and whether it travels in place (`in_place`: the switch;
    one contiguous view)."""
    out = []
    for chunk in cut(views, chunk_bytes, alone_bytes, counts):
        total = sum(n for _, _, n in chunk)
        if total == 1:
            offsets, nbytes = (0,), nbytes_of(chunk[0][1])
        else:
            offsets, at = [], 0
            for _, v, n in chunk:
                offsets.append(at)
                at += n * aligned(nbytes_of(v))
            offsets, nbytes = tuple(offsets), at
        segments = tuple(SegmentPlan(i, tuple(v.shape), tuple(v.stride()), v.storage_offset(), n,
                                     aligned(nbytes_of(v)) if n > 1 else 0) for i, v, n in chunk)
        contiguous = all(v.is_contiguous() for _, v, _ in chunk)
        out.append(ChunkPlan(segments, offsets, nbytes, total >= FUSED_MIN_SEGMENTS and not contiguous,
                             in_place and total == 1 and contiguous))
    return tuple(out)


def ring(sizes: list, depth: int) -> list:
    """Per ring slot, the largest of the chunk sizes (0: in place) it holds in turn."""
    depth = max(1, depth)
    return [max(sizes[i::depth]) for i in range(min(depth, len(sizes)))]


FUSED_MIN_SEGMENTS = 16


def fused(segments: list) -> bool:
    """Pack a chunk with the fused kernels only where it has many segments (launches to
    save) and some is strided; a few large segments copy at memory speed with one
    `copy_` each, with no kernel variant to compile and no plan to build."""
    return len(segments) >= FUSED_MIN_SEGMENTS and not all(v.is_contiguous() for v in segments)
