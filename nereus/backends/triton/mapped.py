"""Pinned host memory that the kernels address in place.

Under CUDA's unified virtual addressing (every 64-bit CUDA platform), memory allocated
with `cudaHostAlloc` (torch's pinned memory) is mapped into every device's address
space at its host address. A kernel can then load and store it directly over PCIe: the
pack kernels move the pieces of an offloaded unit's host shards between a device buffer
and host memory in one launch, at the link's speed (1 H200: 50-52 GB/s for 1.9 GB of
8B-shaped TP halves, against 55 GB/s for one `cudaMemcpy` of the same bytes), where
packing them on the host runs one CPU thread's memcpy (5 GB/s under torchrun, which sets
OMP_NUM_THREADS=1; benchmarks/RESULTS.md, "host memory the kernels address").

Whether a host pointer is mapped so is asked of the driver (`cuPointerGetAttribute`,
CU_POINTER_ATTRIBUTE_DEVICE_POINTER) per call, never remembered: an address freed from
pinned memory may come back as pageable memory, which a kernel must not touch. Pageable
memory, or a device pointer that differs from the host one (memory registered on a
platform without `canUseHostPointerForRegisteredMem`), is not mapped: those calls keep
the copying path. NEREUS_MAPPED_HOST=0 turns this off (every host piece is copied).

A kernel that reads or writes host memory in place is invisible to torch's pinned-memory
cache, which orders only its own copies: `hold` tells it, so that a block dropped while
such a kernel is queued is not handed out again under it.

Input: tensors. Output: booleans. Invariant: `mapped(views, device)` is True only when
every CPU view lies in memory the driver maps into the current context at its own
address, and `device` is a CUDA device.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch

from nereus.ir.diagnostics import env_flag

_DEVICE_POINTER = 3  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER
_driver = None  # the loaded libcuda, False where it does not load


def _libcuda():
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
            lib.cuPointerGetAttribute.restype = ctypes.c_int
            _driver = lib
        except (OSError, AttributeError):
            _driver = False
    return _driver or None


def enabled() -> bool:
    """NEREUS_MAPPED_HOST (default 1): whether host pieces may be addressed in place."""
    return env_flag("NEREUS_MAPPED_HOST", True)


def device_address(address: int) -> Optional[int]:
    """The device address of host `address` in the current CUDA context, or None where
    the driver maps none (pageable memory, no driver)."""
    lib = _libcuda()
    if lib is None or address == 0:
        return None
    out = ctypes.c_uint64(0)
    if lib.cuPointerGetAttribute(ctypes.byref(out), _DEVICE_POINTER, address) != 0:
        return None
    return out.value


def mapped(views: Sequence[torch.Tensor], device: torch.device) -> bool:
    """Whether the kernels on CUDA `device` can address every view in place: each one is
    on `device`, or a CPU tensor in pinned memory mapped at its own address (every
    distinct storage asked once per call)."""
    device = torch.device(device)
    if device.type != "cuda" or not enabled() or not torch.cuda.is_available():
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    asked: dict = {}
    for view in views:
        if view.device == device:
            continue
        if view.device.type != "cpu":
            return False
        base = view.untyped_storage().data_ptr()
        if base not in asked:
            asked[base] = device_address(base) == base
        if not asked[base]:
            return False
    return True


_TOUCH: dict = {}


def hold(tensors: Sequence[torch.Tensor], device: torch.device) -> None:
    """Keep the pinned host memory of `tensors` from being handed out again before the
    work queued on `device`'s current stream so far has run. A kernel that reads or
    writes host memory in place is invisible to torch's pinned-memory cache (which
    orders only its own copies), so a host shard dropped while such a kernel is queued
    (a transition that aborts) could be reused under it. One 1-byte `copy_` from each
    storage, queued after the kernel, records that cache's event on the block."""
    device = torch.device(device)
    touch = _TOUCH.get(device)
    if touch is None:
        touch = _TOUCH[device] = torch.empty(1, dtype=torch.uint8, device=device)
    seen = set()
    for tensor in tensors:
        if tensor.is_cuda:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        one = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (1,), (1,))
        touch.copy_(one, non_blocking=True)


__all__ = ["device_address", "enabled", "hold", "mapped"]
