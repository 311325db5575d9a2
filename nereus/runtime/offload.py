"""Offloaded model-stages: where their shards live and how bytes reach them.

A plan that flags a model-stage `offload` keeps its state in host memory outside its own
stage (the memory model of nereus.passes.feasibility, the DAG's host frees and allocs,
the cost model's PCIe terms and the verifier's replay all assume so). The runtime
follows that: at a step boundary, i.e. after `register` and after every transition, the
shards of an offloaded model-stage are host tensors, pinned where CUDA exists so that
copies to and from the GPU run at PCIe speed, and they count nothing against the GPU.

In a transition (JSON program: `units.before/after[*].offload`), on CUDA, where the host
shards are pinned memory the GPU maps (always, for shards this runtime made: the fused
pack kernels then address them in place, `nereus.backends.triton.mapped`):
  - a send from an offloaded before-unit packs its pieces straight from host memory into
    the device buffer NCCL sends, one kernel launch reading over PCIe;
  - a message into an offloaded after-unit arrives in a device buffer and is unpacked
    straight into host memory, one launch writing over PCIe; a large piece arrives in a
    device bounce tensor and is copied down (queued);
  - same-GPU copies between host and device memory: a dense piece is one queued
    `copy_` (the copy engine), a strided one with a contiguous side one kernel launch.
Everything is queued on the stream, so the host goes on posting while the bytes cross
PCIe (1 H200: 1.9 GB of 8B-shaped TP halves unpacked into host memory in 37 ms, 52 GB/s;
packing them on the host first took 361 ms under torchrun's one CPU thread). Where the
host memory is not mapped (pageable tensors, NEREUS_MAPPED_HOST=0): a send packs its
pieces in pinned host memory and moves the packed buffer in one host→device copy, a
receive copies the buffer down once and unpacks it on the host, and a copy is one
`copy_` per piece.
On CPU (gloo) host and device are the same memory: only the bookkeeping differs, which is
what makes it testable without a GPU (`Runtime.placement`, `Runtime.device_bytes`).

Input of this module: JSON program dicts and torch tensors. Invariant: a tensor returned
by `to_host`/`host_empty` is a CPU tensor, pinned exactly when CUDA is available and the
runtime's device is a GPU.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from nereus.backends.triton.mapped import hold

from .program import offloaded_units  # in __all__; it lives in program.py, which the torch-free lowering process imports

HOST = "host"
DEVICE = "device"


def pinnable(device=None) -> bool:
    """Whether host tensors for a runtime on `device` are pinned: where a CUDA runtime
    exists and the device is a GPU (None: any). A CPU runtime on a GPU host (gloo) pins
    nothing: its host is its device, pinning costs cudaHostAlloc, and it fails in a process
    forked after CUDA started."""
    return torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda")


def host_empty(shape, dtype, device=None) -> torch.Tensor:
    """An uninitialised host tensor, pinned where `pinnable(device)`."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=pinnable(device))


def to_host(tensor: torch.Tensor, device=None) -> torch.Tensor:
    """`tensor` in host memory, pinned where `pinnable(device)` (`device`: the runtime's):
    itself when it already is, else a contiguous copy (the caller's tensor is left as it was)."""
    pin = pinnable(device)
    if tensor.device.type == "cpu" and tensor.is_contiguous() and (not pin or tensor.is_pinned()):
        return tensor
    out = host_empty(tensor.shape, tensor.dtype, device)
    out.copy_(tensor)
    return out


def pack_from_host(views: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """Pack host views into the device buffer `out`: packed in pinned host memory, then
    one host→device copy (queued on the current stream; the host buffer stays alive
    until it ran because the pinned allocator records the stream)."""
    from .packing import torch_pack

    staging = host_empty((out.numel(),), torch.uint8)
    torch_pack(views, offsets, out.numel(), out=staging)
    out.copy_(staging, non_blocking=True)
    return out


class HostUnpack:
    """A packed buffer on its way into host views: the device→host copy into pinned
    staging memory is queued on the current stream now; `finish()` waits for that copy
    alone and copies the pieces out on the host. Why apart: waiting for the whole stream
    in every chunk kept the host from posting the next chunks while the bytes crossed
    PCIe and were unpacked (the streams finish these once the later chunks are posted)."""

    def __init__(self, buffer: torch.Tensor, views: Sequence[torch.Tensor], offsets: Sequence[int]):
        self.staging = host_empty((buffer.numel(),), torch.uint8)
        self.staging.copy_(buffer, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record(torch.cuda.current_stream(buffer.device))
        self.views, self.offsets = views, offsets

    def ready(self) -> bool:
        """Whether the device→host copy is done (never blocks)."""
        return self.copied.query()

    def finish(self) -> None:
        from .packing import torch_unpack

        self.copied.synchronize()
        torch_unpack(self.staging, self.views, self.offsets)


def unpack_to_host(buffer: torch.Tensor, views: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Unpack the device buffer `buffer` into host views: one device→host copy into pinned
    memory (waited for), then the pieces are copied out of it in host memory."""
    HostUnpack(buffer, views, offsets).finish()


def new_shard(unit: str, shape, dtype, live, device, host_units) -> torch.Tensor:
    """An after-shard of the executor: in (pinned) host memory when `unit` is offloaded
    (not device bytes), else on `device` and added to `live`, the device-bytes account."""
    if unit in host_units:
        return host_empty(shape, dtype, device)
    tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
    live.add(tensor)
    return tensor


def round_bytes(work, host_before, host_after) -> int:
    """Bytes a round (program.RoundWork) moves between host memory (offloaded units) and
    the device: pieces sent or copied out of an offloaded before-unit or into an offloaded
    after-unit (a copy from one offloaded unit into another stays in host memory)."""
    total = 0
    for msg in work.sends:
        total += sum(p.total_bytes for p in msg.pieces if p.src_unit in host_before)
    for msg in work.recvs:
        total += sum(p.total_bytes for p in msg.pieces if p.dst_unit in host_after)
    for p in work.copies:
        total += p.total_bytes if (p.src_unit in host_before) != (p.dst_unit in host_after) else 0
    return total


def pack(views: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """`packing.pack` for a message whose pieces may live in host memory. Host pieces in
    pinned memory the GPU maps: the fused kernels read them in place, one launch over
    PCIe (`packing.host_in_place`). Otherwise: all on the host, packed there and one
    host→device copy; mixed, one `copy_` per piece (each crossing where it must); all on
    the buffer's device, the fused kernels' path."""
    from . import packing

    on_host = [not v.is_cuda for v in views]
    if out.is_cuda and any(on_host) and packing.host_in_place(views, out.device):
        packing.kernels().pack_into(views, offsets, out.numel(), out)
        hold(views, out.device)  # no pinned block it reads is reused before it ran
        return out
    if out.is_cuda and on_host and all(on_host):
        return pack_from_host(views, offsets, out)
    if out.is_cuda and any(on_host):
        return packing.torch_pack(views, offsets, out.numel(), out=out)
    return packing.pack(views, offsets, out.numel(), out=out)


def unpack(buffer: torch.Tensor, views: Sequence[torch.Tensor], offsets: Sequence[int]) -> Optional[HostUnpack]:
    """`packing.unpack` for a message whose destinations may live in host memory (as
    `pack`). Mapped pinned host views: the fused kernels write them in place, queued on
    the current stream; returns None. Otherwise, all of them in host memory and the
    buffer on a GPU: returns the HostUnpack, which the caller finishes (the pieces are
    written then); else None, written now (or, mixed, by copies queued on the current
    stream)."""
    from . import packing

    on_host = [not v.is_cuda for v in views]
    if buffer.is_cuda and any(on_host) and packing.host_in_place(views, buffer.device):
        packing.kernels().unpack_from(buffer, views, offsets)
        hold(views, buffer.device)  # no pinned block it writes is reused before it ran
        return None
    if buffer.is_cuda and on_host and all(on_host):
        return HostUnpack(buffer, views, offsets)
    if buffer.is_cuda and any(on_host):
        packing.torch_unpack(buffer, views, offsets)
    else:
        packing.unpack(buffer, views, offsets)
    return None


__all__ = ["DEVICE", "HOST", "HostUnpack", "host_empty", "new_shard", "offloaded_units", "pack",
           "pack_from_host", "pinnable", "round_bytes", "to_host", "unpack", "unpack_to_host"]
