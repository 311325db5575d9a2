"""The torch fallback: one `copy_` per segment into (or out of) a view of the buffer.

Runs where Triton or a GPU is absent, and is the reference the kernels are tested
against. Each segment's region of the byte buffer is viewed with the segment's dtype and
shape; where the region's offset is not a multiple of the element size (a caller's own
layout may do that), the bytes go through a contiguous temporary instead.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .segments import contiguous_bytes, nbytes


def region(buffer: torch.Tensor, view: torch.Tensor, offset: int) -> torch.Tensor:
    """The bytes of 1-D uint8 `buffer` that hold `view`, as a uint8 tensor."""
    return buffer[offset: offset + nbytes(view)]


def _typed(chunk: torch.Tensor, view: torch.Tensor):
    """`chunk` (uint8) viewed as `view`'s dtype and shape, or None when misaligned."""
    if chunk.data_ptr() % view.element_size():
        return None
    return chunk.view(view.dtype).view(view.shape)


def pack_entries(buffers: Sequence[torch.Tensor], entries: Sequence[tuple[int, torch.Tensor, int]]) -> None:
    """Input: uint8 buffers and (message, view, byte offset) entries. Output: none; each
    view's bytes, row-major, land at its offset of its message's buffer."""
    for msg, view, offset in entries:
        if view.numel() == 0:
            continue
        chunk = region(buffers[msg], view, offset)
        typed = _typed(chunk, view)
        if typed is not None:
            typed.copy_(view)
        else:
            chunk.copy_(contiguous_bytes(view))


def unpack_entries(buffers: Sequence[torch.Tensor], entries: Sequence[tuple[int, torch.Tensor, int]]) -> None:
    """Inverse of `pack_entries`: each view is overwritten with the bytes at its offset."""
    for msg, view, offset in entries:
        if view.numel() == 0:
            continue
        chunk = region(buffers[msg], view, offset)
        typed = _typed(chunk, view)
        if typed is None:
            typed = chunk.clone().view(view.dtype).view(view.shape)
        view.copy_(typed)


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each destination view becomes a copy of its source view."""
    for src, dst in pairs:
        if src.numel():
            dst.copy_(src)
