"""Replayed launches (nereus.backends.triton.replay) under the interpreter: boxes of
numbered slots, copied, packed and unpacked byte for byte as torch slicing does, and a
replay built once moving the same boxes of other tensors at other addresses (same
residues) with only a new address table."""

from __future__ import annotations

import random

import pytest
import torch

from nereus.backends.triton import replay
from nereus.backends.triton.segments import layout

DTYPES = (torch.bfloat16, torch.float32, torch.uint8)


def _slot_tensor(rng: random.Random, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous 1-D tensor of `numel` elements that starts 0-3 elements into its
    storage, so its address residue mod 16 varies."""
    skip = rng.randint(0, 3)
    whole = torch.randint(0, 255, ((numel + skip) * dtype.itemsize,), dtype=torch.uint8).view(dtype)
    return whole[skip:]


def _random_box(rng: random.Random, numel: int, dtype: torch.dtype):
    """(shape, stride, offset) of a strided box inside `numel` elements: a 2-D or 3-D
    array laid out row-major, sliced in its last dim (strided rows) or not."""
    rows, cols = rng.randint(1, 6), rng.randint(1, 24)
    keep = rng.randint(1, cols)
    start = rng.randint(0, cols - keep)
    base = rng.randint(0, 3) * cols
    if rng.random() < 0.3:  # a 3-D box: rows of parts
        parts = rng.randint(1, 3)
        shape, stride = (rows, parts, keep), (parts * cols, cols, 1)
    else:
        shape, stride = (rows, keep), (cols, 1)
    extent = base + start + sum((n - 1) * s for n, s in zip(shape, stride)) + 1
    return shape, stride, base + start, extent


def _view(tensor: torch.Tensor, shape, stride, offset) -> torch.Tensor:
    return tensor.as_strided(shape, stride, tensor.storage_offset() + offset)


def _copy_case(rng: random.Random, n: int):
    """n copy pairs between fresh slot tensors: (pairs of Box, tensors)."""
    pairs, tensors = [], []
    for i in range(n):
        dtype = rng.choice(DTYPES)
        shape, s_stride, s_off, s_end = _random_box(rng, 0, dtype)
        # the destination: the same shape, laid out in rows of another width
        cols = shape[-1] + rng.randint(0, 8)
        d_stride = tuple(list(s_stride[:-2]) + [cols, 1]) if len(shape) == 2 else (shape[1] * cols, cols, 1)
        d_off = rng.randint(0, 5)
        d_end = d_off + sum((m - 1) * s for m, s in zip(shape, d_stride)) + 1
        src, dst = _slot_tensor(rng, s_end, dtype), _slot_tensor(rng, d_end, dtype)
        tensors += [src, dst]
        pairs.append((replay.Box(2 * i, shape, s_stride, s_off, dtype.itemsize),
                      replay.Box(2 * i + 1, shape, d_stride, d_off, dtype.itemsize)))
    return pairs, tensors


def _addresses(tensors):
    return [t.data_ptr() for t in tensors]


def _same_residues(rng: random.Random, tensors: list) -> list:
    """Fresh tensors with the contents of `tensors` re-randomized, each at an address
    with the same residue mod 16 (another allocation, the same skip)."""
    out = []
    for t in tensors:
        skip = t.data_ptr() % 16
        raw = torch.randint(0, 255, (t.numel() * t.element_size() + 32,), dtype=torch.uint8)
        start = (skip - raw.data_ptr() % 16) % 16
        out.append(raw[start: start + t.numel() * t.element_size()].view(t.dtype))
    assert [a % 16 for a in _addresses(out)] == [a % 16 for a in _addresses(tensors)]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_a_copy_replay_moves_every_box_and_replays_on_other_tensors(seed):
    rng = random.Random(seed)
    pairs, tensors = _copy_case(rng, rng.randint(1, 4))
    residues = replay.residues(_addresses(tensors))
    built = replay.Replay("copy", replay.copy_pieces(pairs, residues), torch.device("cpu"))
    for attempt in range(2):  # built once, run on the first tensors, then on others
        if attempt:
            tensors = _same_residues(rng, tensors)
        before = [t.clone() for t in tensors]
        expect = [t.clone() for t in tensors]
        for src, dst in pairs:
            _view(expect[dst.slot], dst.shape, dst.stride, dst.offset).copy_(
                _view(before[src.slot], src.shape, src.stride, src.offset))
        built.run(replay.table(_addresses(tensors), torch.device("cpu")))
        for got, want in zip(tensors, expect):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("seed", range(4))
def test_pack_then_unpack_replays_move_boxes_through_a_buffer(seed):
    rng = random.Random(100 + seed)
    n = rng.randint(1, 4)
    boxes, tensors = [], []
    for i in range(n):
        dtype = rng.choice(DTYPES)
        shape, stride, offset, extent = _random_box(rng, 0, dtype)
        tensors.append(_slot_tensor(rng, extent, dtype))
        boxes.append(replay.Box(1 + i, shape, stride, offset, dtype.itemsize))  # slot 0: the buffer
    views = [_view(t, b.shape, b.stride, b.offset) for t, b in zip(tensors, boxes)]
    offsets, total = layout(views)
    buffer = torch.zeros(total, dtype=torch.uint8)
    entries = [(b, 0, o) for b, o in zip(boxes, offsets)]
    slots = [buffer] + tensors
    residues = replay.residues(_addresses(slots))
    pack = replay.Replay("pack", replay.message_pieces("pack", entries, residues), torch.device("cpu"))
    pack.run(replay.table(_addresses(slots), torch.device("cpu")))
    for view, offset in zip(views, offsets):
        size = view.numel() * view.element_size()
        assert torch.equal(buffer[offset: offset + size], view.contiguous().reshape(-1).view(torch.uint8))
    # unpack into other tensors at other addresses with the same residues
    others = _same_residues(rng, tensors)
    slots = [buffer] + others
    assert replay.residues(_addresses(slots)) == residues
    untouched = [t.clone() for t in others]
    unpack = replay.Replay("unpack", replay.message_pieces("unpack", entries, residues), torch.device("cpu"))
    unpack.run(replay.table(_addresses(slots), torch.device("cpu")))
    for t, keep, b, view in zip(others, untouched, boxes, views):
        want = keep.clone()
        _view(want, b.shape, b.stride, b.offset).copy_(view)
        assert torch.equal(t.view(torch.uint8), want.view(torch.uint8))


def test_a_copy_between_boxes_of_different_shapes_is_refused():
    a = replay.Box(0, (2, 3), (3, 1), 0, 2)
    b = replay.Box(1, (3, 2), (2, 1), 0, 2)
    with pytest.raises(ValueError, match=r"copy between boxes \[2, 3\] x2 and \[3, 2\] x2"):
        replay.copy_pieces([(a, b)], (0, 0))
