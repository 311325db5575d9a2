"""Where the time of host_only.py's first calls goes: wall-clock seconds and call counts
of the runtime's phases (outermost calls on the main thread: no profiler overhead, and a
background compile thread is not counted), per call, for the first six calls (each
direction's cold, second and first warm call).

    python cold_phases.py OUT.json -- HOST_ONLY_ARGS...

Writes OUT.json ([{target, s, phases: {"module:function": [calls, seconds]}}]) and prints
host_only.py's own lines; its JSON summary stays the last line."""

from __future__ import annotations

import functools
import importlib
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# "module:function" or "module:Class.method", named where each is defined or, for a
# method a mixin gives the class (Runtime._lower: nereus.runtime.live_parts), where the
# class that runs it is (the wrapper is set on that class; the keys stay those of earlier runs)
PHASES = (
    "nereus.runtime.runtime:Runtime._transition", "nereus.runtime.runtime:Runtime._lower",
    "nereus.runtime.runtime:Runtime._lower_part", "nereus.runtime.distribute:obtain_rank_part",
    "nereus.runtime.distribute:_lower_own_part", "nereus.runtime.prover:Prover.result",
    "nereus.backends.proof:prove", "nereus.backends.proof:verify_before_running",
    "nereus.backends.rank_json:rank_digests", "nereus.backends.rank_json:canonical_json",
    "nereus.runtime.program:rank_program", "nereus.runtime.execution_plan:plan_for",
    "nereus.runtime.execution_plan:build_plan", "nereus.runtime.executor:execute",
    "nereus.runtime.rounds:run_round", "nereus.runtime.rounds:agree_first", "nereus.runtime.control:agree",
    "nereus.runtime.streams:exchange", "nereus.runtime.wires:allocate", "nereus.runtime.packing:copy_pairs",
    "nereus.runtime.replay:compile_pending", "nereus.backends.triton.packer:Packer._plan",
    "nereus.backends.triton.packer:Packer._build", "nereus.backends.triton.tables:upload",
)


class Clock:
    """Accumulated [calls, seconds] per phase, outermost calls on the main thread only."""

    def __init__(self):
        self.totals: dict = {}
        self.depth: dict = {}
        self.main = threading.main_thread()

    def wrap(self, name: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if threading.current_thread() is not self.main:
                return fn(*args, **kwargs)
            level = self.depth.get(name, 0)
            self.depth[name] = level + 1
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth[name] = level
                if level == 0:
                    total = self.totals.setdefault(name, [0, 0.0])
                    total[0] += 1
                    total[1] += time.perf_counter() - started
        return timed

    def install(self, phases) -> None:
        """Wrap each phase where it is defined and in every nereus module that imported it
        by name (`from .program import rank_program`)."""
        importlib.import_module("nereus.runtime.runtime")
        for phase in phases:
            module_name, attr = phase.split(":")
            module = importlib.import_module(module_name)
            owner, leaf = module, attr
            if "." in attr:
                cls, leaf = attr.split(".")
                owner = getattr(module, cls)
            original = getattr(owner, leaf)
            setattr(owner, leaf, self.wrap(phase, original))
            if owner is module:
                for other in list(sys.modules.values()):
                    if getattr(other, "__name__", "").startswith("nereus") and getattr(other, leaf, None) is original:
                        setattr(other, leaf, getattr(module, leaf))

    def since(self, before: dict) -> dict:
        return {k: [v[0] - before.get(k, [0, 0.0])[0], round(v[1] - before.get(k, [0, 0.0])[1], 4)]
                for k, v in self.totals.items() if v != before.get(k)}


def main(argv: list) -> int:
    if len(argv) < 2 or argv[1] != "--":
        sys.exit(__doc__)
    clock = Clock()
    clock.install(PHASES)
    import host_only
    from nereus.runtime import Runtime

    calls = []
    real = Runtime.transition

    def transition(self, target, **kwargs):
        before = {k: list(v) for k, v in clock.totals.items()}
        started = time.perf_counter()
        report = real(self, target, **kwargs)
        calls.append({"target": target, "s": time.perf_counter() - started, "phases": clock.since(before)})
        return report

    Runtime.transition = transition
    try:
        return host_only.main(argv[2:])
    finally:
        with open(argv[0], "w") as f:
            json.dump(calls[:6], f, indent=1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
