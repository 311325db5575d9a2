"""The checkpoint layout without processes (nereus.rl.checkpoint_layout): every distinct box
of every saved model-stage is written once, the files come out about even, and files
written per that layout (each rank's boxes cut from full tensors, as stage() cuts them from
shards) read back through DCP's load and the partial reader as the full tensors, for
plans with dp replicas, tp, pp and zero 1."""

import io
import os
import pickle

import pytest
import torch

from nereus.rl.checkpoint_layout import STATE_KEY, SaveLayout, file_name, saved_stages
from nereus.rl.checkpoint_read import read_boxes, read_full, stored_tensors
from nereus.runtime.local_state import tensor_specs

from rl_plans import tiny_module

PLANS = {
    "DP": {"actor.generation": (1, 2, (0, 1)), "ref.inference": (2, 1, (0, 1)), "reward.inference": (1, 2, (0, 1)),
           "actor.training": (2, 1, (0, 1)), "critic.training": (2, 1, (0, 1))},
    "TPPP": {"actor.generation": (1, 2, (0, 1)), "ref.inference": (1, 1, (0, 1), 2),
             "reward.inference": (1, 2, (1, 0)), "actor.training": (1, 2, (1, 0)),
             "critic.training": (1, 1, (0, 1), 2)},
}


def _module():
    return tiny_module(PLANS, gpus=2, batch=8, prompt=5, response=4, hidden=32)


def _full(module):
    gen = torch.Generator().manual_seed(0)
    out = {}
    for ms in saved_stages(module):
        for name, (shape, dtype) in tensor_specs(module, ms).items():
            if "#step" not in name:
                out[f"{ms}/{name}"] = torch.randn(shape, generator=gen).to(dtype)
    return out


def _write(layout, full, folder):
    """Each rank's file as CheckpointWriter writes it, from full tensors; rank 0's state last."""
    buffer = io.BytesIO()
    torch.save({"step": 7}, buffer)
    state = buffer.getvalue()
    for rank, entries in layout.writers.items():
        with open(os.path.join(folder, file_name(rank)), "wb") as handle:
            for ms, tensor, _, box in entries:
                piece = full[f"{ms}/{tensor}"][tuple(slice(lo, hi) for lo, hi in box)].contiguous()
                handle.write(piece.view(torch.uint8).reshape(-1).numpy().tobytes())
            if rank == 0:
                handle.write(state)
    with open(os.path.join(folder, ".metadata"), "wb") as handle:
        pickle.dump(layout.metadata(len(state), folder), handle)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_layout_files_read_back_as_the_full_tensors(tmp_path, plan):
    module = _module()
    layout = SaveLayout(module, plan, lambda ms: tensor_specs(module, ms))
    boxes = [(ms, tensor, box) for entries in layout.writers.values() for ms, tensor, _, box in entries]
    assert len(boxes) == len(set(boxes))  # every box once
    sizes = sorted(layout.file_bytes.values())
    assert len(sizes) == 2 and sizes[0] > 0.3 * sizes[1], sizes  # both ranks write, about evenly
    full = _full(module)
    _write(layout, full, str(tmp_path))
    back, count = read_full(str(tmp_path), sorted(stored_tensors(str(tmp_path))))
    assert set(back) == set(full) and all(torch.equal(back[n], full[n]) for n in full)
    assert count.data == sum(t.numel() * t.element_size() for t in full.values())
    # a sub-box across two stored chunks: only its bytes are read
    name = "actor.training/actor/layers.0.attn.qkv.weight"
    out = torch.empty(30, 32)
    wanted = {(name, (20, 0)): (((20, 50), (0, 32)), out)}
    state, count = read_boxes(str(tmp_path), wanted, distributed=False)
    assert torch.equal(out, full[name][20:50]) and count.data == out.numel() * 4 and state == {"step": 7}
    assert STATE_KEY not in stored_tensors(str(tmp_path))
