"""Drift traces: per-step workloads and GPU budgets for `nereus simulate`.

A trace (JSON): {"nir": path relative to the trace, "plan": initial plan name,
"steps": [{"response": n, "gpus": g, "prompt"?: n, "batch"?: n}, ...], "seed"?: s}.
GPUs available at a step are ids 0..g−1 (whole nodes). `load_trace` parses the file and the
`.nir` it names; errors name the file and the field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Optional

from nereus.ir.diagnostics import NereusError
from nereus.ir.model import Module, Workload
from nereus.ir.validate import MAX_WORKLOAD


class TraceError(NereusError):
    """A trace file that is malformed or refers to something that does not exist."""


@dataclass(frozen=True)
class TraceStep:
    response: int
    gpus: int
    prompt: Optional[int] = None
    batch: Optional[int] = None


@dataclass(frozen=True)
class Trace:
    path: str
    module: Module
    plan: str
    steps: tuple[TraceStep, ...]
    seed: int = 0

    def workload(self, step: TraceStep) -> Workload:
        w = self.module.workload
        return replace(w, response=step.response, prompt=step.prompt or w.prompt, batch=step.batch or w.batch)


_SHAPE = "a trace is {\"nir\": ..., \"plan\": ..., \"steps\": [...]}"
_STEP_KEYS = ("response", "gpus", "prompt", "batch")
_STEP_HINT = 'e.g. {"response": 1024, "gpus": 64}'


def _whole(value) -> bool:
    """A JSON integer (not a bool, a float or a string)."""
    return isinstance(value, int) and not isinstance(value, bool)


def load_trace(path: str) -> Trace:
    """Parse a trace file and the `.nir` it names (errors name the file and the field).
    Every step value is a positive JSON integer, a step's batch a multiple of the
    workload's microbatch, and no step key is unknown: a trace is checked as strictly as
    the workload in a `.nir`."""
    from nereus.ir import parse_file

    try:
        with open(path) as handle:
            data = json.load(handle)
    except json.JSONDecodeError as error:
        raise TraceError(f"{path}: not valid JSON: {error.msg} at line {error.lineno}", hint=_SHAPE) from None
    except (ValueError, RecursionError) as error:  # e.g. an integer of more digits than Python converts
        raise TraceError(f"{path}: not valid JSON: {error}", hint=_SHAPE) from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", type(None): "null", bool: "a boolean"}.get(type(data), "a number")
        raise TraceError(f"{path}: the trace is {kind}, not a JSON object", hint=_SHAPE)
    for key in ("nir", "plan", "steps"):
        if key not in data:
            raise TraceError(f"{path}: missing key {key!r}", hint=_SHAPE)
    for key in ("nir", "plan"):
        if not isinstance(data[key], str):
            raise TraceError(f"{path}: {key!r} must be a string, found {json.dumps(data[key])}", hint=_SHAPE)
    if not isinstance(data["steps"], list):
        raise TraceError(f"{path}: 'steps' must be a list of steps", hint='e.g. "steps": [{"response": 1024, "gpus": 64}]')
    seed = data.get("seed", 0)
    if not _whole(seed):
        raise TraceError(f"{path}: 'seed' must be an integer, found {json.dumps(seed)}")
    module = parse_file(os.path.join(os.path.dirname(os.path.abspath(path)), data["nir"]))
    names = [p.name for p in module.plans]
    if data["plan"] not in names:
        raise TraceError(f"{path}: no plan named {data['plan']!r} in {data['nir']}", hint=f"plans: {', '.join(names)}")
    microbatch = module.workload.microbatch
    steps = []
    for i, s in enumerate(data["steps"]):
        if not isinstance(s, dict):
            raise TraceError(f"{path}: step {i} is not an object", hint=_STEP_HINT)
        unknown = sorted(set(s) - set(_STEP_KEYS))
        if unknown:
            raise TraceError(f"{path}: step {i}: unknown key {unknown[0]!r}", hint=f"step keys: {', '.join(_STEP_KEYS)}")
        for key in _STEP_KEYS:
            if key not in s:
                if key in ("response", "gpus"):
                    raise TraceError(f"{path}: step {i} needs integer 'response' and 'gpus'",
                                     hint=_STEP_HINT)
                continue
            if not _whole(s[key]) or s[key] < 1:
                raise TraceError(f"{path}: step {i}: {key} must be a positive integer, found {json.dumps(s[key])}",
                                 hint=_STEP_HINT)
            if key in MAX_WORKLOAD and s[key] > MAX_WORKLOAD[key]:  # as the .nir's workload limits
                raise TraceError(f"{path}: step {i}: {key} {s[key]} is above the limit of {MAX_WORKLOAD[key]}",
                                 hint=f"a workload's {key} is at most {MAX_WORKLOAD[key]} (docs/ir.md)")
        step = TraceStep(s["response"], s["gpus"], s.get("prompt"), s.get("batch"))
        if step.gpus % module.cluster.gpus_per_node or not 0 < step.gpus <= module.cluster.num_gpus:
            raise TraceError(f"{path}: step {i}: gpus {step.gpus} is not a whole number of nodes of the cluster",
                             hint=f"use a multiple of {module.cluster.gpus_per_node} up to {module.cluster.num_gpus}")
        if step.batch is not None and step.batch % microbatch:
            raise TraceError(f"{path}: step {i}: batch {step.batch} is not a multiple of the workload's microbatch "
                             f"({microbatch})", hint=f"use a multiple of {microbatch}")
        steps.append(step)
    if not steps:
        raise TraceError(f"{path}: no steps")
    return Trace(path, module, data["plan"], tuple(steps), seed)
