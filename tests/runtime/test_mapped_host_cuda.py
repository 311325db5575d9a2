"""Pinned host memory the pack kernels address in place (nereus.backends.triton.mapped):
offloaded pieces cross PCIe inside one kernel launch, queued, byte for byte as the
copying path writes them, and the pinned blocks those kernels touch are not handed out
again before the kernels ran. CUDA only: on CPU host and device are one memory."""

from __future__ import annotations

import pytest
import torch

from nereus.backends.triton import default_packer
from nereus.backends.triton.mapped import device_address, mapped
from nereus.runtime import offload, packing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _compile_when_used(monkeypatch):
    """The runtime's packer runs only compiled kernel variants and copies meanwhile
    (jit "prepared"); these tests are about the kernels' path, so they compile at once."""
    monkeypatch.setattr(default_packer(), "jit", "eager")


def _views(base: torch.Tensor, flat: torch.Tensor) -> list:
    return [base[3:20], base[:, 5:40], flat[7:300], base[40:41, 90:], base[50:64], base[:, 70:72]]


def _bits(seed: int, pin: bool = True) -> tuple:
    """Random bf16 / fp32 host tensors from random bits (NaN and inf patterns included):
    compared as integers, so a NaN must come back with its own bits."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(-2**15, 2**15, (64, 96), dtype=torch.int16, generator=g).view(torch.bfloat16)
    flat = torch.randint(-2**31, 2**31 - 1, (1000,), dtype=torch.int32, generator=g).view(torch.float32)
    return (base.pin_memory(), flat.pin_memory()) if pin else (base, flat)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    word = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.cpu().view(word), b.cpu().view(word))


def test_pinned_memory_is_mapped_at_its_own_address_and_pageable_is_not(monkeypatch):
    pinned = torch.empty(4096, dtype=torch.uint8).pin_memory()
    assert device_address(pinned.data_ptr()) == pinned.data_ptr()
    assert device_address(torch.empty(4096, dtype=torch.uint8).data_ptr()) is None
    assert mapped([pinned[100:], torch.empty(3, device="cuda")], torch.device("cuda"))
    assert not mapped([pinned, torch.empty(4096, dtype=torch.uint8)], torch.device("cuda"))
    assert not mapped([pinned], torch.device("cpu"))
    monkeypatch.setenv("NEREUS_MAPPED_HOST", "0")
    assert not mapped([pinned], torch.device("cuda"))


def test_offloaded_pieces_are_packed_and_unpacked_in_place_byte_for_byte():
    views = _views(*_bits(0))
    offsets, total = packing.layout([v.numel() * v.element_size() for v in views])
    want = packing.torch_pack([v.clone() for v in views], offsets, total)  # on the host: the reference
    out = torch.full((total,), 0xA5, dtype=torch.uint8, device="cuda")
    offload.pack(views, offsets, out)
    torch.cuda.synchronize()
    for view, offset in zip(views, offsets):
        n = view.numel() * view.element_size()
        assert torch.equal(out[offset:offset + n].cpu(), want[offset:offset + n])

    base, flat = (torch.zeros(64, 96, dtype=torch.bfloat16).pin_memory(), torch.zeros(1000).pin_memory())
    targets = _views(base, flat)
    torch.cuda._sleep(100_000_000)  # the stream is busy: the unpack is queued behind
    assert offload.unpack(out, targets, offsets) is None  # written by a kernel, not a host job
    torch.cuda.synchronize()
    assert all(_same(got, source) for got, source in zip(targets, views))
    untouched = torch.ones(64, 96, dtype=torch.bool)
    for view in targets[:2] + targets[3:]:
        mask = torch.zeros(64, 96, dtype=torch.bool)
        mask.view(-1)[torch.arange(64 * 96).view(64, 96).as_strided(view.shape, view.stride(),
                                                                         view.storage_offset()).reshape(-1)] = True
        untouched &= ~mask
    assert not base[untouched].view(torch.int16).any()  # nothing outside the views was written


def test_pageable_views_keep_the_copying_path_and_the_same_bytes():
    views = _views(*_bits(1, pin=False))
    offsets, total = packing.layout([v.numel() * v.element_size() for v in views])
    out = torch.empty(total, dtype=torch.uint8, device="cuda")
    offload.pack(views, offsets, out)
    targets = _views(torch.zeros(64, 96, dtype=torch.bfloat16).pin_memory(), torch.zeros(1000).pin_memory())
    pageable = _views(torch.zeros(64, 96, dtype=torch.bfloat16), torch.zeros(1000))
    assert offload.unpack(out, targets, offsets) is None
    job = offload.unpack(out, pageable, offsets)
    assert isinstance(job, offload.HostUnpack)
    job.finish()
    torch.cuda.synchronize()
    assert all(_same(a, b) and _same(a, c) for a, b, c in zip(views, targets, pageable))


def test_strided_copies_between_host_and_device_run_in_place_both_ways():
    source = _views(*_bits(2))
    device = [v.cuda() for v in source]  # contiguous on the device
    into = _views(torch.zeros(64, 96, dtype=torch.bfloat16).pin_memory(), torch.zeros(1000).pin_memory())
    built = default_packer().plans_built
    torch.cuda._sleep(100_000_000)
    packing.copy_pairs(into, device)  # device -> strided pinned host views: queued
    torch.cuda.synchronize()
    assert all(_same(a, b) for a, b in zip(into, source))
    assert default_packer().plans_built > built  # the strided ones went through the kernels
    back = [torch.empty_like(d) for d in device]
    packing.copy_pairs(back, into)  # strided pinned host views -> device
    torch.cuda.synchronize()
    assert all(_same(a, b) for a, b in zip(back, source))


def test_host_plans_are_reused_wherever_the_host_tensors_sit():
    offsets = total = None
    packer = default_packer()
    built = []
    for seed in range(3):
        views = _views(*_bits(10 + seed))
        offsets, total = packing.layout([v.numel() * v.element_size() for v in views])
        out = torch.empty(total, dtype=torch.uint8, device="cuda")
        before = packer.plans_built
        offload.pack(views, offsets, out)
        built.append(packer.plans_built - before)
        torch.cuda.synchronize()
        want = packing.torch_pack([v.clone() for v in views], offsets, total)
        assert torch.equal(out.cpu(), want) or all(
            torch.equal(out[o:o + v.numel() * v.element_size()].cpu(), want[o:o + v.numel() * v.element_size()])
            for v, o in zip(views, offsets))
    assert built[1:] == [0, 0]


@pytest.mark.parametrize("held", [False, True])
def test_a_pinned_block_a_queued_kernel_writes_is_not_handed_out_again(monkeypatch, held):
    """The hazard `mapped.hold` removes: without it, a host shard dropped while its unpack
    kernel waits in the stream comes straight back from torch's pinned-memory cache (the
    `held=False` case shows the cache does that), and the kernel would then write into
    the new tensor."""
    if not held:
        monkeypatch.setattr(offload, "hold", lambda tensors, device: None)  # as imported there
    n = 1 << 20
    buffer = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    warm = torch.empty(n, dtype=torch.uint8).pin_memory()  # a block of this size in the cache
    address = warm.data_ptr()
    del warm
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    assert host.data_ptr() == address  # the cache hands the same block back at once
    strided = host.view(1024, 1024)[:, :512]  # a strided view: the kernels, not the copy engine
    offsets = (0,)
    torch.cuda._sleep(400_000_000)  # the unpack waits in the stream behind this
    assert offload.unpack(buffer, [strided], offsets) is None
    del strided, host
    again = torch.empty(n, dtype=torch.uint8).pin_memory()
    reused = again.data_ptr() == address
    torch.cuda.synchronize()
    assert reused != held
