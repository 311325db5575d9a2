"""The Triton kernel that moves every tile of a launch (see `tables.py`), and its launcher.

One program moves one tile: up to ROWS rows x COLS words of one piece. It reads its
(piece, tile) from the tile table, the piece's row from the segment table, and copies
words from the source rows to the destination rows. Addresses are word offsets from the
`anchor` pointer (any number of tensors in one launch; copies), or, in a pack or unpack,
offsets into the message's buffer on the buffer side, whose own offset from the anchor
(bytes) comes from `bases`, and offsets from the view's base on the tensor side, whose
offset from the anchor comes from `views` (so a cached table serves any buffer and any
tensors of the same shapes, strides and 16-byte residues). All index arithmetic is int64
except the per-program tile split; no division happens per element or per row.

Mixed dtypes: the kernel moves *words*, not elements. A bf16 weight box and an fp32
optimizer-state box are both runs of 8-byte words when their addresses, strides and run
lengths are 16-byte aligned (they are for every tensor of the llama table), so a message
that mixes them is still one launch and one buffer. The alternative, one buffer per
dtype, would double the messages per peer (bf16 weights and fp32 optimizer state are
sent together to training units) and make the receiver track several buffers. Pieces
that are less aligned go to a second launch with narrower words; they are still right.

With VEC == 2 every address, row stride and run is a multiple of 16 bytes (checked on
the host), and the kernel says so with `tl.multiple_of`, so loads and stores are
16-byte vectors; with VEC == 1 no alignment is promised. On the H200 this did not
matter (8B loopback 7.76 ms with the hints, 7.65 ms without; benchmarks/RESULTS.md):
what did was keeping divisions off the per-row path (17.8 ms before).

Set TRITON_INTERPRET=1 before this module is imported to run it on the CPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Optional

import torch
import triton
import triton.language as tl

from .tables import NCOLS, Launch

REL_NONE, REL_DST, REL_SRC = 0, 1, 2  # which side holds buffer offsets (pack: dst, unpack: src)
# Triton's interpreter keeps the launch in progress (its grid, its builder) in module
# state: two threads launching at once (the prepared JIT's background compile beside a
# transition) break each other's launch. On a GPU launches are thread-safe; under the
# interpreter they take turns.
_LAUNCH_TURNS = threading.Lock() if os.environ.get("TRITON_INTERPRET") == "1" else contextlib.nullcontext()
WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
_ANCHORS: dict[torch.device, torch.Tensor] = {}


def anchor(device: torch.device) -> torch.Tensor:
    """The device's anchor: 16 bytes, 16-byte aligned, alive for the process. ("cuda"
    and "cuda:0" must give the same anchor: tables are built against its address.)"""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    found = _ANCHORS.get(device)
    if found is None:
        block = torch.empty(32, dtype=torch.uint8, device=device)
        skip = -block.data_ptr() % 16
        # setdefault: two threads making the first anchor at once (the background compile,
        # the lowering-ahead thread, a transition) get the same one, or one of them would
        # address its pieces from an anchor that the other replaced
        found = _ANCHORS.setdefault(device, block[skip: skip + 16])
    return found


@triton.jit
def move_tiles_kernel(tiles, table, bases, views, anchor, NC: tl.constexpr, REL: tl.constexpr,
                      WORD: tl.constexpr, VEC: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    piece = tl.load(tiles + 2 * pid).to(tl.int64)
    local = tl.load(tiles + 2 * pid + 1)
    entry = table + piece * NC
    src = tl.load(entry + 0)
    dst = tl.load(entry + 1)
    if REL == 1:
        dst += tl.load(bases + tl.load(entry + 2)) // WORD
        src += tl.load(views + tl.load(entry + 8)) // WORD
    if REL == 2:
        src += tl.load(bases + tl.load(entry + 2)) // WORD
        dst += tl.load(views + tl.load(entry + 8)) // WORD
    rows = tl.load(entry + 3)
    inner = tl.load(entry + 4)
    src_s = tl.load(entry + 5)
    dst_s = tl.load(entry + 6)
    col_tiles = tl.load(entry + 7).to(tl.int32)
    row_tile = local // col_tiles
    col_tile = local - row_tile * col_tiles
    r = row_tile.to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    c = col_tile.to(tl.int64) * COLS + tl.arange(0, COLS).to(tl.int64)
    src_row = src + r * src_s
    dst_row = dst + r * dst_s
    if VEC > 1:  # checked on the host; the mask must be VEC-constant to vectorise too
        src_row = tl.multiple_of(src_row, VEC)
        dst_row = tl.multiple_of(dst_row, VEC)
        inner = tl.multiple_of(inner, VEC)
    mask = (r < rows)[:, None] & (c < inner)[None, :]
    words = tl.load(anchor + (src_row[:, None] + c[None, :]), mask=mask)
    tl.store(anchor + (dst_row[:, None] + c[None, :]), words, mask=mask)


def run_launch(launch: Launch, rel: int, bases: Optional[torch.Tensor], views: Optional[torch.Tensor] = None):
    """Input: a Launch whose tables live on the device of the data, `rel` (REL_*); for
    REL_NONE tables built against `anchor(device)`; for REL_SRC/REL_DST tables whose
    tensor side is relative to view slots (`view_pieces(..., slot=k)`, anchor 0), the
    int64 tensor of each buffer's byte offset from the anchor (`bases`) and of each view
    base's (`views`), all multiples of 16.
    Output: Triton's handle of the compiled kernel (its `.asm` shows the code), or None;
    the launch's pieces are copied asynchronously on the current stream."""
    n_tiles = launch.tiles.shape[0]
    if n_tiles == 0:
        return None
    if rel != REL_NONE and (bases is None or views is None):
        raise ValueError("a pack or unpack launch needs the buffers' and the views' bases")
    bases = launch.segments if bases is None else bases  # unused by the kernel when rel == REL_NONE
    views = launch.segments if views is None else views
    word_anchor = anchor(launch.segments.device).view(WORD_DTYPES[launch.word])
    with _LAUNCH_TURNS:
        return move_tiles_kernel[(n_tiles,)](
            launch.tiles, launch.segments, bases, views, word_anchor, NC=NCOLS, REL=rel, WORD=launch.word,
            VEC=launch.vec, ROWS=launch.rows, COLS=launch.cols, num_warps=launch.num_warps,
        )
