"""Same-GPU copies and the torch pack path (nereus.runtime.packing.copy_pairs): strided
pairs are copied as the widest integer type their rows allow, large dense pairs alone
(never in `_foreach_copy_`), and whatever the layout the result is byte for byte that of
one `copy_` per pair: hypothesis draws slices, dtypes and offsets."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nereus.runtime import packing

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8)


def test_a_dim1_slice_copies_as_int64_where_its_rows_align():
    full = torch.arange(4 * 16, dtype=torch.bfloat16).reshape(4, 16)
    shard = torch.empty(4, 8, dtype=torch.bfloat16)
    dst, src = packing.widened(shard, full[:, 8:])
    assert (dst.dtype, src.dtype, tuple(src.shape), src.stride()) == (torch.int64, torch.int64, (4, 2), (4, 1))
    assert packing.widened(shard, full[:, 2:10])[1].dtype == torch.int32  # starts 4 bytes in
    assert packing.widened(shard[:, :6], full[:, 1:7])[1].dtype == torch.bfloat16  # 2 bytes in: as it is
    assert packing.widened(shard, full[:, ::2])[1].dtype == torch.bfloat16  # rows not contiguous
    assert packing.widened(shard.float(), full[:, 8:])[1].dtype == torch.bfloat16  # a cast stays a cast


def test_large_dense_pairs_are_copied_alone_and_small_ones_together(monkeypatch):
    seen = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dsts, srcs: seen.append(len(dsts)) or real(dsts, srcs))
    big = packing.FOREACH_MAX_BYTES // 4
    srcs = [torch.randn(big) for _ in range(packing.FOREACH_MIN_PIECES)] + \
        [torch.randn(8) for _ in range(packing.FOREACH_MIN_PIECES)]
    dsts = [torch.empty_like(s) for s in srcs]
    packing.copy_pairs(dsts, srcs)
    assert seen == [packing.FOREACH_MIN_PIECES]  # the small ones, in one call
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs))


@st.composite
def _pairs(draw):
    pairs = []
    for _ in range(draw(st.integers(1, 20))):
        dtype = draw(st.sampled_from(DTYPES))
        rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 24))
        lead = draw(st.integers(0, 5))  # where the base tensor starts in its storage
        base = (torch.arange(lead + rows * cols * 3, dtype=torch.float64) % 251).to(dtype)[lead:]
        base = base.view(rows, cols * 3)
        start = draw(st.integers(0, 2 * cols))
        width = draw(st.integers(1, cols))
        src = base[:, start:start + width]
        target = torch.zeros(rows + 2, width + draw(st.integers(0, 9)), dtype=dtype)
        col = draw(st.integers(0, target.shape[1] - width))
        region = (slice(1, 1 + rows), slice(col, col + width))
        if draw(st.booleans()):  # into a slice of a larger tensor, whose other elements must stay
            pairs.append((target[region], src, target, region))
        else:
            pairs.append((torch.zeros_like(src), src, None, None))
    return pairs


@settings(max_examples=150, deadline=None)
@given(_pairs())
def test_copy_pairs_equals_one_copy_per_pair(pairs):
    packing.copy_pairs([d for d, _, _, _ in pairs], [s for _, s, _, _ in pairs])
    for dst, src, target, region in pairs:
        assert torch.equal(dst, src)
        if target is not None:
            rest = target.clone()
            rest[region] = 0
            assert not rest.any()  # nothing written outside the destination
