"""Run the Triton kernels under the interpreter: TRITON_INTERPRET must be set before
`@triton.jit` decorates them, so it is set here, before any test module imports them
(and the kernels module is re-imported if something imported it earlier without it)."""

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
if "nereus.backends.triton.kernels" in sys.modules:
    importlib.reload(sys.modules["nereus.backends.triton.kernels"])
