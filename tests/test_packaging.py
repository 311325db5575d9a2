"""pyproject's extras: the CPU runtime does not pull Triton; the `gpu` extra does."""

import pathlib
import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_runtime_extra_has_no_triton_and_gpu_extra_has_it():
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert not any(req.startswith("triton") for req in extras["runtime"])
    assert any(req.startswith("triton") for req in extras["gpu"])
    for module in ("torch", "numpy", "rich"):  # what `nereus train` checks for (nereus.cli.extras)
        assert any(req.startswith(module) for req in extras["runtime"])
