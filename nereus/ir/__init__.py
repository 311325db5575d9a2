"""The plan IR: semantic model, `.nir` parser, validation, canonical printer, overrides.

    import nereus.ir as ir
    module = ir.parse_file("plan.nir")                       # parse + validate
    module = ir.apply_overrides(module, ["workload.response=8192"])
    text = ir.print_module(module)                           # canonical source
    text = ir.format_source(source, "plan.nir")              # canonical, comments kept

Imports neither torch nor triton.
"""

from __future__ import annotations

from .diagnostics import InfeasibleError, NereusError, ParseError, ProgramError, SemanticError
from .model import (
    ARCHITECTURE_DEFAULTS,
    DTYPE_BYTES,
    HEADS,
    STAGES,
    Cluster,
    GpuSetItem,
    GpuSpec,
    Location,
    Model,
    ModelStage,
    Module,
    Placement,
    Plan,
    RopeScaling,
    Transition,
    Workload,
    key_loc,
)

_LAZY = {
    "parse_source": "parser",
    "parse_file": "parser",
    "print_module": "printer",
    "apply_overrides": "overrides",
    "resolve_gpu_set": "gpuset",
    "format_gpu_set": "gpuset",
    "format_size": "units",
    "format_rate": "units",
    "format_flops": "units",
    "format_source": "comments",
    "validate_module": "validate",
    "valid_tps": "validate",
    "items_for": "gpuset",
    "OVERRIDE_KEYS": "overrides",
}


def __getattr__(name: str):
    # The front end's modules load on first use: importing nereus.ir for the data model
    # alone does not pay for building the lark parser.
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nereus.ir' has no attribute {name!r}")


__all__ = [
    "InfeasibleError", "NereusError", "ParseError", "ProgramError", "SemanticError",
    "ARCHITECTURE_DEFAULTS", "DTYPE_BYTES", "HEADS", "STAGES", "Cluster", "GpuSetItem", "GpuSpec", "Location", "Model",
    "ModelStage", "Module", "Placement", "Plan", "RopeScaling", "Transition", "Workload", "key_loc",
    *_LAZY,
]
