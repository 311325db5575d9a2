"""Replayed launches on a CUDA device (CUDA only): random boxes of bf16 and fp32 slots
copied, packed and unpacked byte for byte as torch slicing does; and the executor's
same-GPU copies (a one-GPU pp 1 -> pp 2 change in bf16) run as a replay, byte-exact on
a first and a second call and with a source shard at an address that is not 16-byte
aligned (another residue: another replay)."""

from __future__ import annotations

import random

import pytest
import torch

from nereus.ir.model import Model
from nereus.runtime import executor, replay as runtime_replay
from nereus.runtime.execution_plan import plan_for
from nereus.runtime.program import rank_program
from nereus.runtime.state import shard_of, shard_unit

from runtime_helpers import naive_program, oracle_units, reference_state, single_process_control, tensor_list

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _slot(rng, numel, dtype):
    skip = rng.randint(0, 3)
    whole = torch.randint(0, 255, ((numel + skip) * dtype.itemsize,), dtype=torch.uint8, device=DEVICE)
    return whole.view(dtype)[skip:]


def _box(rng):
    rows, cols = rng.randint(1, 300), rng.randint(1, 700)
    keep = rng.randint(1, cols)
    start = rng.randint(0, cols - keep)
    return (rows, keep), (cols, 1), start, start + (rows - 1) * cols + keep


@pytest.mark.parametrize("seed", range(3))
def test_random_boxes_copy_pack_and_unpack_on_cuda(seed):
    from nereus.backends.triton import replay
    from nereus.backends.triton.segments import layout

    rng = random.Random(seed)
    boxes, tensors = [], []
    for i in range(rng.randint(2, 8)):
        dtype = rng.choice((torch.bfloat16, torch.float32))
        shape, stride, offset, extent = _box(rng)
        tensors.append(_slot(rng, extent, dtype))
        boxes.append(replay.Box(1 + i, shape, stride, offset, dtype.itemsize))
    views = [t.as_strided(b.shape, b.stride, t.storage_offset() + b.offset) for t, b in zip(tensors, boxes)]
    offsets, total = layout(views)
    buffer = torch.zeros(total, dtype=torch.uint8, device=DEVICE)
    slots = [buffer] + tensors
    addresses = [t.data_ptr() for t in slots]
    entries = [(b, 0, o) for b, o in zip(boxes, offsets)]
    replay.Replay("pack", replay.message_pieces("pack", entries, replay.residues(addresses)), DEVICE).run(
        replay.table(addresses, DEVICE))
    for view, offset in zip(views, offsets):
        size = view.numel() * view.element_size()
        assert torch.equal(buffer[offset: offset + size], view.contiguous().reshape(-1).view(torch.uint8))
    want = [t.clone() for t in tensors]
    for t, v in zip(tensors, views):
        v.zero_()
    replay.Replay("unpack", replay.message_pieces("unpack", entries, replay.residues(addresses)), DEVICE).run(
        replay.table(addresses, DEVICE))
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(tensors, want))
    # copies: box i of slot 1 + i into the same box of a fresh zero tensor
    outs = [torch.zeros_like(t) for t in tensors]
    pairs = [(b, replay.Box(len(slots) + i, b.shape, b.stride, b.offset, b.elem)) for i, b in enumerate(boxes)]
    addresses = [t.data_ptr() for t in slots + outs]
    replay.Replay("copy", replay.copy_pieces(pairs, replay.residues(addresses)), DEVICE).run(
        replay.table(addresses, DEVICE))
    for out, t, b in zip(outs, tensors, boxes):
        expect = torch.zeros_like(t)
        expect.as_strided(b.shape, b.stride, b.offset).copy_(t.as_strided(b.shape, b.stride,
                                                                            t.storage_offset() + b.offset))
        assert torch.equal(out.view(torch.uint8), expect.view(torch.uint8))  # random bytes: NaNs compare unequal


MODEL = Model("actor", "llama", layers=2, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=256)
STAGE = "actor.inference"


@pytest.fixture
def control():
    return single_process_control()


def test_executor_copies_replay_byte_exact_at_any_residue(control, monkeypatch):
    monkeypatch.setattr(runtime_replay, "ENABLED", True)
    packer = runtime_replay.packer_for(DEVICE)
    monkeypatch.setattr(packer, "jit", "eager")  # run every replay (the default "prepared" falls back at first)
    tensors = tensor_list(MODEL, training=False)
    full = reference_state(tensors)
    before_units = oracle_units(MODEL, STAGE, 1, 1, 1, [0])
    after_units = oracle_units(MODEL, STAGE, 1, 1, 2, [0, 0])  # both stages on the one GPU: all copies
    prog = rank_program(naive_program(before_units, after_units, tensors, gpus=1), 0)
    assert prog.rounds[0].copies
    plan = plan_for(prog, executor.streams.CHUNK_BYTES)
    before = {u["id"]: {k: v.to(DEVICE) for k, v in shard_unit(u, 0, full).items()} for u in before_units}
    odd = {}  # the same shards, each 2 bf16 elements into a larger block: residue 4
    for unit, shards in before.items():
        odd[unit] = {}
        for k, v in shards.items():
            block = torch.empty(v.numel() + 8, dtype=v.dtype, device=DEVICE)
            odd[unit][k] = block[2: 2 + v.numel()].view(v.shape).copy_(v)
    for state in (before, before, odd):
        result = executor.execute(prog, state, group=None, control=control, device=DEVICE, rollback="device")
        torch.cuda.synchronize(DEVICE)
        wrong = [s["tensor"] for u in after_units for s in u["shards"]
                 if not torch.equal(result.state[u["id"]][s["tensor"]].cpu(), shard_of(full[s["tensor"]], s["boxes"]))]
        assert wrong == []
    copies = [plan.launches[key] for key in plan.launches if key[0] == "copy"]
    assert len(copies) == 2, copies  # aligned sources, then the odd residues
    assert all(c.classes <= packer.compiled for c in copies)  # both ran
