"""Optional dependencies of the `nereus` commands, checked before a command imports them.

`pip install nereus` (or `pip install -e .`) installs the compiler only (lark, networkx,
click). The runtime tools need the `runtime` extra (torch, numpy, rich, matplotlib); the
Triton pack kernels need the `gpu` extra. A command whose dependency is missing exits 2
with the extra to install instead of a ModuleNotFoundError traceback. `find_spec` looks a
package up without importing it (importing torch takes seconds).
"""

from __future__ import annotations

import importlib.util
import re
import sys

from nereus.ir.diagnostics import NereusError

# command → top-level modules it imports (directly or through nereus.controller / nereus.rl)
COMMAND_NEEDS: dict[str, tuple[str, ...]] = {
    "simulate": ("numpy",),
    "search": ("numpy",),  # the controller's plan search
    "train": ("torch", "numpy", "rich"),
    "bench": ("numpy",),  # every benchmark reports through nereus.controller or numpy; more per script
    "export": ("torch", "safetensors"),
}
EXTRA_OF: dict[str, str] = {"torch": "runtime", "numpy": "runtime", "rich": "runtime", "matplotlib": "runtime",
                            "triton": "runtime,gpu", "safetensors": "hf"}


class MissingDependency(NereusError):
    """An optional package a command needs is not installed."""


def missing(modules) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def require(modules, what: str) -> None:
    """Raise MissingDependency naming the extra to install unless every module is importable."""
    absent = missing(modules)
    if not absent:
        return
    extras = sorted({EXTRA_OF.get(name, "runtime") for name in absent}, key=len)[-1]
    verb = "is" if len(absent) == 1 else "are"
    raise MissingDependency(f"{what} needs {', '.join(absent)}, which {verb} not installed for {sys.executable}",
                            hint=f"install nereus[{extras}]: pip install 'nereus[{extras}]' "
                                 f"(in a checkout: pip install -e '.[{extras}]')")


_IMPORT = re.compile(r"^\s*(?:import|from)\s+(torch|numpy|triton|matplotlib|rich)\b", re.MULTILINE)


def script_needs(source: str) -> tuple[str, ...]:
    """The optional top-level packages a benchmark script imports (read from its source)."""
    return tuple(sorted(set(_IMPORT.findall(source))))
