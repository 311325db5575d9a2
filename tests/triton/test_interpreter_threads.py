"""Two threads packing at once under Triton's interpreter (the prepared JIT's background
compile runs kernels beside a transition's own): every result is byte-exact. The
interpreter keeps a launch's grid in module state; launches that overlap read each
other's ("InterpreterError: ValueError('x >= grid_dim[0]')") unless they take turns."""

import threading

import torch

from nereus.backends.triton.packer import Packer
from nereus.runtime import packing


def _views(rows: int):
    state = torch.arange(rows * 40, dtype=torch.float32).view(rows, 40)
    return [state[:, 4:36], state[1:3]]


def test_overlapping_launches_under_the_interpreter_are_exact():
    errors, results = [], {}

    def pack(name: str, rows: int):
        packer = Packer(backend="triton")  # jit "eager": each call launches
        views = _views(rows)
        offsets, _ = packing.layout([v.numel() * v.element_size() for v in views])
        total = offsets[-1] + views[-1].numel() * views[-1].element_size()
        expected = packing.torch_pack(views, offsets, total)
        try:
            for _ in range(6):
                out = packer.pack_into(views, offsets, total)
                results.setdefault(name, []).append(all(
                    torch.equal(out[o:o + v.numel() * v.element_size()], expected[o:o + v.numel() * v.element_size()])
                    for v, o in zip(views, offsets)))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    threads = [threading.Thread(target=pack, args=(f"t{i}", rows)) for i, rows in enumerate((3, 64, 17))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {name: all(ok) for name, ok in results.items()} == {"t0": True, "t1": True, "t2": True}
