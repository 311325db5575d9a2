"""`nereus` commands check their optional dependencies first: a missing one is an error
naming the extra to install (exit 2), not a ModuleNotFoundError traceback."""

import importlib.util
import pathlib

import pytest
from click.testing import CliRunner

from nereus.cli import nereus

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRACE = ROOT / "examples" / "traces" / "length-growth-1024.json"


@pytest.fixture()
def without(monkeypatch, tmp_path):
    """Make `find_spec` report these top-level modules as not installed (as on a machine
    where only `pip install -e .` ran). Runs in a scratch directory: a command that got
    past its check would write its outputs (runs/...) there, not into the tree."""
    monkeypatch.chdir(tmp_path)

    def hide(*names):
        real = importlib.util.find_spec

        def find_spec(name, *args, **kwargs):
            if name.split(".")[0] in names:
                return None
            return real(name, *args, **kwargs)

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    return hide


@pytest.mark.parametrize("argv,missing", [
    (["simulate", str(TRACE)], "numpy"),
    (["train", str(ROOT / "examples" / "rl" / "ppo-cpu.nir")], "rich"),
    (["train", str(ROOT / "examples" / "rl" / "ppo-cpu.nir")], "torch"),
    (["bench", "controller_search"], "numpy"),
    (["bench", "weight_sync"], "torch"),
])
def test_missing_runtime_dependency_says_which_extra(without, argv, missing):
    without(missing)
    result = CliRunner().invoke(nereus, argv)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.output.startswith(f"error: `nereus {argv[0]}")
    assert f"` needs {missing}, which is not installed" in result.output
    assert "hint: install nereus[runtime]: pip install 'nereus[runtime]'" in result.output
    assert "Traceback" not in result.output and "ModuleNotFoundError" not in result.output


def test_triton_benchmark_asks_for_the_gpu_extra(without):
    without("triton")
    result = CliRunner().invoke(nereus, ["bench", "pack_kernels"])
    assert result.exit_code == 2
    assert "install nereus[runtime,gpu]" in result.output


def test_simulate_plot_needs_matplotlib(without, tmp_path):
    without("matplotlib")
    result = CliRunner().invoke(nereus, ["simulate", str(TRACE), "--estimate-transitions", "--plot",
                                         str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert "`nereus simulate --plot` needs matplotlib" in result.output


def test_help_works_without_the_extras(without):
    without("numpy", "torch", "rich")
    result = CliRunner().invoke(nereus, ["train", "--help"])
    assert result.exit_code == 0 and "Usage" in result.output


def test_bench_help_is_the_commands_and_bench_name_help_the_scripts():
    """`nereus bench --help` documents the command; `nereus bench NAME --help` reaches the
    script (its own options), which the command's eager --help used to swallow."""
    import subprocess
    import sys

    own = CliRunner().invoke(nereus, ["bench", "--help"])
    assert own.exit_code == 0 and own.output.startswith("Usage: nereus bench [OPTIONS] [NAME] [ARGS]...")
    script = subprocess.run([sys.executable, "-c", "from nereus.cli import nereus; nereus()", "bench", "plan_scale",
                             "--help"], capture_output=True, text=True, timeout=120)
    assert script.returncode == 0 and script.stdout.startswith("usage: plan_scale.py"), script.stdout + script.stderr
