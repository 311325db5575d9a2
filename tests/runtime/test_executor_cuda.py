"""The executor on a CUDA device, one process (CUDA only): a program of same-GPU copies
whose destinations are all deferred (allocated after the agreement, on the current
stream, then written on the copy stream) gives the reference state byte for byte and the
peak of allocating them up front."""

from __future__ import annotations

import pytest
import torch

from nereus.ir.model import Model
from nereus.runtime import executor, rounds
from nereus.runtime.execution_plan import plan_for
from nereus.runtime.program import rank_program
from nereus.runtime.state import shard_of, shard_unit

from runtime_helpers import naive_program, oracle_units, reference_state, single_process_control, tensor_list

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODEL = Model("actor", "llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128)
STAGE = "actor.training"


@pytest.fixture(autouse=True)
def deferred(monkeypatch):
    """The deferred destinations these tests check are opt-in (NEREUS_DEFER_DESTINATIONS=1)."""
    from nereus.runtime import rounds

    monkeypatch.setattr(rounds, "DEFER_DESTINATIONS", True)


@pytest.fixture
def control():
    return single_process_control()


def test_deferred_copy_destinations_on_cuda_are_byte_exact(control):
    tensors = tensor_list(MODEL, training=True)
    full = reference_state(tensors)
    before_units = oracle_units(MODEL, STAGE, 1, 1, 1, [0])
    after_units = oracle_units(MODEL, STAGE, 1, 1, 2, [0, 0])  # both stages on the one GPU: all copies
    prog = rank_program(naive_program(before_units, after_units, tensors, gpus=1), 0)
    assert len(plan_for(prog, executor.streams.CHUNK_BYTES).rounds[0].deferred) == len(prog.rounds[0].copies) > 0
    device = torch.device("cuda", torch.cuda.current_device())
    before = {u["id"]: {k: v.to(device) for k, v in shard_unit(u, 0, full).items()} for u in before_units}
    torch.cuda._sleep(50_000_000)  # the stream is busy when the copies are queued
    result = executor.execute(prog, before, group=None, control=control, device=device, rollback="device")
    wrong = [s["tensor"] for u in after_units for s in u["shards"]
             if not torch.equal(result.state[u["id"]][s["tensor"]].cpu(), shard_of(full[s["tensor"]], s["boxes"]))]
    assert wrong == []
    up_front = executor.execute(prog, before, group=None, control=control, device=device, rollback="device",
                                verify=True)
    assert result.peak_bytes == up_front.peak_bytes


def test_a_deferred_destination_waits_for_work_queued_on_its_block(control, monkeypatch):
    """A deferred destination is allocated on the current stream after the copy stream
    last waited for it, so the caching allocator may hand it a block that work queued on
    the current stream meanwhile still writes (a temporary freed in between). The copies
    must wait for that work, or it overwrites them. Modelled without relying on which
    block the allocator picks: right after each deferred destination is allocated, a
    write of a wrong value into it is queued on the current stream behind a sleep."""
    tensors = tensor_list(MODEL, training=True)
    full = reference_state(tensors)
    before_units = oracle_units(MODEL, STAGE, 1, 1, 1, [0])
    after_units = oracle_units(MODEL, STAGE, 1, 1, 2, [0, 0])
    prog = rank_program(naive_program(before_units, after_units, tensors, gpus=1), 0)
    device = torch.device("cuda", torch.cuda.current_device())
    before = {u["id"]: {k: v.to(device) for k, v in shard_unit(u, 0, full).items()} for u in before_units}
    # a warm run first: its blocks stay cached, so the run below allocates without
    # cudaMalloc (which would wait for the device and hide the race) ...
    del executor.execute(prog, before, group=None, control=control, device=device, rollback="device").state
    # and the kernels used below loaded: loading a kernel module waits for the device too
    for dtype in {executor.TORCH_DTYPES[info.dtype] for unit in prog.after.values() for info in unit.values()}:
        torch.empty(4, dtype=dtype, device=device).fill_(7)
    torch.cuda._sleep(1000)
    torch.cuda.synchronize(device)
    real_destination = rounds.destination
    pending: set = set()

    def destination_with_pending_write(prog, new, live, device, unit, name, host_after):
        fresh = name not in new.get(unit, {})
        shard = real_destination(prog, new, live, device, unit, name, host_after)
        if fresh and shard.is_cuda:
            if not pending:
                torch.cuda._sleep(100_000_000)  # the writes below run well after the copies launch
            pending.add((unit, name))
            shard.fill_(7)
        return shard

    monkeypatch.setattr(rounds, "destination", destination_with_pending_write)
    result = executor.execute(prog, before, group=None, control=control, device=device, rollback="device")
    torch.cuda.synchronize(device)
    assert pending  # the copies' destinations were allocated in _copies, as deferred
    wrong = [s["tensor"] for u in after_units for s in u["shards"]
             if not torch.equal(result.state[u["id"]][s["tensor"]].cpu(), shard_of(full[s["tensor"]], s["boxes"]))]
    assert wrong == []
