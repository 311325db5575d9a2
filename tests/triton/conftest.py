"""Run the Triton kernels under the interpreter: TRITON_INTERPRET must be set before
`@triton.jit` decorates them, so it is set here, before any test module imports them
(and the kernels module is re-imported if something imported it earlier without it).

On a machine with a GPU these tests are skipped unless TRITON_INTERPRET=1 was set by
whoever ran pytest: the setting holds for the whole process, and the CUDA tests collected
beside them (tests/runtime/*_cuda.py, the lowering-ahead thread's) then launch
interpreted kernels on device addresses, which aborts or segfaults the process (seen on
one H200 in session 17, benchmarks/RESULTS.md). Run them apart there:
`TRITON_INTERPRET=1 python -m pytest tests/triton`.

Without triton installed they skip (tests/conftest.py)."""

import importlib
import os
import sys

import pytest
import torch

ASKED = os.environ.get("TRITON_INTERPRET") == "1"  # set by whoever ran pytest, not by this file
INTERPRETED = ASKED or not torch.cuda.is_available()
if INTERPRETED:
    os.environ["TRITON_INTERPRET"] = "1"
    if "nereus.backends.triton.kernels" in sys.modules:
        importlib.reload(sys.modules["nereus.backends.triton.kernels"])


@pytest.fixture(autouse=True)
def _interpreted():
    if not INTERPRETED:
        pytest.skip("interpreter-mode tests, skipped beside a GPU (it would hold for the CUDA tests too): "
                    "run `TRITON_INTERPRET=1 python -m pytest tests/triton` apart")
