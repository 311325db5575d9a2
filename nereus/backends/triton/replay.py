"""Replayed launches: the tables of a pack, unpack or copy built once, launched again with
only the tensors' addresses new.

Why: a transition repeats (a per-step weight sync, a plan change back and forth), and
on one H200 the host's posting of a TP -> DP change of 32 8B-shaped layers took 15.5-23.4
ms against 11.8 ms of GPU work (benchmarks/RESULTS.md, "session 10"): a Python step, a
view and a copy launch per piece. The Packer's own cache (packer.py) keys a plan by every
view's shape, stride and address, so it still takes each view and fingerprints it per
call, and a copy plan holds both sides' addresses, which change with every new shard.
Here nothing is viewed per call: the caller describes its boxes once, by shape alone, as
strided boxes of numbered *slots* (a tensor or a byte buffer), and per call gives one
address per slot.

Input: `Box`es (slot, shape, element strides, element offset past the slot's address,
element size), the slots' address residues mod 16, the device. Output: a `Replay`, one
launch per access class (see tables.py), every address relative to its slot's base (the
slot's address rounded down to 16 bytes); `table(tensors)` gives the per-call bases and
`run(table)` launches. Invariant: a Replay built for given residues moves exactly its
boxes' bytes, each to the same row-major position, for any slot addresses with those
residues (the word size and 16-byte vector class depend on an address only through its
residue); callers key their Replays by the residues.

The kernel is the packer's (kernels.py, REL_DST or REL_SRC): in a pack or a copy the
destination is relative to `bases[msg]` and the source to `views[slot]`; in an unpack
the reverse. One table serves as both: a piece's `msg` and `slot` are slot numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .segments import ALIGN, Piece, _contiguous_strides, byte_runs, normalize_pair, pieces_table
from .tables import Launch, build_launches, upload


@dataclass(frozen=True)
class Box:
    """A strided box of slot `slot`'s tensor: `shape` with element `stride`s, starting
    `offset` elements past the address the slot is given per call, elements of `elem`
    bytes."""

    slot: int
    shape: tuple
    stride: tuple
    offset: int
    elem: int


def copy_pieces(pairs: Sequence[tuple[Box, Box]], residues: Sequence[int]) -> list[Piece]:
    """Pieces of same-device copies, each (source box, destination box) of one shape."""
    out = []
    for src, dst in pairs:
        if tuple(src.shape) != tuple(dst.shape) or src.elem != dst.elem:
            raise ValueError(f"copy between boxes {list(src.shape)} x{src.elem} and {list(dst.shape)} x{dst.elem}")
        out += normalize_pair(src.shape, src.stride, dst.stride, residues[src.slot] + src.offset * src.elem,
                              residues[dst.slot] + dst.offset * dst.elem, src.elem, msg=dst.slot, slot=src.slot)
    return out


def message_pieces(kind: str, entries: Sequence[tuple[Box, int, int]], residues: Sequence[int]) -> list[Piece]:
    """Pieces of a pack ("pack": box -> buffer) or an unpack ("unpack": buffer -> box);
    entries: (box, the buffer's slot, the box's byte offset in the buffer)."""
    out = []
    for box, buffer, offset in entries:
        dense = _contiguous_strides(box.shape)
        at, to = residues[box.slot] + box.offset * box.elem, residues[buffer] + offset
        if kind == "pack":
            out += normalize_pair(box.shape, box.stride, dense, at, to, box.elem, msg=buffer, slot=box.slot)
        else:
            out += normalize_pair(box.shape, dense, box.stride, to, at, box.elem, msg=buffer, slot=box.slot)
    return out


# an entry of fewer boxes than this is cut box by box in Python: a table's dozen tensor ops
# cost a fixed ~0.15 ms, a box's pieces in Python ~5 us (CPU box, 2026-12-07: the same at
# about 40 boxes; 1.1 ms against 0.17 ms at 256). Dense programs' entries are a stage's
# layers at most; an expert range is hundreds of tensors
TABLE_MIN_BOXES = 48


def message_table(kind: str, entries: Sequence[tuple], residues: Sequence[int], table=None):
    """`message_pieces` of entries that each stand for several boxes: entry (box, buffer
    slot, byte offset, count, spacing) is the `count` boxes of slots box.slot,
    box.slot + 1, ... (the same shape, strides and element offset in each), packed at
    offset, offset + spacing, ... of the buffer. The same pieces, in the same order, as
    `message_pieces` of the boxes one by one: an entry of TABLE_MIN_BOXES or more is cut
    once and shifted per box with tensor ops (segments.pieces_table; a v2 range's
    hundreds of tensors are one entry), and then the whole is an int64 table; else a
    list of Piece. `table`: `residue_table(residues)` when the caller has it."""
    if kind not in ("pack", "unpack"):
        raise ValueError(f"a message is packed or unpacked, not {kind!r}")
    parts: list = [[]]
    for box, buffer, offset, count, spacing in entries:
        if count < TABLE_MIN_BOXES:
            parts[-1] += message_pieces(kind, [(Box(box.slot + k, box.shape, box.stride, box.offset, box.elem), buffer,
                                                offset + k * spacing) for k in range(count)], residues)
            continue
        table = residue_table(residues) if table is None else table
        dense = _contiguous_strides(box.shape)
        runs = byte_runs(box.shape, box.stride, dense, box.elem) if kind == "pack" else \
            byte_runs(box.shape, dense, box.stride, box.elem)
        slots = torch.arange(box.slot, box.slot + count, dtype=torch.int64)
        at = table[slots] + box.offset * box.elem
        to = table[buffer] + offset + torch.arange(count, dtype=torch.int64) * spacing
        src, dst = (at, to) if kind == "pack" else (to, at)
        parts += [pieces_table(runs, src, dst, torch.full_like(slots, buffer), slots), []]
    return _joined(parts)


def copy_table(entries: Sequence[tuple], residues: Sequence[int], table=None):
    """`copy_pieces` of entries (source box, destination box, count, slot step) that each
    stand for `count` pairs: pair k copies slot src.slot + k x step into slot
    dst.slot + k x step, the same boxes of each (a list or a table, as `message_table`)."""
    parts: list = [[]]
    for src, dst, count, step in entries:
        if tuple(src.shape) != tuple(dst.shape) or src.elem != dst.elem:
            raise ValueError(f"copy between boxes {list(src.shape)} x{src.elem} and {list(dst.shape)} x{dst.elem}")
        if count < TABLE_MIN_BOXES:
            parts[-1] += copy_pieces([(Box(src.slot + k * step, src.shape, src.stride, src.offset, src.elem),
                                       Box(dst.slot + k * step, dst.shape, dst.stride, dst.offset, dst.elem))
                                      for k in range(count)], residues)
            continue
        table = residue_table(residues) if table is None else table
        runs = byte_runs(src.shape, src.stride, dst.stride, src.elem)
        k = torch.arange(count, dtype=torch.int64) * step
        parts += [pieces_table(runs, table[src.slot + k] + src.offset * src.elem,
                               table[dst.slot + k] + dst.offset * dst.elem, dst.slot + k, src.slot + k), []]
    return _joined(parts)


def _joined(parts: list):
    """Alternating lists of Piece and tables, in order, as one list (no table among them)
    or one table."""
    if len(parts) == 1:
        return parts[0]
    fields = len(Piece._fields)
    return torch.cat([p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.int64).view(-1, fields)
                      for p in parts if len(p)])


class Replay:
    """The launches of one pack, unpack or copy, built once (see the module docstring)."""

    def __init__(self, kind: str, pieces, device: Optional[torch.device] = None,
                 tile: Optional[tuple[int, int]] = None, max_vec: int = 2):
        """The launches of `pieces` (a list of Piece, or a table of them: `message_table`,
        `copy_table`), their tables on `device` (None: left in host memory for
        `to_device`, which uploads the tables of many replays at once)."""
        if kind not in ("pack", "unpack", "copy"):
            raise ValueError(f"a replay packs, unpacks or copies, not {kind!r}")
        rel = "src" if kind == "unpack" else "dst"
        self.kind = kind
        self.launches = build_launches(pieces, 0, rel, tile, max_vec)
        if device is not None:
            to_device([self], device)
        # the kernel variants it launches, named as Packer.compiled names them (a copy
        # runs the pack variant: destination relative to `bases`, source to `views`)
        variant = "unpack" if kind == "unpack" else "pack"
        self.classes = frozenset((variant, x.word, x.vec, x.rows, x.cols) for x in self.launches)

    def run(self, table: torch.Tensor) -> None:
        """Launch on the current stream; `table` from `table()` of this call's slots."""
        from . import kernels

        rel = kernels.REL_SRC if self.kind == "unpack" else kernels.REL_DST
        for launch in self.launches:
            kernels.run_launch(launch, rel, table, table)


def to_device(replays: Sequence[Replay], device: torch.device) -> None:
    """Move the launch tables of `replays` to `device` in one upload: views of one block.
    Why: each upload goes through a pinned host block, and while the GPU still runs the
    transition the caching host allocator can reuse none of its blocks, so every table
    pinned its own (measured on one H200: a cold 32-layer TP -> DP call 0.8 s instead of
    0.15 s with 212 uploads)."""
    launches = [x for r in replays for x in r.launches]
    parts, at, spans = [], 0, []
    for x in launches:
        spans.append([])
        for table in (x.segments, x.tiles):
            raw = table.contiguous().reshape(-1).view(torch.uint8)
            spans[-1].append((at, at + raw.numel(), table.dtype, tuple(table.shape)))
            # every table starts 16-byte aligned, as when uploaded alone: Triton compiles a
            # kernel apart for a pointer argument that is not, which Packer.compile does not
            # warm (a segment row is 72 bytes: the next table would start 8 bytes off)
            pad = -raw.numel() % 16
            parts += [raw, torch.zeros(pad, dtype=torch.uint8)] if pad else [raw]
            at += raw.numel() + pad
    if not parts:
        return
    block = upload(torch.cat(parts), device)
    moved = iter([Launch(x.word, x.vec, x.rows, x.cols, *(block[a:b].view(dtype).view(shape) for a, b, dtype, shape in
                                                           span), x.moved_bytes) for x, span in zip(launches, spans)])
    for r in replays:
        r.launches = [next(moved) for _ in r.launches]


def residues(addresses: Sequence[int]) -> tuple[int, ...]:
    return tuple(a % ALIGN for a in addresses)


def residue_table(residues: Sequence[int]) -> torch.Tensor:
    """Slot residues as an int64 tensor (once per stream: its chunks' tables index it)."""
    return torch.tensor(residues, dtype=torch.int64)


def table(addresses: Sequence[int], device: torch.device) -> torch.Tensor:
    """The per-call table: each slot's base (address rounded down to 16 bytes) as a byte
    offset from the device's anchor, on `device` (queued on the current stream)."""
    from . import kernels

    anchor = kernels.anchor(device).data_ptr()
    return upload(torch.tensor([a - a % ALIGN - anchor for a in addresses], dtype=torch.int64), device)
