"""benchmarks/pack_kernels.py sizes its Llama-3.1-8B loopback to the device's free memory
(it assumed a 141 GB H200 and ran out of memory on an 80 GB H100)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import pytest

pytest.importorskip("torch")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _script(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what it sets on a CPU machine, undone after the test
    spec = importlib.util.spec_from_file_location("pack_kernels", os.path.join(ROOT, "benchmarks", "pack_kernels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_loopback_model_fits_the_free_memory(monkeypatch):
    from nereus.models import parameter_count

    script = _script(monkeypatch)

    def footprint(model) -> int:
        return script.LOOPBACK_COPIES * 2 * parameter_count(model)

    assert script.loopback_model(int(139e9)).layers == 32  # an H200's free memory: the whole model
    h100 = script.loopback_model(int(79e9))
    assert 1 < h100.layers < 32 and footprint(h100) <= 79e9 < footprint(replace(h100, layers=h100.layers + 1))
