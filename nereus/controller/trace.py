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


def load_trace(path: str) -> Trace:
    """Parse a trace file and the `.nir` it names (errors name the file and the field)."""
    from nereus.ir import parse_file

    try:
        with open(path) as handle:
            data = json.load(handle)
    except json.JSONDecodeError as error:
        raise TraceError(f"{path}: not valid JSON: {error.msg} at line {error.lineno}",
                         hint="a trace is {\"nir\": ..., \"plan\": ..., \"steps\": [...]}") from None
    for key in ("nir", "plan", "steps"):
        if key not in data:
            raise TraceError(f"{path}: missing key {key!r}", hint="a trace is {\"nir\": ..., \"plan\": ..., \"steps\": [...]}")
    module = parse_file(os.path.join(os.path.dirname(os.path.abspath(path)), data["nir"]))
    names = [p.name for p in module.plans]
    if data["plan"] not in names:
        raise TraceError(f"{path}: no plan named {data['plan']!r} in {data['nir']}", hint=f"plans: {', '.join(names)}")
    steps = []
    for i, s in enumerate(data["steps"]):
        try:
            step = TraceStep(int(s["response"]), int(s["gpus"]), s.get("prompt"), s.get("batch"))
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"{path}: step {i} needs integer 'response' and 'gpus'", hint='e.g. {"response": 1024, "gpus": 64}') from None
        if step.gpus % module.cluster.gpus_per_node or not 0 < step.gpus <= module.cluster.num_gpus:
            raise TraceError(f"{path}: step {i}: gpus {step.gpus} is not a whole number of nodes of the cluster",
                             hint=f"use a multiple of {module.cluster.gpus_per_node} up to {module.cluster.num_gpus}")
        steps.append(step)
    if not steps:
        raise TraceError(f"{path}: no steps")
    return Trace(path, module, data["plan"], tuple(steps), int(data.get("seed", 0)))
