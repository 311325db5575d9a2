"""The PCIe side of offloaded units on a GPU (nereus.runtime.offload.pack_from_host /
unpack_to_host): every piece lands where the packed layout puts it, byte for byte, for
contiguous, strided and 1-D host views of pinned shards, and nothing else of the host
tensors is written. Runs on CUDA only (on CPU the host and the device are one memory and
these paths are not taken)."""

from __future__ import annotations

import pytest
import torch

from nereus.runtime import offload, packing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _views(base: torch.Tensor, flat: torch.Tensor) -> list:
    return [base[3:20], base[:, 5:40], flat[7:300], base[40:41, 90:], base[50:64]]  # rows, dim-1 slice, 1-D, ...


def _pinned_views(seed: int) -> tuple:
    """(views of pinned random host tensors, their packed offsets, total bytes)."""
    torch.manual_seed(seed)
    views = _views(torch.randn(64, 96, dtype=torch.bfloat16).pin_memory(), torch.randn(1000).pin_memory())
    offsets, total = packing.layout([v.numel() * v.element_size() for v in views])
    return views, offsets, total


def test_pieces_cross_pcie_in_place_both_ways():
    views, offsets, total = _pinned_views(0)
    want = packing.torch_pack([v.clone() for v in views], offsets, total)  # on the host, the reference
    out = torch.full((total,), 0xA5, dtype=torch.uint8, device="cuda")
    offload.pack_from_host(views, offsets, out)
    for view, offset in zip(views, offsets):  # the alignment gaps are never written: pieces only
        n = view.numel() * view.element_size()
        assert torch.equal(out[offset:offset + n].cpu(), want[offset:offset + n])

    into_base = torch.zeros(64, 96, dtype=torch.bfloat16).pin_memory()
    into_flat = torch.zeros(1000).pin_memory()
    targets = _views(into_base, into_flat)
    offload.unpack_to_host(out, targets, offsets)  # waited for: readable on return
    for got, source in zip(targets, views):
        assert torch.equal(got, source)
    untouched = torch.ones(64, 96, dtype=torch.bool)
    for index in ((slice(3, 20),), (slice(None), slice(5, 40)), (slice(40, 41), slice(90, None)), (slice(50, 64),)):
        untouched[index] = False
    assert not into_base[untouched].any()  # nothing outside the views was written


def test_a_host_unpack_waits_for_its_copy_alone_and_queued_crossing_copies_land_by_the_sync(monkeypatch):
    monkeypatch.setenv("NEREUS_MAPPED_HOST", "0")  # the copying path (mapped host: test_mapped_host_cuda.py)
    views, offsets, total = _pinned_views(1)
    buffer = torch.empty(total, dtype=torch.uint8, device="cuda")
    offload.pack_from_host(views, offsets, buffer)
    torch.cuda._sleep(200_000_000)  # the stream is busy for a while before the copy out
    targets = _views(torch.zeros(64, 96, dtype=torch.bfloat16).pin_memory(), torch.zeros(1000).pin_memory())
    job = offload.unpack(buffer, targets, offsets)
    assert isinstance(job, offload.HostUnpack) and not job.ready()  # queued, not waited for
    job.finish()
    assert job.ready() and all(torch.equal(got, want) for got, want in zip(targets, views))
    # device -> pinned host copies of strided pieces are queued; the stream's sync makes them readable
    device = [v.cuda() for v in views]
    into = _views(torch.zeros(64, 96, dtype=torch.bfloat16).pin_memory(), torch.zeros(1000).pin_memory())
    packing.copy_pairs(into, device)
    torch.cuda.current_stream().synchronize()
    assert all(torch.equal(got, want) for got, want in zip(into, views))


def test_a_cuda_runtime_pins_its_offloaded_shards_and_keeps_the_rest_on_the_gpu():
    """The other side of test_offload's CPU rule: for a runtime on a GPU, offloaded shards
    are pinned (the pack kernels read them in place over PCIe)."""
    import nereus.ir as ir
    from nereus.runtime import Runtime

    from runtime_helpers import single_process_control

    single_process_control()
    source = """
cluster one { nodes 1 gpus_per_node 1 gpu { mem 64MB flops 1TFLOPS hbm 100GB/s } intra 10GB/s inter 1GB/s host_mem 1GB }
model actor = llama { layers 1 hidden 32 heads 4 kv_heads 2 ffn 64 vocab 64 }
model ref = actor
workload w { batch 2 prompt 4 response 4 microbatch 1  inference: ref  training: actor }
plan A { ref.inference dp 1 on 0  offload  actor.training dp 1 on 0 }
"""
    rt = Runtime(ir.parse_source(source, "one.nir"), "A", device=torch.device("cuda", 0), ahead="off")
    for ms in ("ref.inference", "actor.training"):
        full = {n: (torch.tensor(3) if n.endswith("#step") else torch.randn(s).to(d))
                for n, (s, d) in rt.tensor_specs(ms).items()}
        rt.register(ms, rt.shard_state_dict(ms, full))
    assert all(t.device.type == "cpu" and t.is_pinned() for t in rt.state("ref.inference").values())
    assert all(t.is_cuda for n, t in rt.state("actor.training").items() if not n.endswith("#step"))
    rt.close()
