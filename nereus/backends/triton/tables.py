"""Segment and tile tables: the device-side description one kernel launch runs from.

Pieces (see `segments.py`) are grouped by their access class (word size, 16-byte
vectors or not); each class is one launch. For a class, a tile shape ROWS x COLS (words)
is chosen to minimise the lanes launched plus a per-tile overhead, and every piece is
cut into tiles. Contiguous runs are re-cut as rows of COLS words, so a 64 MiB run and a
4 KiB run both fill whole tiles.

Tables are int64 (addresses and strides of tensors past 2**31 elements are exact) and
built on the host with vectorised torch ops, then copied to the device once and cached
by the caller.

Segment table, one row of NCOLS int64 per piece:
    0 src   1 dst   2 msg   3 rows   4 n1   5 inner   6 numel
    7 src_s0   8 src_s1   9 dst_s0   10 dst_s1   11 col_tiles
Tile table, one row of two int32 per program: (piece index, tile index in the piece).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .segments import Piece

NCOLS = 12
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
        return Launch(self.word, self.vec, self.rows, self.cols, self.segments.to(device),
                      self.tiles.to(device), self.moved_bytes)


def choose_tile(rows: torch.Tensor, inner: torch.Tensor, run: torch.Tensor,
                force: Optional[tuple[int, int]] = None) -> tuple[int, int]:
    """Input: per-piece outer rows, inner run length (words), and whether it is one
    contiguous run. Output: (ROWS, COLS), powers of two, minimising
    sum(tiles * (ROWS*COLS + TILE_OVERHEAD + ROWS*ROW_OVERHEAD)), which prefers few
    wide tiles that waste few lanes. `force` bypasses the search."""
    if force is not None:
        return force
    best: Optional[tuple[int, tuple[int, int]]] = None
    numel = rows * inner
    for block in BLOCK_CHOICES:
        for cols in COLS_CHOICES:
            if cols > block:
                continue
            nrows = block // cols
            tiles = torch.where(run, _ceil(_ceil(numel, cols), nrows), _ceil(rows, nrows) * _ceil(inner, cols))
            cost = int(tiles.sum()) * (block + TILE_OVERHEAD + nrows * ROW_OVERHEAD)
            if best is None or cost < best[0]:
                best = (cost, (nrows, cols))
    assert best is not None
    return best[1]


def build_launches(pieces: Sequence[Piece], force_tile: Optional[tuple[int, int]] = None,
                   max_vec: int = 2) -> list[Launch]:
    """Input: pieces (any order, any classes). Output: one Launch per (word, vec) class.

    Invariant: the tiles of a launch cover every word of every piece of its class exactly
    once (masked lanes excepted), so the launches together move exactly the pieces' bytes.
    `max_vec=1` turns off the 16-byte alignment hints (for measuring what they give)."""
    classes: dict[tuple[int, int], list[Piece]] = {}
    for p in pieces:
        classes.setdefault((p.word, min(p.vec, max_vec)), []).append(p)
    return [_launch(word, vec, group, force_tile) for (word, vec), group in sorted(classes.items(), reverse=True)]


def _launch(word: int, vec: int, pieces: list[Piece], force_tile: Optional[tuple[int, int]]) -> Launch:
    raw = torch.tensor([[p.src, p.dst, p.msg, p.n0 * p.n1, p.n1, p.inner, p.n0 * p.n1 * p.inner,
                         p.src_s0, p.src_s1, p.dst_s0, p.dst_s1, 0] for p in pieces], dtype=torch.int64)
    rows, inner, numel = raw[:, 3], raw[:, 5], raw[:, 6]
    run = raw[:, 4].eq(1) & rows.eq(1)
    tile_rows, tile_cols = choose_tile(rows, inner, run, force_tile)
    # A contiguous run becomes ceil(n / COLS) rows of COLS words (the last row masked by numel).
    cut = run & inner.gt(tile_cols)
    raw[:, 3] = torch.where(cut, _ceil(numel, tile_cols), rows)
    raw[:, 5] = torch.where(cut, torch.full_like(inner, tile_cols), inner)
    raw[:, 7] = torch.where(cut, torch.full_like(inner, tile_cols), raw[:, 7])
    raw[:, 9] = torch.where(cut, torch.full_like(inner, tile_cols), raw[:, 9])
    col_tiles = _ceil(raw[:, 5], tile_cols)
    raw[:, 11] = col_tiles
    counts = _ceil(raw[:, 3], tile_rows) * col_tiles
    piece_ids = torch.repeat_interleave(torch.arange(len(pieces), dtype=torch.int64), counts)
    starts = torch.cumsum(counts, 0) - counts
    local = torch.arange(piece_ids.numel(), dtype=torch.int64) - starts[piece_ids]
    if piece_ids.numel() and (int(local.max()) >= 2**31 or len(pieces) >= 2**31):
        raise ValueError("a launch of more than 2**31 tiles")
    tiles = torch.stack([piece_ids, local], dim=1).to(torch.int32).contiguous()
    moved = int(numel.sum()) * word
    return Launch(word, vec, tile_rows, tile_cols, raw, tiles, moved)


def _ceil(a: torch.Tensor, b: int) -> torch.Tensor:
    return torch.div(a + (b - 1), b, rounding_mode="floor")
