"""Drift simulator: replay a trace under the fixed, greedy and Nereus policies and a DP oracle.

Input: a `Trace` (trace.py). Output: {"policies": {name: summary}, "steps": per-step rows,
"transitions", "decisions" (Nereus' non-trivial decisions), "searches", "oracle"}.
Invariant: deterministic for a trace (its seed); every policy is scored on the same truth,
and the oracle's total is ≤ that of every policy that ran all steps (its plans are among the
oracle's candidates and its costs are the same numbers).

Ground truth (ground_truth.py): stage latencies composed from the measured H200 layer table,
not from the cost model. The controllers never see it: after each step they observe each
model-stage's true seconds × (1 ± `MEASUREMENT_NOISE`, seeded) and the true seconds of any
transition they made, and learn their cost model online from those alone. Policies are
scored on the noise-free truth (the same number for the same plan and workload). A true
transition takes the bytes/bandwidth estimate (transition_cost.estimated_seconds) × 1.3 ×
a seeded per-pair factor in [0.9, 1.1]; the controllers predict it with the compiler's
estimate (or the bytes estimate under method "estimate") corrected by what they measured.

Semantics, the same for every policy: it starts on the trace's plan and may move before each
step, paying the true transition time of every move, forced or chosen. Before step i a
controller knows step i's GPU budget and the configured prompt and batch, but only the
responses of steps < i (the .nir workload's response before step 0): a step's responses are
generated during it. If the step's own response then does not fit the plan it chose, the
attempt fails (counted in `failed_attempts`, its seconds not charged), the controller decides
again knowing the response (it must move) and the step runs again. A policy whose plan cannot
run a step (memory, or GPUs no longer there) and that does not move is marked failed at that
step (`failed_at`) and runs no later step (`steps_run`).
  fixed   the initial plan's TP/PP per model-stage; DP rescaled when the GPU count changes
          (a move it pays for); otherwise it never moves, so it fails where its plan stops fitting
  greedy  moves whenever its calibrated model predicts any faster plan for the step's own
          workload (no margin, no confidence, no confirmation)
  nereus  the admission rule (admission.py) at the workload level (controller.py)
  oracle  `oracle.dp_oracle` over the candidate set C = every plan a policy ran ∪ the plan
          search's optimum under the truth (the same search the controllers run, with the
          truth as its cost model) on a geometric grid of responses, ratio `oracle_grid`, per
          GPU budget: the least total time of any plan sequence from C, transitions included
Summaries: `mean_step_s`, `total_s` (steps + transitions) over the steps a policy ran, and
`common_mean_step_s`, `common_total_s` over the steps every policy ran (`common_steps`: none
when a policy failed at step 0); `failed_why` says why a failed policy could not run its step.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np

from nereus.ir.model import Module, Plan, Workload

from .admission import AdmissionSettings
from .controller import Controller, PlanPrediction, plan_key, predict_plan
from .ground_truth import GroundTruth, LayerTable
from .memory import plan_memory
from .oracle import dp_oracle
from .search import build_plan, search_plan
from .trace import Trace, TraceError, TraceStep, load_trace  # noqa: F401 - re-exported
from .transition_cost import estimated_seconds

POLICIES = ("fixed", "greedy", "nereus", "oracle")
MEASUREMENT_NOISE = 0.03
TRUE_TRANSITION_FACTOR = 1.3
TRANSITION_JITTER = 0.1

Progress = Callable[[str, int, int], None]  # (phase, done, total)


def scaled_plan(module: Module, initial: Plan, gpus: int, name: str = "fixed") -> Optional[Plan]:
    """The initial plan's TP/PP/EP, ZeRO stage and offload per model-stage with DP scaled to
    `gpus` (lowest ids); None when some model-stage's TP x PP x EP needs more than `gpus`
    GPUs (the fixed policy cannot run there)."""
    from nereus.ir.gpuset import items_for

    from .search import Choice

    if any(p.tp * p.pp * p.ep > gpus for p in initial.placements):
        return None
    choices = {}
    for p in initial.placements:
        dp = max(1, gpus // (p.tp * p.pp * p.ep))
        choices[p.model_stage] = Choice(p.model_stage, dp, p.tp, p.pp, p.offload, p.zero, p.ep)
    plan = build_plan(module, choices, gpus, name)
    # build_plan places every unit on 0..gpus−1; trim to the world each unit actually uses
    placements = tuple(replace(p, gpus=p.gpus[: p.world], gpu_set=()) for p in plan.placements)
    placements = tuple(replace(p, gpu_set=items_for(p.gpus)) for p in placements)
    return Plan(name, None, placements, placements)


class _World:
    """The simulated job: a registry of plans (by key) and their true step and move costs."""

    def __init__(self, trace: Trace, table: LayerTable):
        self.module = trace.module
        self.seed = trace.seed
        self.truth = GroundTruth(trace.module, table)
        self.plans: list[Plan] = []
        self.keys: list[tuple] = []
        self.top: list[int] = []  # highest GPU id a plan uses
        self._index: dict = {}
        self._steps: dict = {}
        self._moves: dict = {}

    def add(self, plan: Plan) -> int:
        key = plan_key(plan)
        if key not in self._index:
            self._index[key] = len(self.plans)
            self.plans.append(plan)
            self.keys.append(key)
            self.top.append(max(g for p in plan.placements for g in p.gpus))
        return self._index[key]

    def step(self, index: int, workload: Workload, gpus: int) -> Optional[PlanPrediction]:
        """True (noise-free) latency of plan `index` at `workload`; None if it cannot run."""
        if self.top[index] >= gpus:
            return None
        key = (index, workload)
        got = self._steps.get(key)
        if got is None:
            got = predict_plan(self.module, workload, self.truth, self.plans[index])
            self._steps[key] = got
        return got if got.feasible else None

    def why_not(self, index: int, workload: Workload, gpus: int) -> str:
        """Why plan `index` cannot run a step of `workload` on GPUs 0..gpus−1 (after `step`
        said it cannot)."""
        if self.top[index] >= gpus:
            return f"its plan uses GPU {self.top[index]} and the step has GPUs 0..{gpus - 1}"
        memory = plan_memory(self.module, workload, self.plans[index])
        return f"its plan does not fit (response {workload.response}): {memory.why_not()}"

    def move(self, source: int, target: int) -> float:
        """True seconds of source → target: fixed per pair (seeded), 0 when they are equal."""
        if source == target:
            return 0.0
        pair = (source, target)
        if pair not in self._moves:
            base = estimated_seconds(self.module, self.module.workload, self.plans[source], self.plans[target])
            digest = hashlib.sha256(repr((self.seed, self.keys[source], self.keys[target])).encode()).digest()
            unit = int.from_bytes(digest[:8], "big") / 2 ** 64
            self._moves[pair] = base * TRUE_TRANSITION_FACTOR * (1.0 + TRANSITION_JITTER * (2 * unit - 1))
        return self._moves[pair]


@dataclass
class _Run:
    name: str
    plan: int  # index in the world's registry
    latencies: list = field(default_factory=list)  # true seconds of each step run
    path: list = field(default_factory=list)  # plan index of each step run
    transitions: list = field(default_factory=list)  # (step, seconds, why)
    failed_at: Optional[int] = None
    failed_why: str = ""  # why it could not run step `failed_at`
    overhead_s: list = field(default_factory=list)  # controller wall seconds per step (decide + observe)
    overhead_cpu_s: list = field(default_factory=list)  # the same in CPU seconds of this thread
    searches: int = 0
    transition_cpu_s: float = 0.0  # of the controller's CPU time: estimating (compiling) transitions
    failed_attempts: int = 0  # steps whose response overflowed the plan chosen before it was known

    def summary(self, common: int) -> dict:
        run, spent = sum(self.latencies), sum(s for _, s, _ in self.transitions)
        steps = len(self.latencies)
        shared = sum(self.latencies[:common]) + sum(s for i, s, _ in self.transitions if i < common)
        out = {"steps_run": steps, "failed_at": self.failed_at, "failed_why": self.failed_why or None,
               "mean_step_s": run / steps if steps else None, "total_s": run + spent,
               "transitions": len(self.transitions), "transition_s": spent,
               "transition_share": spent / (run + spent) if run + spent else 0.0,
               "common_steps": common, "common_mean_step_s": sum(self.latencies[:common]) / common if common else None,
               "common_total_s": shared, "failed_attempts": self.failed_attempts}
        if self.overhead_s:
            # CPU time of the controller's thread: what it costs, whatever else loads the machine
            ms = 1e3 * np.array(self.overhead_cpu_s)
            out.update(controller_ms_per_step=float(ms.mean()), controller_ms_median=float(np.median(ms)),
                       controller_ms_p99=float(np.percentile(ms, 99)), controller_ms_max=float(ms.max()),
                       controller_wall_ms_per_step=1e3 * float(np.mean(self.overhead_s)), searches=self.searches,
                       controller_transition_ms_per_step=1e3 * self.transition_cpu_s / len(ms))
        return out


def _mover(world: _World, run: _Run, controller: Optional[Controller], step: int):
    """move(target, why, workload): charge `run` the true seconds of moving to `target` and
    tell its controller what the move took (nothing when the target is the current plan)."""
    def move(target: int, why: str, workload: Workload) -> None:
        if target == run.plan:
            return
        seconds = world.move(run.plan, target)
        run.transitions.append((step, seconds, why))
        if controller is not None:  # the controller's own work: counted in its overhead
            began, cpu = time.perf_counter(), time.thread_time()
            predicted = controller.transition_estimate(workload, world.plans[run.plan], world.plans[target])
            controller.transitioned(world.plans[target], seconds, predicted, step=step)
            run.overhead_s[-1] += time.perf_counter() - began
            run.overhead_cpu_s[-1] += time.thread_time() - cpu
        run.plan = target

    return move


# the oracle's searches between each (GPUs, prompt, batch) group's shortest and longest
# response: more points than this is a grid finer than any use
MAX_ORACLE_POINTS = 4096


def _grid_size(lo: int, hi: int, grid: float) -> int:
    """How many responses the grid of ratio 1 + `grid` puts in [lo, hi], at most every
    integer there (a non-finite count, a grid that underflows: every integer)."""
    if hi == lo:
        return 1
    ratio = math.log1p(grid)
    steps = math.log(hi / lo) / ratio if ratio > 0 else math.inf
    return hi - lo + 1 if not math.isfinite(steps) or steps + 1 >= hi - lo + 1 else 1 + math.ceil(steps)


def oracle_points(trace: Trace, grid: float) -> list:
    """[(gpus, workload)] the oracle searches: per (GPUs, prompt, batch) group of the trace,
    its shortest and longest response and a geometric grid of ratio 1 + `grid` between
    them, each integer response once. Raises ValueError, before any point is made, when
    the grid puts more than MAX_ORACLE_POINTS responses between the groups' ends (naming
    the finest grid within that); the ends themselves are never refused."""
    spans: dict = {}
    for step in trace.steps:
        key = (step.gpus, step.prompt, step.batch)
        lo, hi = spans.get(key, (step.response, step.response))
        spans[key] = (min(lo, step.response), max(hi, step.response))
    sizes = {key: _grid_size(lo, hi, grid) for key, (lo, hi) in spans.items()}
    inner = sum(max(0, size - 2) for size in sizes.values())  # beyond each group's two ends
    if inner > MAX_ORACLE_POINTS:
        spread = sum(math.log(hi / lo) for lo, hi in spans.values() if hi > lo)
        finest = math.expm1(spread / MAX_ORACLE_POINTS)
        raise ValueError(f"a grid of {grid:g} puts {inner} oracle searches between the trace's shortest and "
                         f"longest responses (at most {MAX_ORACLE_POINTS}); use {finest:.2g} or more")
    points = []
    for (gpus, prompt, batch), (lo, hi) in spans.items():
        size = sizes[(gpus, prompt, batch)]
        if size == hi - lo + 1:
            responses = range(lo, hi + 1)
        else:  # size <= MAX_ORACLE_POINTS + 2 here: the loop is short
            responses = sorted({min(hi, round(lo * (1.0 + grid) ** k)) for k in range(size)} | {hi})
        points += [(gpus, trace.workload(TraceStep(response, gpus, prompt, batch))) for response in responses]
    return points


def _oracle_candidates(world: _World, trace: Trace, grid: float, progress: Optional[Progress]) -> None:
    """Add the search's optimum under the truth on the oracle's response grid (`oracle_points`)."""
    points = oracle_points(trace, grid)
    for done, (gpus, workload) in enumerate(points):
        found = search_plan(world.module, workload, world.truth, gpus, name="oracle")
        if found.plan is not None:
            world.add(found.plan)
        if progress:
            progress("oracle search", done + 1, len(points))


def _oracle(world: _World, trace: Trace, start: int, progress: Optional[Progress]):
    count, steps = len(world.plans), len(trace.steps)
    step_s = np.full((steps, count), math.inf)
    for t, step in enumerate(trace.steps):
        workload = trace.workload(step)
        for c in range(count):
            got = world.step(c, workload, step.gpus)
            if got is not None:
                step_s[t, c] = got.step_s
        if progress and ((t + 1) % 50 == 0 or t + 1 == steps):
            progress("oracle table", t + 1, steps)
    moves = np.array([[world.move(a, b) for b in range(count)] for a in range(count)])
    best = dp_oracle(step_s, moves, start)
    if best.failed_at is not None and best.failed_at > 0:
        # no candidate runs step `failed_at`: the oracle still runs the steps before it, at best
        best = replace(dp_oracle(step_s[:best.failed_at], moves, start), failed_at=best.failed_at)
    return best, step_s


def simulate(trace: Trace, margin: float = 0.1, policies=POLICIES, transition_method: str = "compile",
             oracle_grid: float = 0.05, table: Optional[LayerTable] = None,
             progress: Optional[Progress] = None) -> dict:
    """Replay `trace` under `policies` (module docstring). `progress(phase, done, total)` is
    called as the replay and the oracle advance."""
    module = trace.module
    world = _World(trace, table or LayerTable.load())
    initial = module.plan(trace.plan)
    start = world.add(initial)
    noise = random.Random(trace.seed + 1)
    total = len(trace.steps)
    runs = {name: _Run(name, start) for name in policies if name != "oracle"}
    controllers = {}
    for name in runs:
        if name in ("greedy", "nereus"):
            controllers[name] = Controller(module, initial, total, AdmissionSettings(margin=margin),
                                           greedy=(name == "greedy"), transition_method=transition_method,
                                           level_window=1 if name == "greedy" else Controller.level_window)
    rows = []
    last_gpus = trace.steps[0].gpus
    observed = module.workload.response  # before step 0: the response the job was configured for
    for i, step in enumerate(trace.steps):
        workload = trace.workload(step)
        # what a controller knows before the step: the GPU budget and the configured prompt and
        # batch, but only the responses of earlier steps (this one's is generated during it)
        known = trace.workload(replace(step, response=observed))
        row = {"step": i, "response": step.response, "gpus": step.gpus}
        for name, run in runs.items():
            row[name] = None
            if run.failed_at is not None:
                continue
            target, why = run.plan, ""
            controller = controllers.get(name)
            if controller is None:  # fixed: rescale DP when the GPU count changes, nothing else
                if step.gpus != last_gpus or world.top[run.plan] >= step.gpus:
                    scaled = scaled_plan(module, initial, step.gpus)
                    if scaled is None:  # fewer GPUs than one replica of some model-stage
                        run.failed_at = i
                        run.failed_why = (f"the step has {step.gpus} GPUs, fewer than one replica of a model-stage "
                                          f"of plan {initial.name} needs")
                        continue
                    target, why = world.add(scaled), f"rescale DP to {step.gpus} GPUs"
            else:
                began, cpu = time.perf_counter(), time.thread_time()
                decision = controller.decide(i, known, step.gpus)
                run.overhead_s.append(time.perf_counter() - began)
                run.overhead_cpu_s.append(time.thread_time() - cpu)
                if decision.switch:
                    target, why = world.add(decision.plan), decision.why
            move = _mover(world, run, controller, i)
            move(target, why, known)
            got = world.step(run.plan, workload, step.gpus)
            if got is None and controller is not None:
                # the step's own response did not fit the plan chosen without it: the attempt
                # fails (its seconds are not charged; `failed_attempts` counts it), the
                # controller now knows the response and must move, and the step runs again
                run.failed_attempts += 1
                began, cpu = time.perf_counter(), time.thread_time()
                decision = controller.decide(i, workload, step.gpus, after_failure=True)
                run.overhead_s[-1] += time.perf_counter() - began
                run.overhead_cpu_s[-1] += time.thread_time() - cpu
                if decision.switch:
                    move(world.add(decision.plan), decision.why, workload)
                got = world.step(run.plan, workload, step.gpus)
            if got is None:
                run.failed_at = i
                run.failed_why = world.why_not(run.plan, workload, step.gpus)
                if controller is not None:
                    run.failed_why += ", and its search found no plan that does"
                continue
            run.latencies.append(got.step_s)
            run.path.append(run.plan)
            row[name] = got.step_s
            if controller is not None:
                began, cpu = time.perf_counter(), time.thread_time()
                plan = world.plans[run.plan]
                for ms, seconds in got.stage_seconds.items():
                    controller.observe(ms, plan, workload, seconds * (1.0 + MEASUREMENT_NOISE * (2 * noise.random() - 1)))
                controller.observe_step(got.step_s * (1.0 + MEASUREMENT_NOISE * (2 * noise.random() - 1)))
                run.overhead_s[-1] += time.perf_counter() - began
                run.overhead_cpu_s[-1] += time.thread_time() - cpu
        last_gpus, observed = step.gpus, step.response
        rows.append(row)
        if progress and ((i + 1) % 20 == 0 or i + 1 == total):
            progress("replay", i + 1, total)
    for name, controller in controllers.items():
        runs[name].searches = controller.searches
        runs[name].transition_cpu_s = controller.transition_cpu_s
    common = min([run.failed_at for run in runs.values() if run.failed_at is not None] + [total])
    summary = {name: run.summary(common) for name, run in runs.items()}
    oracle_info = None
    if "oracle" in policies:
        _oracle_candidates(world, trace, oracle_grid, progress)
        best, _ = _oracle(world, trace, start, progress)
        run = _Run("oracle", start, failed_at=best.failed_at,
                   failed_why="no plan of its candidates fits the step" if best.failed_at is not None else "")
        previous = start
        for t, c in enumerate(best.path):  # up to the step no candidate runs, if any
            if c != previous:
                run.transitions.append((t, world.move(previous, c), "hindsight"))
            run.latencies.append(world.step(c, trace.workload(trace.steps[t]), trace.steps[t].gpus).step_s)
            rows[t]["oracle"] = run.latencies[-1]
            previous = c
        summary["oracle"] = run.summary(common)
        # total_s: over the steps the oracle ran (all of them unless `failed_at`)
        oracle_info = {"candidates": len(world.plans), "total_s": summary["oracle"]["total_s"],
                       "failed_at": best.failed_at, "grid": oracle_grid}
        runs["oracle"] = run
        for name, s in summary.items():
            s["gap_to_oracle"] = s["total_s"] / best.total_s - 1 if s["failed_at"] is None and \
                best.failed_at is None and best.total_s > 0 else None
    decisions = controllers["nereus"].log if "nereus" in controllers else []
    return {"policies": summary, "steps": rows,
            "transitions": {name: [{"step": s, "seconds": t, "why": w} for s, t, w in run.transitions]
                            for name, run in runs.items()},
            "failed_at": {name: run.failed_at for name, run in runs.items()},
            "decisions": [d.to_json() for d in decisions if d.switch or d.reason not in ("no-gain",)],
            "searches": {name: c.searches for name, c in controllers.items()}, "oracle": oracle_info}
