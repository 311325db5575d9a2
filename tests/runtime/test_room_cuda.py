"""What rollback="auto" and prepare believe a GPU can still give (parking.real_room): the
device's free memory plus the caching allocator's unused reserve, read from the nested
allocator statistics, equals the figure from torch's flat accessors. CUDA only."""

from __future__ import annotations

import pytest
import torch

from nereus.runtime import parking

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_real_room_counts_the_free_memory_and_the_allocators_spare_reserve():
    device = torch.device("cuda", torch.cuda.current_device())
    kept = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    spare = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    del spare  # reserved, no longer allocated: the allocator hands it out again without cudaMalloc
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    reserve = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    assert reserve >= 256 << 20
    assert parking.real_room(device) == int(parking.REAL_ROOM_FRACTION * (free + reserve))
    del kept
