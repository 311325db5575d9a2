"""The Triton kernel that moves every tile of a launch (see `tables.py`), and its launcher.

One program moves one tile: ROWS x COLS words of one piece. It reads its (piece, tile)
from the tile table, the piece's row from the segment table, and copies words from the
source box to the destination box. Source and destination are raw byte addresses cast
to pointers (any number of tensors in one launch), or, on the buffer side of a pack or
unpack, byte offsets added to the message's buffer base from `bases` (so a cached table
serves any buffer). All index arithmetic is int64.

Mixed dtypes: the kernel moves *words*, not elements. A bf16 weight box and an fp32
optimizer-state box are both runs of 8-byte words when their addresses, strides and run
lengths are 8-byte aligned (they are for every tensor of the llama table), so a message
that mixes them is still one launch and one buffer. The alternative, one buffer per
dtype, would double the messages per peer (bf16 weights and fp32 optimizer state are
sent together to training units) and make the receiver track several buffers. Pieces
that are less aligned go to a second launch with narrower words; they are still right.

With VEC == 2 every address, row stride and run is a multiple of 16 bytes (checked on
the host), and the kernel says so with `tl.multiple_of`, so loads and stores are
16-byte vectors; with VEC == 1 no alignment is promised.

Set TRITON_INTERPRET=1 before this module is imported to run it on the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .tables import NCOLS, Launch

REL_NONE, REL_DST, REL_SRC = 0, 1, 2  # which side holds buffer offsets (pack: dst, unpack: src)


@triton.jit
def _word_pointer(addr, WORD: tl.constexpr):
    if WORD == 8:
        ptr = addr.to(tl.pointer_type(tl.int64))
    elif WORD == 4:
        ptr = addr.to(tl.pointer_type(tl.int32))
    elif WORD == 2:
        ptr = addr.to(tl.pointer_type(tl.int16))
    else:
        ptr = addr.to(tl.pointer_type(tl.int8))
    return ptr


@triton.jit
def move_tiles_kernel(tiles, table, bases, NC: tl.constexpr, REL: tl.constexpr, WORD: tl.constexpr,
                      VEC: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    piece = tl.load(tiles + 2 * pid).to(tl.int64)
    local = tl.load(tiles + 2 * pid + 1).to(tl.int64)
    entry = table + piece * NC
    src = tl.load(entry + 0)
    dst = tl.load(entry + 1)
    if REL == 1:
        dst += tl.load(bases + tl.load(entry + 2))
    if REL == 2:
        src += tl.load(bases + tl.load(entry + 2))
    rows = tl.load(entry + 3)
    n1 = tl.load(entry + 4)
    inner = tl.load(entry + 5)
    numel = tl.load(entry + 6)
    src_s0 = tl.load(entry + 7)
    src_s1 = tl.load(entry + 8)
    dst_s0 = tl.load(entry + 9)
    dst_s1 = tl.load(entry + 10)
    col_tiles = tl.load(entry + 11)
    row_tile = local // col_tiles
    col_tile = local - row_tile * col_tiles
    r = row_tile * ROWS + tl.arange(0, ROWS).to(tl.int64)
    c = col_tile * COLS + tl.arange(0, COLS).to(tl.int64)
    i0 = r // n1
    i1 = r - i0 * n1
    src_row = i0 * src_s0 + i1 * src_s1
    dst_row = i0 * dst_s0 + i1 * dst_s1
    if VEC > 1:  # the host checked these; the mask must be VEC-constant to vectorise too
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        src_row = tl.multiple_of(src_row, VEC)
        dst_row = tl.multiple_of(dst_row, VEC)
        inner = tl.multiple_of(inner, VEC)
        numel = tl.multiple_of(numel, VEC)
    in_box = (r < rows)[:, None] & (c < inner)[None, :]
    mask = tl.where(in_box, (r[:, None] * inner + c[None, :]) < numel, False)
    src_ptr = _word_pointer(src, WORD) + (src_row[:, None] + c[None, :])
    dst_ptr = _word_pointer(dst, WORD) + (dst_row[:, None] + c[None, :])
    words = tl.load(src_ptr, mask=mask)
    tl.store(dst_ptr, words, mask=mask)


def run_launch(launch: Launch, rel: int, bases: Optional[torch.Tensor]):
    """Input: a Launch whose tables live on the device of the data, `rel` (REL_*), and
    for REL_SRC/REL_DST the int64 tensor of buffer base addresses (16-byte aligned).
    Output: Triton's handle of the compiled kernel (its `.asm` shows the code), or None;
    the launch's pieces are copied asynchronously on the current stream."""
    n_tiles = launch.tiles.shape[0]
    if n_tiles == 0:
        return None
    if bases is None:
        bases = launch.segments  # unused by the kernel when rel == REL_NONE
    return move_tiles_kernel[(n_tiles,)](
        launch.tiles, launch.segments, bases, NC=NCOLS, REL=rel, WORD=launch.word, VEC=launch.vec,
        ROWS=launch.rows, COLS=launch.cols, num_warps=launch.num_warps,
    )
