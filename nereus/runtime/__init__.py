"""The Nereus runtime: live EMU state, the transition executor, the embedding API.

    import nereus.runtime as nr
    rt = nr.Runtime.from_file("plan.nir", plan="S1")

Names load lazily (module `__getattr__`) so that `nereus.controller` and other
torch-free submodules import without torch; `Runtime` and the executor need torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Runtime": "runtime",
    "TransitionReport": "runtime",
    "TransitionAborted": "control",
    "Failure": "control",
    "execute": "executor",
    "rank_program": "program",
    "restrict_program": "program",
    "shard_unit": "state",
    "shard_of": "state",
    "assemble": "state",
    "step_name": "state",
    "hf_to_nereus": "naming",
    "nereus_to_hf": "naming",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
