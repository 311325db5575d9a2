"""Under the "prepared" JIT a call that lacks kernel variants compiles them itself when
this process's recent compiles were quick (variants.INLINE_COMPILE_S), and otherwise takes
the torch path while they compile in the background, as before: no history, slow
compiles, too many missing, the setting at 0, or a compile that fails."""

import pytest
import torch

from nereus.backends.triton import variants
from nereus.backends.triton.packer import Packer
from nereus.runtime import packing

CPU = torch.device("cpu")


def _call():
    state = torch.arange(96 * 40, dtype=torch.float32).view(96, 40)
    odd = torch.arange(33 * 7, dtype=torch.bfloat16).view(33, 7)
    views = [state[:, 4:36], odd[:, 1:4], state[5:6]]
    offsets, _ = packing.layout([v.numel() * v.element_size() for v in views])
    return views, offsets, offsets[-1] + views[-1].numel() * views[-1].element_size()


def _packer(history: list) -> Packer:
    packer = Packer(backend="triton")
    packer.jit = "prepared"
    packer.compile_log = [(("pack", 1, 1, 1, 1), s) for s in history]
    return packer


def _pieces(buffer, views, offsets):
    return [buffer[o:o + v.numel() * v.element_size()] for v, o in zip(views, offsets)]


def test_after_quick_compiles_a_call_compiles_what_it_lacks_and_launches():
    views, offsets, total = _call()
    packer = _packer([0.002] * 4)
    classes = packer.launch_classes([("pack", views, offsets)])
    out = packer.pack_into(views, offsets, total)
    assert packer.fallback_calls == 0 and packer.inline_compiles == len(classes) and classes <= packer.compiled
    assert packer._compiling is None  # nothing left for the background
    assert [plan.backend for plan in packer._plans.values()] == ["triton"]  # the kernels ran
    expected = packing.torch_pack(views, offsets, total)
    assert all(torch.equal(a, b) for a, b in zip(_pieces(out, views, offsets), _pieces(expected, views, offsets)))
    assert len(packer.compile_log) == 4 + len(classes)


@pytest.mark.parametrize("history", [[], [1.0, 2.0, 0.001]], ids=["no compile yet", "slow compiles"])
def test_without_quick_compiles_the_call_takes_the_torch_path(history):
    views, offsets, total = _call()
    packer = _packer(history)
    packer.pack_into(views, offsets, total)
    assert packer.fallback_calls == 1 and packer.inline_compiles == 0
    packer.wait_compiled()


def test_too_many_missing_for_the_budget_wait_for_the_background():
    views, offsets, _ = _call()
    packer = _packer([variants.INLINE_COMPILE_S / 2])
    classes = packer.launch_classes([("pack", views, offsets)])
    assert len(classes) >= 3  # 3 x half the budget > the budget
    assert not packer.ready(classes, CPU, start=False) and packer.inline_compiles == 0
    one = {next(iter(classes))}
    assert packer.ready(one, CPU, start=False) and packer.inline_compiles == 1


def test_zero_turns_compiling_in_the_caller_off(monkeypatch):
    monkeypatch.setattr(variants, "INLINE_COMPILE_S", 0.0)
    views, offsets, _ = _call()
    packer = _packer([0.0001] * 8)
    assert not packer.ready(packer.launch_classes([("pack", views, offsets)]), CPU, start=False)


def test_a_failed_compile_in_the_caller_leaves_the_torch_path(monkeypatch, caplog):
    views, offsets, total = _call()
    packer = _packer([0.001])

    def broken(classes, device):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(packer, "_compile", broken)
    out = packer.pack_into(views, offsets, total)
    assert packer.fallback_calls == 1 and "no compiler here" in caplog.text
    expected = packing.torch_pack(views, offsets, total)
    assert all(torch.equal(a, b) for a, b in zip(_pieces(out, views, offsets), _pieces(expected, views, offsets)))
    monkeypatch.undo()
    packer.wait_compiled()
