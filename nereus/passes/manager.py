"""PassManager: run a named pipeline of transition passes, check invariants, time each pass.

A pipeline is a string such as `diff,dag,resources,fusion{bucket=256MiB},lower,cost`: pass
names in order, options in braces (`key=value`, comma-separated; sizes take units, booleans
true/false). `PASSES` maps every name to a small frozen pass class whose `name` equals the
key (tested). Each pass is a pure function `CompileState → CompileState`; the manager checks
the pass's invariant after it runs (`check`), records its wall time, and can print the
state after every pass (`print_after_all`).
"""

from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Optional

from nereus.ir.diagnostics import NereusError
from nereus.ir.model import Module

from .memory_model import DEFAULT as DEFAULT_MEMORY_MODEL

DEFAULT_PIPELINE = "diff,dag,resources,fusion,lower,cost"
# what a program needs: the runtime's lowering and the prover compile without the cost
# pass, which only estimates the summary's times (a third of a 256-GPU MoE compile)
PROGRAM_PIPELINE = "diff,dag,resources,fusion,lower"


class PipelineError(NereusError):
    """A pipeline string that names an unknown pass or option, or runs passes out of order."""


@dataclass(frozen=True)
class CompileState:
    module: Module = field(repr=False)
    source: str
    target: str
    diff: object = None
    dag: object = None
    schedule: object = None
    messages: object = None
    program: object = None
    cost: object = None
    # the device memory model the schedule is made safe under and the program records
    # (nereus.passes.memory_model: "cuda" or "cpu")
    memory_model: str = DEFAULT_MEMORY_MODEL


@contextmanager
def paused_gc():
    """Run a block with the cyclic garbage collector off (restored after). A transition's
    records are hundreds of thousands of small acyclic tuples and frozen dataclasses: at
    4,096 GPUs the collector's generation scans, triggered by their allocation alone, cost
    about 40% of the compile's CPU time and free nothing (reference counting frees them).
    On the way out the block's survivors go straight to the oldest generation
    (`gc.freeze()` then `gc.unfreeze()`: two list splices) instead of being scanned by the
    young generation's collection that re-enabling would trigger at once (another ~10%);
    full collections still see them. Skipped when the process froze objects itself
    (unfreeze would release those too)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def _need(state: CompileState, attr: str, name: str) -> object:
    value = getattr(state, attr)
    if value is None:
        raise PipelineError(f"pass '{name}' needs the result of an earlier pass ({attr})",
                            hint=f"the default pipeline is {DEFAULT_PIPELINE}")
    return value


def _bytes_per_alloc(xfers, n: int) -> list[int]:
    out = [0] * n
    for x in xfers:
        out[x.alloc] += x.bytes
    return out


@dataclass(frozen=True)
class DiffPass:
    name = "diff"

    def run(self, state: CompileState) -> CompileState:
        from .diff import diff_plans

        return replace(state, diff=diff_plans(state.module, state.source, state.target))

    def check(self, state: CompileState) -> None:
        for stage in state.diff.stages:
            kept_after = {a for _, a in stage.kept}
            # a mesh layout's unit is re-laid out whole by its Repartition
            producers = ("split", "merge", "extend") + (("repartition",) if stage.after.layout is not None else ())
            made = {a for p in stage.primitives if p.kind in producers for a in p.after}
            missing = set(range(stage.after.dp)) - kept_after - made
            if missing and not stage.unchanged:
                raise AssertionError(f"diff: after-units {sorted(missing)} of {stage.model_stage} have no primitive")


@dataclass(frozen=True)
class DagPass:
    name = "dag"

    def run(self, state: CompileState) -> CompileState:
        from .dag import build_dag

        return replace(state, dag=build_dag(state.module, _need(state, "diff", self.name)))

    def check(self, state: CompileState) -> None:
        dag = state.dag
        got = _bytes_per_alloc(dag.xfers, len(dag.allocs))
        for i, a in enumerate(dag.allocs):
            if got[i] != a.shard_bytes:
                raise AssertionError(f"dag: alloc {i} receives {got[i]} bytes, its shard has {a.shard_bytes}")


@dataclass(frozen=True)
class ResourcesPass:
    name = "resources"
    independent: bool = False
    staging: bool = True

    def run(self, state: CompileState) -> CompileState:
        from .resources import schedule

        dag = _need(state, "dag", self.name)
        return replace(state, schedule=schedule(dag, independent=self.independent, staging=self.staging,
                                                memory_model=state.memory_model))

    def check(self, state: CompileState) -> None:
        if any("deadlock" in n for n in state.schedule.notes):
            return  # the baseline may deadlock: the verifier reports it
        got = _bytes_per_alloc((x for r in state.schedule.rounds for x in r.xfers), len(state.dag.allocs))
        for i, a in enumerate(state.dag.allocs):
            if got[i] != a.shard_bytes:
                raise AssertionError(f"resources: alloc {i} receives {got[i]} bytes over the rounds, needs {a.shard_bytes}")


@dataclass(frozen=True)
class FusionPass:
    name = "fusion"
    bucket: Optional[int] = None

    def run(self, state: CompileState) -> CompileState:
        from .fusion import fuse
        from .lower import single_round

        dag = _need(state, "dag", self.name)
        sched = state.schedule or single_round(dag, state.memory_model)
        return replace(state, schedule=sched, messages=fuse(dag, sched, self.bucket))

    def check(self, state: CompileState) -> None:
        for k, (rnd, messages) in enumerate(zip(state.schedule.rounds, state.messages)):
            sent = sum(x.bytes for x in rnd.xfers if x.kind == "send")
            if sent != sum(m.bytes for m in messages):
                raise AssertionError(f"fusion: round {k} sends {sum(m.bytes for m in messages)} bytes, expected {sent}")


@dataclass(frozen=True)
class LowerPass:
    name = "lower"

    def run(self, state: CompileState) -> CompileState:
        from .lower import lower

        return replace(state, program=lower(_need(state, "dag", self.name), state.schedule, state.messages,
                                            state.memory_model))

    def check(self, state: CompileState) -> None:
        program = state.program
        for k, messages in enumerate(program.messages):
            for m in messages:
                if m.src == m.dst:
                    raise AssertionError(f"lower: round {k} has a send from GPU {m.src} to itself")


@dataclass(frozen=True)
class CostPass:
    name = "cost"
    host_bytes_per_s: float = 50e9
    message_latency_s: float = 20e-6  # cost.MESSAGE_LATENCY_S

    def run(self, state: CompileState) -> CompileState:
        from .cost import estimate

        return replace(state, cost=estimate(_need(state, "program", self.name), self.host_bytes_per_s,
                                            self.message_latency_s))

    def check(self, state: CompileState) -> None:
        if state.cost.seconds < 0:
            raise AssertionError("cost: negative time")


PASSES: dict[str, Callable[..., object]] = {
    "diff": DiffPass,
    "dag": DagPass,
    "resources": ResourcesPass,
    "fusion": FusionPass,
    "lower": LowerPass,
    "cost": CostPass,
}


def _value(text: str, kind, key: str, pass_name: str):
    from nereus.ir.units import UnitError, parse_size

    text = text.strip()
    try:
        if kind in (bool, "bool"):
            if text.lower() not in ("true", "false"):
                raise ValueError
            return text.lower() == "true"
        if kind in (float, "float"):
            return float(text)
        if any(ch.isalpha() for ch in text):
            return parse_size(text, key)
        return int(text)
    except (ValueError, UnitError):
        raise PipelineError(f"option {key}={text!r} of pass '{pass_name}' is not a valid value",
                            hint="sizes take units (256MiB), booleans true/false")


# a value each option takes, for the hint of an option written without one
_EXAMPLES = {"bucket": "256MiB", "host_bytes_per_s": "50e9", "message_latency_s": "20e-6"}
# what each numeric option must be: (test, wording)
_RANGES = {"bucket": (lambda v: v > 0, "a positive size"),
           "host_bytes_per_s": (lambda v: math.isfinite(v) and v > 0, "a positive number of bytes per second"),
           "message_latency_s": (lambda v: math.isfinite(v) and v >= 0, "a number of seconds >= 0")}


def _check_range(key: str, text: str, value, pass_name: str) -> None:
    rule = _RANGES.get(key)
    if rule is not None and not rule[0](value):
        raise PipelineError(f"option {key}={text} of pass '{pass_name}' must be {rule[1]}",
                            hint=f"e.g. {key}={_EXAMPLES[key]}")


def parse_pipeline(text: str) -> list:
    """`diff,dag,fusion{bucket=256MiB}` → [DiffPass(), DagPass(), FusionPass(bucket=...)]."""
    passes = []
    i, n = 0, len(text)
    while i < n:
        j = i
        while j < n and text[j] not in ",{":
            j += 1
        name = text[i:j].strip()
        options = {}
        if j < n and text[j] == "{":
            end = text.find("}", j)
            if end < 0:
                raise PipelineError(f"unclosed '{{' after pass '{name}' in pipeline {text!r}")
            body = text[j + 1:end]
            j = end + 1
            cls = PASSES.get(name)
            known = {f.name: f.type for f in fields(cls)} if cls else {}
            for item in filter(None, (s.strip() for s in body.split(","))):
                key, eq, value = item.partition("=")
                key = key.strip()
                if not eq and key in known:
                    example = _EXAMPLES.get(key, "true")
                    raise PipelineError(f"option {key} of pass '{name}' needs a value ({key}={example})")
                if key not in known:
                    raise PipelineError(f"pass '{name}' has no option {key!r}",
                                        hint=f"options: {', '.join(sorted(known)) or 'none'}")
                kind = known[key]
                kind = "bool" if "bool" in str(kind) else ("float" if "float" in str(kind) else "int")
                options[key] = _value(value, kind, key, name)
                _check_range(key, value.strip(), options[key], name)
        if name not in PASSES:
            from nereus.ir.build import did_you_mean

            raise PipelineError(f"unknown pass {name!r} in pipeline {text!r}",
                                hint=f"{did_you_mean(name, PASSES)}passes: {', '.join(PASSES)}")
        passes.append(PASSES[name](**options))
        while j < n and text[j] in ", ":
            j += 1
        i = j
    return passes


@dataclass
class PassManager:
    pipeline: str = DEFAULT_PIPELINE
    verify_each: bool = True
    print_after_all: Optional[Callable[[str, CompileState], None]] = None
    timings: dict = field(default_factory=dict)

    def run(self, state: CompileState) -> CompileState:
        for p in parse_pipeline(self.pipeline):
            start = time.perf_counter()
            state = p.run(state)
            self.timings[p.name] = self.timings.get(p.name, 0.0) + time.perf_counter() - start
            if self.verify_each:
                p.check(state)
            if self.print_after_all is not None:
                self.print_after_all(p.name, state)
        return state
