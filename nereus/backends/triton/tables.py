"""Segment and tile tables: the device-side description one kernel launch runs from.

Pieces (see `segments.py`) are grouped by their access class (word size, 16-byte
vectors or not); each class is one launch. For a class, a tile shape ROWS x COLS (words)
is chosen to minimise the lanes launched plus per-tile and per-row overheads, and every
piece is cut into tiles. A contiguous run is re-cut as full rows of COLS words plus one
tail row, so a 64 MiB run and a 4 KiB run both fill whole tiles, and the kernel's mask
needs no per-element multiply.

Addresses in the tables are word offsets from an *anchor*: a small 16-byte aligned
tensor of the data's device passed to the kernel as a real pointer. Triton knows a
pointer argument's alignment, and keeps it through `anchor + offset` when the offsets
carry `tl.multiple_of`; an address cast from an integer (`int_to_ptr`) loses it, and the
PTX then has no vector loads (seen: 0 of 16 data loads were `ld.global.v2`, and 8 of
8 with the anchor). Offsets on the buffer side of a pack/unpack are left relative to the
message's buffer, whose anchor offset comes per call from a small `bases` table, and on
its tensor side relative to each view's 16-byte aligned base, which a second small table
gives per call: a pack or unpack plan depends on the views' shapes, strides and address
residues, not on where the caching allocator put this transition's shards.

Tables are int64 (addresses and strides of tensors past 2**31 elements are exact),
built on the host with vectorised torch ops, copied to the device once and cached by
the caller.

Segment table, one row of NCOLS int64 per piece:
    0 src   1 dst   2 msg   3 rows   4 inner   5 src_s   6 dst_s   7 col_tiles   8 slot
(slot: the view whose base the tensor side of a pack or unpack is relative to, see
`segments.Piece`; such tables are built with anchor 0 and the bases come per call.)
Tile table, one row of two int32 per program: (piece index, tile index in the piece).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .segments import Piece

NCOLS = 9
TILE_OVERHEAD = 512  # lane-equivalents a tile costs beyond its lanes (table loads, latency)
ROW_OVERHEAD = 16  # lane-equivalents per tile row (row index arithmetic, short bursts)
COLS_CHOICES = (16, 32, 64, 128, 256, 512, 1024, 2048)
BLOCK_CHOICES = (512, 1024, 2048, 4096)  # words per tile


@dataclass(frozen=True, eq=False)
class Launch:
    """One kernel launch: a class of pieces and its tables (host or device tensors)."""

    word: int
    vec: int
    rows: int  # ROWS of a tile
    cols: int  # COLS of a tile
    segments: torch.Tensor  # [n, NCOLS] int64
    tiles: torch.Tensor  # [t, 2] int32
    moved_bytes: int

    @property
    def num_warps(self) -> int:
        return 4 if self.rows * self.cols <= 2048 else 8

    def to(self, device: torch.device) -> "Launch":
        return Launch(self.word, self.vec, self.rows, self.cols, upload(self.segments, device),
                      upload(self.tiles, device), self.moved_bytes)


def upload(table: torch.Tensor, device) -> torch.Tensor:
    """A host table on `device`. To CUDA through pinned memory and without blocking: a
    copy from pageable memory synchronizes the host with the stream first, so every plan
    built in a transition stalled the host until the device had drained the transfers
    queued before it (37 stalls of ~1 ms in one expert-parallel transition on 2 H200s).
    The pinned block is the caching host allocator's, kept until the copy is done."""
    device = torch.device(device)
    if device.type != "cuda" or table.device.type != "cpu":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


def choose_tile(shapes: Counter, force: Optional[tuple[int, int]] = None) -> tuple[int, int]:
    """Input: how many pieces have each (rows, inner run length in words); rows == 1 is
    one contiguous run. Output: (ROWS, COLS), powers of two, minimising
    sum(tiles * (ROWS*COLS + TILE_OVERHEAD + ROWS*ROW_OVERHEAD)), which prefers few
    wide tiles that waste few lanes. `force` bypasses the search."""
    if force is not None:
        return force
    if len(shapes) <= PYTHON_SHAPES:
        return _choose_tile_python(shapes)
    return _choose_tile_torch(shapes)


# up to this many distinct piece shapes the search runs on Python ints (a few microseconds
# a shape; a launch's pieces usually come in a handful of shapes); from it on, on tensors.
# Why: a replayed stream (runtime/replay.py) builds one launch per chunk, and 32 rounds of
# small torch ops per launch cost a cold 32-layer TP -> DP 0.24 s of its 0.8 s on one H200
PYTHON_SHAPES = 64


def _choose_tile_python(shapes: Counter) -> tuple[int, int]:
    best: Optional[tuple[int, tuple[int, int]]] = None
    for block in BLOCK_CHOICES:
        for cols in COLS_CHOICES:
            if cols > block:
                continue
            nrows = block // cols
            tiles = 0
            for (rows, inner), count in shapes.items():
                if rows == 1:
                    tiles += count * (-(-(inner // cols) // nrows) + (1 if inner % cols else 0))
                else:
                    tiles += count * (-(-rows // nrows)) * (-(-inner // cols))
            cost = tiles * (block + TILE_OVERHEAD + nrows * ROW_OVERHEAD)
            if best is None or cost < best[0]:
                best = (cost, (nrows, cols))
    assert best is not None
    return best[1]


def _choose_tile_torch(shapes: Counter) -> tuple[int, int]:
    best: Optional[tuple[int, tuple[int, int]]] = None
    # pieces come in few distinct shapes: cost each shape once, weighted by its count
    table = torch.tensor([(r, i, n) for (r, i), n in shapes.items()], dtype=torch.int64).view(-1, 3)
    rows, inner, counts = table[:, 0], table[:, 1], table[:, 2]
    run = rows.eq(1)
    numel = rows * inner
    for block in BLOCK_CHOICES:
        for cols in COLS_CHOICES:
            if cols > block:
                continue
            nrows = block // cols
            tiles = torch.where(run, _ceil(numel // cols, nrows) + (numel % cols).gt(0),
                                _ceil(rows, nrows) * _ceil(inner, cols))
            cost = int((tiles * counts).sum()) * (block + TILE_OVERHEAD + nrows * ROW_OVERHEAD)
            if best is None or cost < best[0]:
                best = (cost, (nrows, cols))
    assert best is not None
    return best[1]


def build_launches(pieces: Union[Sequence[Piece], torch.Tensor], anchor: int, rel: Optional[str] = None,
                   force_tile: Optional[tuple[int, int]] = None, max_vec: int = 2) -> list[Launch]:
    """Input: pieces (any order, any classes; a list of Piece, or an int64 table of their
    fields, one row per piece, as segments.pieces_table builds it), the anchor's byte
    address (16-byte aligned), and which side holds buffer offsets (`rel`: "src", "dst"
    or None).
    Output: one Launch per (word, vec) class.

    Invariant: the tiles of a launch cover every word of every piece of its class exactly
    once (masked lanes excepted), so the launches together move exactly the pieces' bytes.
    `max_vec=1` turns off the 16-byte alignment hints (for measuring what they give)."""
    if anchor % 16:
        raise ValueError("the anchor must be 16-byte aligned")
    return [_launch(word, vec, group, anchor // word, rel, force_tile)
            for (word, vec), group in _classes(pieces, max_vec)]


def launch_classes(pieces: Union[Sequence[Piece], torch.Tensor], force_tile: Optional[tuple[int, int]] = None,
                   max_vec: int = 2) -> list[tuple[int, int, int, int]]:
    """(word, vec, ROWS, COLS) of each launch `build_launches` would make of these pieces
    (a list or a table, as there), without building its tables (what a caller needs to
    know whether the kernel variants are compiled)."""
    return [(word, vec) + choose_tile(_shapes(group), force_tile) for (word, vec), group in _classes(pieces, max_vec)]


_FIELDS = len(Piece._fields)
_WORD, _VEC, _ROWS, _INNER = (Piece._fields.index(name) for name in ("word", "vec", "rows", "inner"))


def _shapes(group) -> Counter:
    """How many pieces of a group (a list, or a table) have each (rows, inner)."""
    if not isinstance(group, torch.Tensor):
        return Counter((p.rows, p.inner) for p in group)
    if int(group[:, _INNER].max()) >= 1 << 32 or int(group[:, _ROWS].max()) >= 1 << 30:
        found, counts = torch.unique(group[:, [_ROWS, _INNER]], dim=0, return_counts=True)
        return Counter({(r, i): n for (r, i), n in zip(found.tolist(), counts.tolist())})
    # one int64 key per piece (rows above bit 32): a 1-D unique, far cheaper than unique(dim=0)
    found, counts = torch.unique(group[:, _ROWS] * (1 << 32) + group[:, _INNER], return_counts=True)
    return Counter({(key >> 32, key & 0xFFFFFFFF): n for key, n in zip(found.tolist(), counts.tolist())})


def _classes(pieces: Union[Sequence[Piece], torch.Tensor], max_vec: int) -> list:
    """The pieces grouped by access class (word size, vector width), widest first, each
    group in the given order: lists of Piece from a list (a Python pass: a message's
    pieces are usually few), tables from a table (tensor ops: a table is built for many)."""
    if not isinstance(pieces, torch.Tensor):
        classes: dict[tuple[int, int], list[Piece]] = {}
        for p in pieces:
            classes.setdefault((p.word, min(p.vec, max_vec)), []).append(p)
        return sorted(classes.items(), reverse=True)
    if pieces.shape[0] == 0:
        return []
    key = pieces[:, _WORD] * 8 + pieces[:, _VEC].clamp(max=max_vec)  # word <= 8, vec <= 2
    found = sorted(torch.unique(key).tolist(), reverse=True)
    if len(found) == 1:
        return [((found[0] // 8, found[0] % 8), pieces)]
    return [((k // 8, k % 8), pieces[key == k]) for k in found]


def _launch(word: int, vec: int, pieces, anchor: int, rel: Optional[str],
            force_tile: Optional[tuple[int, int]]) -> Launch:
    fields = pieces if isinstance(pieces, torch.Tensor) else \
        torch.tensor(pieces, dtype=torch.int64).view(-1, _FIELDS)  # Piece is a NamedTuple
    order = [Piece._fields.index(name) for name in ("src", "dst", "msg", "rows", "inner", "src_s", "dst_s")]
    slot = Piece._fields.index("slot")
    raw = torch.cat([fields[:, order], torch.zeros_like(fields[:, :1]), fields[:, slot:slot + 1]], dim=1)
    if rel != "src":
        raw[:, 0] -= anchor
    if rel != "dst":
        raw[:, 1] -= anchor
    rows, inner = raw[:, 3], raw[:, 4]
    run = rows.eq(1)
    tile_rows, tile_cols = choose_tile(_shapes(pieces), force_tile)
    # A run longer than COLS becomes full rows of COLS words plus a tail row (a new piece).
    cut = run & inner.gt(tile_cols)
    full, tail = torch.div(inner, tile_cols, rounding_mode="floor"), inner % tile_cols
    tails = raw[cut & tail.gt(0)].clone()
    tails[:, 0] += full[cut & tail.gt(0)] * tile_cols
    tails[:, 1] += full[cut & tail.gt(0)] * tile_cols
    tails[:, 4] = tail[cut & tail.gt(0)]
    raw[:, 3] = torch.where(cut, full, rows)
    for column in (4, 5, 6):
        raw[:, column] = torch.where(cut, torch.full_like(inner, tile_cols), raw[:, column])
    raw = torch.cat([raw, tails])
    col_tiles = _ceil(raw[:, 4], tile_cols)
    raw[:, 7] = col_tiles
    counts = _ceil(raw[:, 3], tile_rows) * col_tiles
    piece_ids = torch.repeat_interleave(torch.arange(raw.shape[0], dtype=torch.int64), counts)
    starts = torch.cumsum(counts, 0) - counts
    local = torch.arange(piece_ids.numel(), dtype=torch.int64) - starts[piece_ids]
    if piece_ids.numel() >= 2**31:
        raise ValueError("a launch of more than 2**31 tiles")
    tiles = torch.stack([piece_ids, local], dim=1).to(torch.int32).contiguous()
    moved = int((raw[:, 3] * raw[:, 4]).sum()) * word
    return Launch(word, vec, tile_rows, tile_cols, raw, tiles, moved)


def _ceil(a: torch.Tensor, b: int) -> torch.Tensor:
    return torch.div(a + (b - 1), b, rounding_mode="floor")
