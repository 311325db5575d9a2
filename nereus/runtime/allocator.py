"""Room in the CUDA caching allocator ahead of a round's allocations.

Input: the bytes of large blocks a round is about to allocate on a CUDA device (its new
shards over 1 MiB, each rounded as the allocator rounds it; execution_plan.RoundPlan
.alloc_bytes). Output: one block of what the allocator's cache lacks for them, allocated
and freed at once, so the round's shards are carved out of it instead of each asking the
driver. Why: a cold transition allocates thousands of shards; every one the cache cannot
serve costs a cudaMalloc. On an H200 the first 6-layer expert-parallel training change of
`benchmarks/multi_gpu/host_only.py` spent 0.164 s in 6,216 `torch.empty` calls, 0.026 s
in its second execution (cProfile, benchmarks/RESULTS.md "session 17").
Invariant: takes only device memory that is free (cudaMemGetInfo) beyond MARGIN_BYTES,
which stays for what allocates outside the caching allocator (NCCL's buffers, a vLLM
engine); never reserves for what the cache can already serve; does nothing where the
block could not serve the shards (the cudaMallocAsync backend; caching turned off with
PYTORCH_NO_CUDA_MEMORY_CACHING, where a freed block is not kept; `max_split_size_mb` in
PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF, under which a block that large is never
split for a smaller request); never fails the round: an allocator that cannot answer, or
memory another process took between the query and the block, means no block (though in
that race torch empties its cache before it gives up, and the round then asks the driver
for every shard). NEREUS_RESERVE_ROUNDS=0 turns it off.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from nereus.ir.diagnostics import env_flag

log = logging.getLogger("nereus.runtime")

RESERVE_ROUNDS = env_flag("NEREUS_RESERVE_ROUNDS", True)
# the caching allocator's pools: blocks of at most 1 MiB come from 2 MiB segments of their
# own (a big reserved block never serves them); sizes round up to 512 bytes
SMALL_BYTES = 1 << 20
ROUND_BYTES = 512
# free device memory a reservation never takes
MARGIN_BYTES = 1 << 30
# below this, the few cudaMalloc calls it would save cost less than asking
MIN_BYTES = 64 << 20


def block_bytes(nbytes: int) -> int:
    """What the caching allocator's large pool takes for a tensor of `nbytes` (0: the
    small pool serves it)."""
    if nbytes <= SMALL_BYTES:
        return 0
    return -(-nbytes // ROUND_BYTES) * ROUND_BYTES


def reservation(needed: int, cached: int, free: int, margin: int = MARGIN_BYTES, least: int = MIN_BYTES) -> int:
    """Bytes to reserve in one block: what `needed` large-pool bytes lack in the cache's
    unused large blocks (`cached`), within the device's `free` memory less `margin`;
    0 when that is under `least`."""
    size = min(needed - cached, free - margin)
    return size if size >= least else 0


def reserve_ahead(device, needed: int) -> int:
    """Leave a block for `needed` large-pool bytes in `device`'s caching allocator, on the
    current stream (the one the round allocates on). Returns the bytes reserved (0 off
    CUDA, when turned off, under another allocator, or when the cache or the device
    cannot use one)."""
    if not RESERVE_ROUNDS or needed < MIN_BYTES or device.type != "cuda" or not _caching():
        return 0
    cached = unused_bytes(device, "large_pool")
    if cached is None or needed - cached < MIN_BYTES:
        return 0
    try:
        free, _ = torch.cuda.mem_get_info(device)
        size = reservation(needed, cached, free)
        if size:
            _allocate(size, device)
        return size
    except RuntimeError as error:  # torch.cuda.OutOfMemoryError is one
        log.debug("no block reserved ahead of the round: %r", error)
        return 0


def unused_bytes(device, pool: str = "all") -> Optional[int]:
    """Bytes the caching allocator holds in `pool` ("all", "large_pool", "small_pool") and
    has not handed out; None where it cannot say (another backend, a pluggable allocator)."""
    try:
        # the nested form: memory_reserved/memory_allocated each flatten every statistic into
        # a new dict (~0.3 ms apiece on an H200 host), which every transition would pay
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        return (stats["reserved_bytes"][pool]["current"] - stats["allocated_bytes"][pool]["current"]) if stats else 0
    except (RuntimeError, KeyError):
        return None


def _caching() -> bool:
    """Whether torch's own caching allocator serves CUDA allocations, a freed block stays
    in its cache, and a large cached block is split for smaller requests."""
    if "PYTORCH_NO_CUDA_MEMORY_CACHING" in os.environ:  # torch: set at all, even empty
        return False
    if any("max_split_size_mb" in os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF",
                                                                         "PYTORCH_ALLOC_CONF")):
        return False
    try:
        return torch.cuda.get_allocator_backend() == "native"
    except RuntimeError:
        return False


def _allocate(size: int, device) -> None:
    """Allocate `size` bytes on `device` and free them: the block stays in the cache."""
    block = torch.empty(size, dtype=torch.uint8, device=device)
    del block
