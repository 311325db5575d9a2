"""tests/triton's conftest puts Triton in interpreter mode for the whole pytest process;
beside a GPU it must not (the CUDA tests collected with it would launch interpreted kernels
on device addresses: an abort or a segfault on one H200, session 17)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUN = """
import os, sys, torch, pytest
torch.cuda.is_available = lambda: {cuda}
if not {triton}:
    sys.modules["triton"] = None  # as if not installed: `import triton` fails, find_spec finds none
rc = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-rs", "tests/triton/test_tables.py", "-k",
                  "tile"])
print("INTERPRET", os.environ.get("TRITON_INTERPRET"))
sys.exit(rc)
"""


def _run(cuda: bool, asked: bool, triton: bool = True) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if asked:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", RUN.format(cuda=cuda, triton=triton)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_beside_a_gpu_the_interpreter_tests_are_skipped_and_the_setting_left_alone():
    out = _run(cuda=True, asked=False)
    assert "skipped" in out and "passed" not in out and "INTERPRET None" in out, out


@pytest.mark.triton
def test_asked_for_or_without_a_gpu_they_run_under_the_interpreter():
    for cuda, asked in ((False, False), (True, True)):
        out = _run(cuda=cuda, asked=asked)
        assert "passed" in out and "skipped" not in out and "INTERPRET 1" in out, (cuda, asked, out)


def test_without_triton_they_skip_saying_why():
    """A CPU install of the `test` extra has no Triton: the interpreter tests skip (they
    failed with ImportError), and so does a test marked `triton` elsewhere."""
    out = _run(cuda=False, asked=False, triton=False)
    assert "skipped" in out and "passed" not in out and "failed" not in out, out
    assert "triton is not installed" in out, out
