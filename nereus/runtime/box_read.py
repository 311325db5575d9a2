"""Positioned reads of one box of a row-major array stored raw in a file.

Input: a file descriptor, where the array's bytes start, its shape and element size, a
box (half-open ranges per dim) and a contiguous tensor of the box's shape to fill.
Output: the box's bytes in the tensor; the count of bytes read. Invariant: exactly the
box's bytes are read: one read per contiguous run (the trailing dims the box spans whole,
and the first dim it cuts), so a row range of a matrix is one read, a column range one
read per row. Reads go straight into the tensor's memory (no staging copy).

Hugging Face safetensors files (nereus.runtime.hf_checkpoint) and the RL loop's sharded
checkpoints (nereus.rl.checkpoint_read) store tensors this way.
"""

from __future__ import annotations

import itertools
import os

import torch

from nereus.models.safetensors_header import truncated

MAX_READ = 1 << 30  # bytes per preadv call (Linux caps a single read below 2 GiB)


def pread_into(fd: int, target: memoryview, offset: int, what: str) -> int:
    """Fill `target` from `offset` of `fd` (looping over short reads); its length."""
    done = 0
    while done < len(target):
        n = os.preadv(fd, [target[done:done + MAX_READ]], offset + done)
        if n <= 0:
            raise truncated(what, offset + done)
        done += n
    return done


def read_box(fd: int, start: int, shape: tuple, box: tuple, out: torch.Tensor, what: str) -> int:
    """Read `box` of the array of `shape` (out's dtype) whose bytes begin at `start` into
    the contiguous tensor `out`; returns the bytes read."""
    size = out.element_size()
    if out.numel() == 0:
        return 0
    target = memoryview(out.view(torch.uint8).reshape(-1).numpy())
    if not shape:  # a 0-d tensor
        return pread_into(fd, target, start, what)
    # the trailing dims the box covers whole form contiguous runs with the next one in
    whole = len(shape)
    while whole > 0 and box[whole - 1] == (0, shape[whole - 1]):
        whole -= 1
    cut = max(whole - 1, 0)  # the last dim the box cuts (its range is one run)
    strides = [size] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    lo, hi = box[cut] if shape else (0, 1)
    run = (hi - lo) * strides[cut]
    done = 0
    for index in itertools.product(*(range(a, b) for a, b in box[:cut])):
        offset = start + sum(i * s for i, s in zip(index, strides)) + lo * strides[cut]
        done += pread_into(fd, target[done:done + run], offset, what)
    return done
