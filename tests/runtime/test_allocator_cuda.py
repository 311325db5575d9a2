"""Room in the caching allocator ahead of a round, on a CUDA device (runtime/allocator.py):
after `reserve_ahead` the round's shards come out of one block (one cudaMalloc, where
allocating them from an empty cache takes many), a cache that already holds the bytes
gets no reservation, the free-memory margin is never taken, and a transition's first
execution reserves for its rounds while a second one, served by the cache, does not.
CUDA only."""

from __future__ import annotations

import pytest
import torch

from nereus.ir.model import Model
from nereus.runtime import allocator, executor
from nereus.runtime.program import rank_program
from nereus.runtime.state import shard_of, shard_unit

from runtime_helpers import naive_program, oracle_units, reference_state, single_process_control, tensor_list

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MiB = 1 << 20
SIZES = [3 * MiB] * 100 + [12 * MiB + 512] * 20 + [40 * MiB] * 4  # 700 MiB and a bit


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _segments(device) -> int:
    """cudaMalloc calls of the large pool so far."""
    return torch.cuda.memory_stats(device)["segment.large_pool.allocated"]


def _allocate(device) -> list:
    return [torch.empty(n, dtype=torch.uint8, device=device) for n in SIZES]


def test_the_shards_come_out_of_one_block():
    """In a process of its own: segments that earlier tests of this process left partly
    used count as cached bytes, and shards that do not fit their gaps took a second
    cudaMalloc (seen on an H100 after the other CUDA tests)."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = "import test_allocator_cuda as t; t.one_block_case()"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH")))))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def one_block_case():
    device = _device()
    torch.cuda.empty_cache()
    start = _segments(device)
    shards = _allocate(device)
    without = _segments(device) - start
    del shards
    torch.cuda.empty_cache()
    start = _segments(device)
    needed = sum(allocator.block_bytes(n) for n in SIZES)
    # what the cache lacks: the unused parts of segments still in use (earlier tests) count
    assert 0 < allocator.reserve_ahead(device, needed) <= needed
    shards = _allocate(device)
    assert _segments(device) - start == 1 < without
    del shards


def test_a_cache_that_holds_the_bytes_gets_no_reservation():
    device = _device()
    needed = sum(allocator.block_bytes(n) for n in SIZES)
    block = torch.empty(needed, dtype=torch.uint8, device=device)
    del block
    assert allocator.reserve_ahead(device, needed) == 0


def test_the_margin_is_never_taken(monkeypatch):
    device = _device()
    torch.cuda.empty_cache()
    free = allocator.MARGIN_BYTES + 100 * MiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 1 << 40))
    assert allocator.reserve_ahead(device, 1 << 33) == 100 * MiB
    monkeypatch.setattr(allocator, "RESERVE_ROUNDS", False)
    assert allocator.reserve_ahead(device, 1 << 33) == 0


@pytest.fixture
def control():
    return single_process_control()


def test_a_first_execution_reserves_and_a_second_is_served_by_the_cache(control):
    model = Model("actor", "llama", layers=2, hidden=1024, heads=8, kv_heads=2, ffn=4096, vocab=4096)
    tensors = tensor_list(model, training=True)
    full = reference_state(tensors)
    before_units = oracle_units(model, "actor.training", 1, 1, 1, [0])
    after_units = oracle_units(model, "actor.training", 1, 1, 2, [0, 0])  # both stages on the one GPU
    prog = rank_program(naive_program(before_units, after_units, tensors, gpus=1), 0)
    device = _device()
    before = {u["id"]: {k: v.to(device) for k, v in shard_unit(u, 0, full).items()} for u in before_units}
    torch.cuda.empty_cache()
    first = executor.execute(prog, before, group=None, control=control, device=device, rollback="device")
    assert first.rounds[0].reserved_bytes >= allocator.MIN_BYTES
    wrong = [s["tensor"] for u in after_units for s in u["shards"]
             if not torch.equal(first.state[u["id"]][s["tensor"]].cpu(), shard_of(full[s["tensor"]], s["boxes"]))]
    assert wrong == []
    del first
    second = executor.execute(prog, before, group=None, control=control, device=device, rollback="device")
    assert [r.reserved_bytes for r in second.rounds] == [0] * len(second.rounds)
