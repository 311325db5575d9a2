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


def test_test_extra_needs_no_triton():
    """A CPU user's `pip install -e '.[runtime,test]'` pulled Triton (hundreds of MB) only for
    the tests that run the pack kernels under its interpreter; those skip without it, and
    the `gpu` extra brings it (CI installs it: tests/test_ci_script.py)."""
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert not any(req.startswith("triton") for req in extras["test"])


def test_readmes_cpu_install_takes_torch_from_pytorchs_cpu_index():
    """From the default index `pip install torch==2.13.0` is the CUDA build and about 20
    nvidia packages (several GB): the CPU line names PyTorch's CPU wheel index for torch,
    as PyTorch's install selector does (`--index-url .../whl/cpu`)."""
    import re

    readme = (PYPROJECT.parent / "README.md").read_text()
    command = [b for b in re.findall(r"```bash\n(.*?)\n```", readme, re.S) if "pytest" in b][0]
    first = command.split("&&")[0].split()
    assert first[:3] == ["pip", "install", "torch==2.13.0"], command
    assert "--index-url" in first and first[first.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
