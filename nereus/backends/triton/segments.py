"""Segments of a message and their reduction to byte-level copy pieces.

A *segment* is a strided box of one tensor. Callers may give it in three forms (all
equivalent; `as_view` turns each into a strided tensor view, which is all the kernels
need: a base address, sizes and strides):

- a tensor view (`w[:, 1024:2048]`), possibly non-contiguous;
- `(tensor, index)` with `index` a tuple of slices (step 1) or ints;
- `SegmentView(tensor, starts, sizes)`, the box given as per-dimension start and size.

A message is a list of segments packed back to back, each row-major, at offsets given
by `layout` (each start aligned to ALIGN bytes so that every piece can be viewed with its
own dtype and so that the kernels can use 16-byte accesses).

`normalize_pair` is the host half of the kernels: it turns one (source box, destination
box) pair into *pieces*: rows of one stride over a contiguous inner run of machine
words, with every address, stride and length in words of the largest size (8, 4, 2 or
1 bytes) that divides them all. A box whose dims do not merge into one outer dim (a
3-D box of a non-contiguous view, or a view whose last dim is strided) becomes several
pieces; a strided last dim gives one-element runs, which are right but slow. Pieces
are pure integers (no tensors), so addresses past 2**31 elements are ordinary Python
ints here and int64 in the tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

ALIGN = 16  # bytes; each segment of a packed message starts at a multiple of this
MAX_WORD = 8  # bytes; the widest scalar the kernel moves (16-byte vectors come from hints)


@dataclass(frozen=True, eq=False)
class SegmentView:
    """The box `tensor[starts[0]:starts[0]+sizes[0], ...]` (one start and size per dim)."""

    tensor: torch.Tensor
    starts: tuple[int, ...]
    sizes: tuple[int, ...]

    def view(self) -> torch.Tensor:
        if len(self.starts) != self.tensor.dim() or len(self.sizes) != self.tensor.dim():
            raise ValueError(f"box of rank {len(self.sizes)} for a tensor of rank {self.tensor.dim()}")
        view = self.tensor
        for dim, (start, size) in enumerate(zip(self.starts, self.sizes)):
            if start < 0 or size < 0 or start + size > self.tensor.shape[dim]:
                raise ValueError(f"box [{start}, {start + size}) outside dim {dim} of size {self.tensor.shape[dim]}")
            view = view.narrow(dim, start, size)
        return view


def as_view(segment: Any) -> torch.Tensor:
    """Input: a tensor view, `(tensor, index)` or a SegmentView. Output: the strided view."""
    if isinstance(segment, torch.Tensor):
        return segment
    if isinstance(segment, SegmentView):
        return segment.view()
    if isinstance(segment, tuple) and len(segment) == 2 and isinstance(segment[0], torch.Tensor):
        tensor, index = segment
        index = index if isinstance(index, tuple) else (index,)
        for item in index:
            if isinstance(item, slice) and item.step not in (None, 1):
                raise ValueError(f"segment slices must have step 1, got {item}")
        return tensor[index]
    raise TypeError(f"a segment is a tensor view, (tensor, index) or SegmentView, not {type(segment).__name__}")


def nbytes(view: torch.Tensor) -> int:
    return view.numel() * view.element_size()


def contiguous_bytes(view: torch.Tensor) -> torch.Tensor:
    """A view's elements, row-major, as a fresh 1-D uint8 tensor (any strides, any rank)."""
    dense = torch.empty(view.shape, dtype=view.dtype, device=view.device)
    dense.copy_(view)
    return dense.reshape(-1).view(torch.uint8)


def layout(views: Sequence[torch.Tensor], align: int = ALIGN) -> tuple[tuple[int, ...], int]:
    """Input: the views of one message. Output: (byte offset of each view, total bytes).
    Invariant: offsets are increasing multiples of `align`; views never overlap."""
    offsets, at = [], 0
    for view in views:
        offsets.append(at)
        at += -(-nbytes(view) // align) * align
    return tuple(offsets), at


class Piece(NamedTuple):
    """One copy of `rows` rows of `inner` contiguous words each. Row r sits at word
    `src + r*src_s` and `dst + r*dst_s` (word addresses: byte address // word). On the
    buffer side of a pack or unpack the address is the byte offset // word in message
    `msg`'s buffer; on its tensor side, when the pieces come from `view_pieces(...,
    slot=k)`, it is relative to view k's base (its address rounded down to 16 bytes,
    given per call), so one plan serves the same views wherever their tensors sit. A
    single contiguous run has rows == 1 (the tiler re-cuts it)."""

    word: int
    vec: int
    src: int
    dst: int
    rows: int
    inner: int
    src_s: int
    dst_s: int
    msg: int = 0
    slot: int = 0


def _lowbit(value: int) -> int:
    return value & -value if value else 1 << 62


def normalize_pair(sizes: Sequence[int], src_strides: Sequence[int], dst_strides: Sequence[int],
                   src: int, dst: int, elem: int, msg: int = 0, slot: int = 0) -> list[Piece]:
    """Input: one box given by its sizes and, per side, element strides and byte address
    (or byte offset), for elements of `elem` bytes. Output: the pieces that copy it.

    Invariant: the pieces move exactly the box's bytes, each source byte to the
    destination byte at the same row-major position; empty boxes give no pieces.
    """
    return [_piece(src + a, dst + b, rows, run, src_s, dst_s, msg, slot)
            for a, b, rows, run, src_s, dst_s in byte_runs(sizes, src_strides, dst_strides, elem)]


def byte_runs(sizes: Sequence[int], src_strides: Sequence[int], dst_strides: Sequence[int],
              elem: int) -> list[tuple[int, int, int, int, int, int]]:
    """`normalize_pair`'s pieces in bytes, for a box at byte address 0 on both sides:
    (src, dst, rows, run, src_s, dst_s). Addresses enter a piece only by addition and
    through its word size, so the pieces of the same box at other addresses are these
    shifted (`pieces_table` does that for many boxes of one shape at once)."""
    if any(n == 0 for n in sizes):
        return []
    dims = [(n, a * elem, b * elem) for n, a, b in zip(sizes, src_strides, dst_strides) if n != 1]
    merged: list[tuple[int, int, int]] = []
    for n, a, b in reversed(dims):  # innermost first: merge a dim into the one inside it
        if merged and a == merged[-1][0] * merged[-1][1] and b == merged[-1][0] * merged[-1][2]:
            inner_n, inner_a, inner_b = merged.pop()
            merged.append((n * inner_n, inner_a, inner_b))
        else:
            merged.append((n, a, b))
    merged.reverse()
    if merged and merged[-1][1] == elem and merged[-1][2] == elem:
        run, outer = merged[-1][0] * elem, merged[:-1]
    else:  # no contiguous innermost dim: every element is its own run
        run, outer = elem, merged
    return _runs(outer, run, 0, 0)


def _runs(outer: list[tuple[int, int, int]], run: int, src: int, dst: int) -> list[tuple]:
    if len(outer) > 1:  # the kernel indexes one outer dim (no division per row): split
        n, a, b = outer[0]
        return [r for k in range(n) for r in _runs(outer[1:], run, src + k * a, dst + k * b)]
    rows, a, b = outer[0] if outer else (1, run, run)
    return [(src, dst, rows, run, a, b)]


def _piece(src: int, dst: int, rows: int, run: int, src_s: int, dst_s: int, msg: int, slot: int = 0) -> Piece:
    """A piece from byte quantities, in the widest words that divide them all."""
    low = _lowbit(math.gcd(src, dst, run, src_s, dst_s))
    word = min(MAX_WORD, low)
    return Piece(word, 2 if low >= 16 else 1, src // word, dst // word, rows, run // word,
                 src_s // word, dst_s // word, msg, slot)


def pieces_table(runs: Sequence[tuple], src: torch.Tensor, dst: torch.Tensor, msg: torch.Tensor,
                 slot: torch.Tensor) -> torch.Tensor:
    """The pieces of n boxes of one shape (`runs`: `byte_runs` of it) whose byte addresses
    are `src[i]` and `dst[i]`, of message `msg[i]` and slot `slot[i]`, as an int64 table
    [n x len(runs), len(Piece._fields)] (box by box, each box's pieces in order): what
    `normalize_pair` gives per box, built with tensor ops instead of a Python step per
    piece (a range of a v2 program moves the same box of hundreds of tensors)."""
    fields = len(Piece._fields)
    if not runs or src.numel() == 0:
        return torch.empty((0, fields), dtype=torch.int64)
    r = torch.tensor(runs, dtype=torch.int64)  # [R, 6]: src, dst, rows, run, src_s, dst_s
    at = src[:, None] + r[None, :, 0]
    to = dst[:, None] + r[None, :, 1]
    rows, run, src_s, dst_s = (r[None, :, c].expand_as(at) for c in (2, 3, 4, 5))
    bits = at | to | run | src_s | dst_s
    low = bits & -bits
    low = torch.where(bits == 0, torch.full_like(low, 1 << 62), low)  # as _lowbit(0)
    word = low.clamp(max=MAX_WORD)
    vec = torch.where(low >= 16, 2, 1)
    table = torch.stack([word, vec, at // word, to // word, rows, run // word, src_s // word, dst_s // word,
                         msg[:, None].expand_as(at), slot[:, None].expand_as(at)], dim=2)
    return table.reshape(-1, fields)


def view_pieces(view: torch.Tensor, offset: int, msg: int, direction: str, slot: int) -> list[Piece]:
    """Pieces between a tensor view and its contiguous image at byte `offset` of message
    `msg`'s buffer; direction "pack" (view → buffer) or "unpack" (buffer → view). The
    view's side is relative to the base of view `slot`, `data_ptr() - data_ptr() % ALIGN`
    (the word size and the 16-byte hint depend on the address only through that
    residue; the bases come per call)."""
    addr = view.data_ptr() % ALIGN
    if view.is_contiguous():  # the common case, one dense run: skip the general path
        run = nbytes(view)
        if run == 0:
            return []
        src, dst = (addr, offset) if direction == "pack" else (offset, addr)
        return [_piece(src, dst, 1, run, run, run, msg, slot)]
    sizes = list(view.shape)
    contiguous = _contiguous_strides(sizes)
    if direction == "pack":
        return normalize_pair(sizes, view.stride(), contiguous, addr, offset, view.element_size(), msg, slot)
    return normalize_pair(sizes, contiguous, view.stride(), offset, addr, view.element_size(), msg, slot)


def copy_pieces(src: torch.Tensor, dst: torch.Tensor) -> list[Piece]:
    """Pieces that copy view `src` into view `dst` (same shape and dtype)."""
    if src.dtype != dst.dtype or src.shape != dst.shape:
        raise ValueError(f"copy between {src.dtype}{list(src.shape)} and {dst.dtype}{list(dst.shape)}")
    return normalize_pair(list(src.shape), src.stride(), dst.stride(), src.data_ptr(), dst.data_ptr(),
                          src.element_size())


def _contiguous_strides(sizes: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(sizes):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]
