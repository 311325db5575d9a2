"""A call that compiles the kernel variants it lacks (backends/triton/variants._inline) on
a CUDA device runs them on a stream of its own: it does not wait for the work queued on
the caller's stream, and the result is exact once that work is done. CUDA only."""

from __future__ import annotations

import time

import pytest
import torch

from nereus.runtime import packing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_compiling_in_the_call_does_not_wait_for_the_callers_stream():
    from nereus.backends.triton.packer import Packer

    device = torch.device("cuda", torch.cuda.current_device())
    state = torch.arange(96 * 40, dtype=torch.float32, device=device).view(96, 40)
    views = [state[:, 4:36], state[5:6]]
    offsets, _ = packing.layout([v.numel() * v.element_size() for v in views])
    total = offsets[-1] + views[-1].numel() * views[-1].element_size()
    Packer(backend="triton").pack_into(views, offsets, total)  # Triton's own JIT has them from now on
    torch.cuda.synchronize(device)
    packer = Packer(backend="triton")
    packer.jit = "prepared"
    packer.compile_log = [(("pack", 1, 1, 1, 1), 0.001)]  # quick compiles so far
    classes = packer.launch_classes([("pack", views, offsets)])
    torch.cuda._sleep(2_000_000_000)  # about a second of work queued on the current stream
    start = time.perf_counter()
    ready = packer.ready(classes, device, start=False)
    host_s = time.perf_counter() - start
    assert ready and packer.inline_compiles == len(classes) and packer.fallback_calls == 0
    assert host_s < 0.4, host_s
    torch.cuda.synchronize(device)
    out = packer.pack_into(views, offsets, total)  # launches the variants compiled above
    assert packer.fallback_calls == 0 and [p.backend for p in packer._plans.values()] == ["triton"]
    expected = packing.torch_pack(views, offsets, total)
    for v, o in zip(views, offsets):
        n = v.numel() * v.element_size()
        assert torch.equal(out[o:o + n], expected[o:o + n])
