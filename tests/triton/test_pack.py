"""Pack/unpack/copy: Triton kernels (interpreter) == torch fallback == slicing reference,
byte for byte, on random segment tables.

The interpreter costs about 10 ms per program instance on this machine, so segments are
small and tiles are chosen by the packer (one or two per segment)."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from nereus.backends.triton import Packer, SegmentView, layout
from nereus.backends.triton import packer as packer_module

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
POISON = 0xA5


def random_tensor(rng: random.Random, dtype: torch.dtype) -> torch.Tensor:
    """A random tensor of rank 1-3, often non-contiguous (permuted, stepped or offset)."""
    ndim = rng.randint(1, 3)
    shape = [rng.randint(1, 20) for _ in range(ndim)]
    t = torch.randn(shape, generator=torch.Generator().manual_seed(rng.randrange(2**31))).to(dtype)
    if ndim > 1 and rng.random() < 0.4:
        perm = list(range(ndim))
        rng.shuffle(perm)
        t = t.permute(perm)
    if rng.random() < 0.3:
        index = [slice(None)] * ndim
        index[rng.randrange(ndim)] = slice(rng.randint(0, 1), None, 2)
        t = t[tuple(index)]
    return t


def random_box(rng: random.Random, t: torch.Tensor, empty: bool = False) -> SegmentView:
    starts, sizes = [], []
    for n in t.shape:
        start = rng.randint(0, n - 1) if n else 0
        starts.append(start)
        sizes.append(rng.randint(1, n - start) if n - start else 0)
    if empty:
        sizes[rng.randrange(len(sizes))] = 0
    return SegmentView(t, tuple(starts), tuple(sizes))


def random_segments(rng: random.Random, count: int, dtypes=DTYPES, distinct: bool = False) -> list[SegmentView]:
    """`count` boxes of a few random tensors (each box its own tensor when `distinct`,
    so that unpacking into them is order-independent); about one in eight is empty."""
    pool = [random_tensor(rng, rng.choice(dtypes)) for _ in range(max(1, count // 3))]
    segments = []
    for _ in range(count):
        t = random_tensor(rng, rng.choice(dtypes)) if distinct else rng.choice(pool)
        segments.append(random_box(rng, t, empty=rng.random() < 0.125))
    return segments


def slicing_reference(segments) -> torch.Tensor:
    """The packed message built from plain slicing: each box's bytes at its layout offset."""
    views = [s.view() for s in segments]
    offsets, total = layout(views)
    out = torch.full((total,), POISON, dtype=torch.uint8)
    for view, offset in zip(views, offsets):
        data = flat_bytes(view)
        out[offset: offset + data.numel()] = data
    return out


def poisoned(total: int) -> torch.Tensor:
    return torch.full((total,), POISON, dtype=torch.uint8)


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """Row-major bytes of any view (a fresh dense copy first: `contiguous()` keeps odd
    strides on empty and size-1 dims, which `view(uint8)` rejects)."""
    dense = torch.empty(t.shape, dtype=t.dtype)
    dense.copy_(t)
    return dense.reshape(-1).view(torch.uint8)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """All bytes of a tensor's storage region (so writes outside the boxes show too)."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).view(torch.uint8).clone()


@pytest.mark.parametrize("seed", range(4))
def test_pack_triton_matches_fallback_and_slicing(seed):
    rng = random.Random(seed)
    segments = random_segments(rng, 12)
    total = layout([s.view() for s in segments])[1]
    fused = Packer("triton").pack(segments, out=poisoned(total))
    plain = Packer("torch").pack(segments, out=poisoned(total))
    assert torch.equal(plain, slicing_reference(segments))
    assert torch.equal(fused, plain)


@pytest.mark.parametrize("seed", range(3))
def test_unpack_triton_matches_fallback(seed):
    rng = random.Random(100 + seed)
    segments = random_segments(rng, 10, distinct=True)
    total = layout([s.view() for s in segments])[1]
    buffer = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    results = []
    for backend in ("triton", "torch"):
        copies = [SegmentView(s.tensor.clone().fill_(7.0), s.starts, s.sizes) for s in segments]
        Packer(backend).unpack(buffer, copies)
        results.append([as_bytes(c.tensor) for c in copies])
    for fused, plain in zip(*results):
        assert torch.equal(fused, plain)
    # and unpack really is the inverse of pack: repacking gives the buffer back
    repacked = Packer("torch").pack([SegmentView(c.tensor, s.starts, s.sizes) for c, s in zip(copies, segments)],
                                    out=poisoned(total))
    for view, offset in zip(*[[s.view() for s in segments], layout([s.view() for s in segments])[0]]):
        n = view.numel() * view.element_size()
        assert torch.equal(repacked[offset: offset + n], buffer[offset: offset + n])


def test_mixed_dtypes_and_unaligned_offsets_in_one_message():
    """bf16 weights and fp32 optimizer state in one buffer; offsets only 2-byte aligned
    (the executor's contract allows any), which forces narrow-word launches."""
    rng = random.Random(7)
    views = [s.view() for s in random_segments(rng, 9)]
    views += [torch.randn(6, 10).to(torch.bfloat16)[1:4, 3:8], torch.randn(33)[1:30]]
    offsets, at = [], 2
    for v in views:
        offsets.append(at)
        at += v.numel() * v.element_size() + 2
    fused = Packer("triton").pack_into(views, offsets, at, poisoned(at))
    plain = Packer("torch").pack_into(views, offsets, at, poisoned(at))
    assert torch.equal(fused, plain)
    targets = [[torch.zeros_like(v) for v in views] for _ in range(2)]
    Packer("triton").unpack_from(fused, targets[0], offsets)
    Packer("torch").unpack_from(fused, targets[1], offsets)
    for a, b, v in zip(*targets, views):
        assert torch.equal(flat_bytes(a), flat_bytes(b))
        assert torch.equal(flat_bytes(a), flat_bytes(v))


def test_copy_pairs_box_to_box():
    """Local copies from random boxes into boxes of transposed-storage destinations."""
    rng = random.Random(11)
    pairs, dsts, expected = [], [], []
    for _ in range(8):
        src = random_box(rng, random_tensor(rng, rng.choice(DTYPES)), empty=rng.random() < 0.2)
        shape = list(src.view().shape)
        padded = [n + 3 for n in reversed(shape)]
        dst = torch.full(padded, 9.0, dtype=src.tensor.dtype).permute(*reversed(range(len(shape))))
        want = dst.clone()
        want[tuple(slice(1, 1 + n) for n in shape)] = src.view()
        pairs.append((src, SegmentView(dst, tuple([1] * len(shape)), tuple(shape))))
        dsts.append(dst)
        expected.append(want)
    Packer("triton").copy(pairs)
    for d, e in zip(dsts, expected):
        assert torch.equal(flat_bytes(d), flat_bytes(e))


def test_pack_many_one_launch_per_class_matches_single_packs():
    rng = random.Random(21)
    messages = [random_segments(rng, 4, dtypes=(torch.bfloat16, torch.float32)) for _ in range(3)]
    fused = Packer("triton").pack_many(messages)
    for msg, buf in zip(messages, fused):
        plain = Packer("torch").pack(msg)
        assert buf.numel() == plain.numel()
        for view, offset in zip(*[[s.view() for s in msg], layout([s.view() for s in msg])[0]]):
            n = view.numel() * view.element_size()  # padding between segments is unspecified
            assert torch.equal(buf[offset: offset + n], plain[offset: offset + n])
    targets = [[SegmentView(s.tensor.clone().zero_(), s.starts, s.sizes) for s in msg] for msg in messages]
    Packer("triton").unpack_many(fused, targets)
    for msg, tmsg in zip(messages, targets):
        for s, t in zip(msg, tmsg):
            assert torch.equal(flat_bytes(t.view()), flat_bytes(s.view()))


def test_long_runs_and_many_tiles_per_piece():
    """Runs re-cut into rows of COLS words, the last row partial; strided rows split
    across column tiles (forced small tile)."""
    a = torch.randn(3001)
    b = torch.randn(40, 70).to(torch.float16)
    segments = [a[1:3000], SegmentView(b, (3, 5), (30, 61)), a[7:8]]
    total = layout([s if isinstance(s, torch.Tensor) else s.view() for s in segments])[1]
    fused = Packer("triton", tile=(8, 64)).pack(segments, out=poisoned(total))
    plain = Packer("torch").pack(segments, out=poisoned(total))
    assert torch.equal(fused, plain)


def test_cached_plan_is_reused_and_sees_new_values():
    w = torch.randn(16, 32).to(torch.bfloat16)
    segments = [SegmentView(w, (0, 8), (16, 8)), SegmentView(w, (4, 0), (4, 32))]
    packer = Packer("triton")
    first = packer.pack(segments, key=("sync", 0)).clone()
    w.mul_(2)
    second = packer.pack(segments, key=("sync", 0))
    assert packer.plans_built == 1
    assert torch.equal(second, Packer("torch").pack(segments))
    assert not torch.equal(first, second)
    packer.pack(segments[:1], key=("sync", 0))  # a different message under the same key
    assert packer.plans_built == 2
    packer.pack(segments, key=7)  # any hashable key
    packer.pack(segments, key=7)
    assert packer.plans_built == 3


def test_backend_choice_env_and_logging(monkeypatch, caplog):
    monkeypatch.setattr(packer_module, "_LOGGED", set())
    monkeypatch.setenv("NEREUS_PACK_BACKEND", "torch")
    assert Packer().requested == "torch"
    monkeypatch.delenv("NEREUS_PACK_BACKEND")
    with caplog.at_level(logging.INFO, logger="nereus.pack"):
        auto = Packer()
        assert auto.backend_for(torch.device("cpu")) == "torch"
        assert auto.backend_for(torch.device("cpu")) == "torch"
    assert len([r for r in caplog.records if r.name == "nereus.pack"]) == 1
    with pytest.raises(ValueError, match="choose one of"):
        Packer("cuda")


def test_segment_forms_are_equivalent():
    t = torch.randn(5, 6, 7)
    forms = [t[1:4, 2:6, 3:4], (t, (slice(1, 4), slice(2, 6), slice(3, 4))), SegmentView(t, (1, 2, 3), (3, 4, 1))]
    packed = [Packer("torch").pack([f]) for f in forms]
    assert all(torch.equal(p, packed[0]) for p in packed)
    with pytest.raises(ValueError, match="step 1"):
        Packer("torch").pack([(t, (slice(0, 4, 2),))])
    with pytest.raises(ValueError, match="outside dim"):
        SegmentView(t, (4, 0, 0), (2, 6, 7)).view()


def test_keyless_plans_are_reused_wherever_the_tensors_sit():
    """The executor passes no key, and its shards are new tensors on every transition: a
    plan depends on the views' shapes, strides, dtypes and addresses mod 16, not on the
    addresses, so views of fresh tensors reuse it and still read and write where they
    are now. A view at another residue gets a plan of its own; torch-fallback plans (which
    would keep tensors alive) are never cached."""
    def views_of(w):
        return [w[:, :32], w[2:5]]

    torch_path = Packer("torch")
    w1 = torch.randn(8, 64)
    offsets, total = layout(views_of(w1))
    fused = Packer("triton")
    first = fused.pack_into(views_of(w1), offsets, total).clone()
    w2 = torch.randn(8, 64)  # another allocation, other values
    second = fused.pack_into(views_of(w2), offsets, total)
    assert fused.plans_built == 1
    assert torch.equal(first, torch_path.pack_into(views_of(w1), offsets, total))
    assert torch.equal(second, torch_path.pack_into(views_of(w2), offsets, total))
    d1, d2 = torch.zeros(8, 64), torch.zeros(8, 64)
    fused.unpack_from(first, views_of(d1), offsets)
    fused.unpack_from(second, views_of(d2), offsets)  # the unpack plan of d1, into d2
    assert fused.plans_built == 2
    for got, want in ((d1, w1), (d2, w2)):
        assert torch.equal(got[:, :32], want[:, :32]) and torch.equal(got[2:5], want[2:5])
        assert not got[5:, 32:].any()  # nothing written outside the views
    shifted = torch.randn(8 * 64 + 1)[1:].view(8, 64)  # 4 bytes past a 16-byte boundary
    assert shifted.data_ptr() % 16 != w1.data_ptr() % 16
    moved = fused.pack_into(views_of(shifted), offsets, total)
    assert fused.plans_built == 3
    assert torch.equal(moved, torch_path.pack_into(views_of(shifted), offsets, total))
    plain = Packer("torch")
    plain.pack_into(views_of(w1), offsets, total)
    plain.pack_into(views_of(w1), offsets, total)
    assert plain.plans_built == 2


def test_keyless_copies_are_cached_by_exact_addresses():
    """Copy plans hold both sides' addresses: other tensors rebuild (and copy right)."""
    a, b = torch.randn(4, 16), torch.zeros(4, 16)
    fused = Packer("triton")
    fused.copy([(a[:, :8], b[:, 8:])])
    fused.copy([(a[:, :8], b[:, 8:])])
    assert fused.plans_built == 1 and torch.equal(b[:, 8:], a[:, :8])
    c, d = torch.randn(4, 16), torch.zeros(4, 16)
    fused.copy([(c[:, :8], d[:, 8:])])
    assert fused.plans_built == 2 and torch.equal(d[:, 8:], c[:, :8]) and torch.equal(b[:, 8:], a[:, :8])
