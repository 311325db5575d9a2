"""The executor on a CUDA device, one process (CUDA only): a program of same-GPU copies
whose destinations are all deferred (allocated after the agreement, on the current
stream, then written on the copy stream) gives the reference state byte for byte and the
peak of allocating them up front."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nereus.ir.model import Model
from nereus.runtime import executor
from nereus.runtime.execution_plan import plan_for
from nereus.runtime.program import rank_program
from nereus.runtime.state import shard_of, shard_unit

from runtime_helpers import free_port, naive_program, oracle_units, reference_state, tensor_list

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODEL = Model("actor", "llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=128)
STAGE = "actor.training"


@pytest.fixture
def control():
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.new_group(backend="gloo")


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
