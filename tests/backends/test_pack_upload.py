"""Pack tables reach the GPU without stalling the host (nereus.backends.triton.tables.upload).

A plan is built whenever a call's views sit at new addresses (every transition allocates
new shards). Its tables used to be copied from pageable memory, which makes the host
wait for the stream to drain first: in a transition, for the chunks already queued
ahead of it. Runs on CUDA only (the CPU path has no uploads)."""

from __future__ import annotations

import time

import pytest
import torch

from nereus.backends.triton import Packer, layout
from nereus.backends.triton.tables import upload

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_host_table_stays_put_off_cuda():
    table = torch.arange(6, dtype=torch.int64)
    assert upload(table, torch.device("cpu")) is table


@cuda
def test_a_new_plan_does_not_wait_for_work_queued_on_the_stream():
    device = torch.device("cuda")
    packer = Packer("triton")
    views = lambda base: [base[i, : 96] for i in range(0, 64, 2)]  # noqa: E731 - 32 strided rows
    first = torch.randn(64, 128, device=device)
    offsets, total = layout(views(first))
    packer.pack_into(views(first), offsets, total)  # compiles the kernel variant
    torch.cuda.synchronize()
    second = torch.randn(64, 128, device=device) + 1  # other addresses: a new plan
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of device time queued ahead
    started = time.perf_counter()
    buffer = packer.pack_into(views(second), offsets, total)
    host_s = time.perf_counter() - started
    torch.cuda.synchronize()
    assert host_s < 0.2, f"building the plan waited {host_s:.3f} s for the stream"
    want = torch.cat([v.reshape(-1) for v in views(second)]).view(torch.uint8)
    got = torch.cat([buffer[o:o + v.numel() * 4] for o, v in zip(offsets, views(second))])
    assert torch.equal(got, want)
