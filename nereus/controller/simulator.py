"""Drift simulator: replay a trace of workloads and GPU budgets under four policies.

A trace (JSON): {"nir": path relative to the trace, "plan": initial plan name,
"steps": [{"response": n, "gpus": g, "prompt"?: n, "batch"?: n}, ...], "seed"?: s}.
GPUs available at a step are ids 0..g−1 (whole nodes).

Ground truth: the simulated job's latencies come from the same stage formulas with hidden
coefficients θ* = prior × a seeded log-normal factor per model-stage and term (σ = 0.25),
and each measurement carries ±2% seeded noise; transitions take the compiler's estimate ×
a hidden factor (1.3) with ±10% noise. The controllers never see θ*: they start from the
prior and calibrate on what they observe, as in a real job.

Policies (each pays the true transition time whenever it changes plan):
  fixed   the initial plan's TP/PP per model-stage, DP scaled to the GPUs available
  greedy  switch whenever the calibrated model predicts any faster plan
  nereus  payback admission (admission.py) with the given margin
  oracle  the best plan per step under the true coefficients, transitions free; "best" is
          approximate: the search reruns when the response drifts by > 1%, and each step takes
          the best of the last three winners and of every plan another policy runs then, so a
          policy can come out marginally below it (a winner at the edge of a KV-wave cliff)
Per-step latencies reported are the true (noise-free) ones, so policies compare fairly.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from nereus.ir.diagnostics import NereusError
from nereus.ir.model import Module, Plan, Workload

from .admission import AdmissionSettings
from .controller import Controller, plan_key, predict_plan
from .cost_model import PRIOR, TERMS, CostModel
from .search import build_plan, search_plan
from .transition_cost import transition_seconds

POLICIES = ("fixed", "greedy", "nereus", "oracle")
TRUE_TRANSITION_FACTOR = 1.3


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


def true_theta(module: Module, seed: int) -> dict:
    """Hidden coefficients of the simulated job: prior × log-normal(0, 0.25) per term."""
    rng = np.random.default_rng(seed)
    out = {}
    for ms in module.workload.model_stages():
        factors = np.exp(rng.normal(0.0, 0.25, len(TERMS)))
        theta = PRIOR * factors
        theta[TERMS.index("fixed")] = 0.5 * rng.random()  # a small per-stage constant the prior lacks
        out[str(ms)] = theta
    return out


def scaled_plan(module: Module, initial: Plan, gpus: int, name: str = "fixed") -> Plan:
    """The initial plan's TP/PP per model-stage with DP scaled to `gpus` (lowest ids)."""
    from .search import Choice

    choices = {}
    for p in initial.placements:
        dp = max(1, gpus // (p.tp * p.pp))
        choices[p.model_stage] = Choice(p.model_stage, dp, p.tp, p.pp, p.offload)
    plan = build_plan(module, choices, gpus, name)
    # build_plan places every unit on 0..gpus−1; trim to the world each unit actually uses
    placements = tuple(replace(p, gpus=p.gpus[: p.world], gpu_set=()) for p in plan.placements)
    from nereus.ir.gpuset import items_for

    placements = tuple(replace(p, gpu_set=items_for(p.gpus)) for p in placements)
    return Plan(name, None, placements, placements)


@dataclass
class PolicyRun:
    name: str
    latencies: list = field(default_factory=list)  # true seconds per step (inf if infeasible)
    transitions: list = field(default_factory=list)  # (step, seconds, why)
    infeasible_steps: int = 0
    overhead_s: list = field(default_factory=list)  # controller seconds per step (observe + decide)

    def summary(self, best: list) -> dict:
        finite = [x for x in self.latencies if math.isfinite(x)]
        run = sum(finite)
        spent = sum(s for _, s, _ in self.transitions)
        gaps = [x / b - 1 for x, b in zip(self.latencies, best) if math.isfinite(x) and b > 0]
        out = {"mean_step_s": run / max(1, len(finite)), "transitions": len(self.transitions),
               "transition_s": spent, "transition_share": spent / (run + spent) if run + spent else 0.0,
               "mean_gap_to_best": float(np.mean(gaps)) if gaps else None, "infeasible_steps": self.infeasible_steps}
        if self.overhead_s:
            out["controller_ms_per_step"] = 1e3 * float(np.mean(self.overhead_s))
            out["controller_ms_median"] = 1e3 * float(np.median(self.overhead_s))
        return out


class _Truth:
    def __init__(self, trace: Trace, transition_method: str):
        self.trace = trace
        self.module = trace.module
        self.cost = CostModel(trace.module, fixed_theta=true_theta(trace.module, trace.seed))
        self.rng = random.Random(trace.seed)
        self.transition_method = transition_method
        self._transitions: dict = {}

    def step(self, plan: Plan, workload: Workload, gpus: int):
        return predict_plan(self.module, workload, self.cost, plan, gpus)

    def transition(self, workload: Workload, source: Plan, target: Plan) -> float:
        key = (plan_key(source), plan_key(target))
        if key not in self._transitions:
            base = transition_seconds(self.module, workload, source, target, self.transition_method)[0]
            self._transitions[key] = base * TRUE_TRANSITION_FACTOR
        return self._transitions[key] * (1.0 + 0.1 * (2 * self.rng.random() - 1))


def simulate(trace: Trace, margin: float = 0.1, policies=POLICIES, transition_method: str = "compile",
             oracle_tolerance: float = 0.01) -> dict:
    """Replay `trace` under `policies`. Output: {"policies": {name: summary}, "steps": per-step
    rows, "decisions": Nereus' decision log (why it switched or stayed)}. Deterministic for a
    trace (its seed)."""
    module = trace.module
    initial = module.plan(trace.plan)
    runs = {name: PolicyRun(name) for name in policies}
    truth = _Truth(trace, transition_method)
    noise = random.Random(trace.seed + 1)
    total = len(trace.steps)
    controllers = {}
    current = {}
    for name in policies:
        current[name] = initial
        if name in ("greedy", "nereus"):
            settings = AdmissionSettings(margin=margin)
            controllers[name] = Controller(module, initial, total, settings, greedy=(name == "greedy"),
                                           transition_method=transition_method)
    last_gpus: dict = {}
    oracle_plans: list[Plan] = []
    oracle_key = None
    best_per_step = []
    rows = []
    for i, step in enumerate(trace.steps):
        workload = trace.workload(step)
        # oracle: search under the true coefficients when the workload drifted, keep recent winners
        key = (step.gpus, step.batch, step.prompt)
        if oracle_key is None or oracle_key[0] != key or abs(oracle_key[1] - step.response) > oracle_tolerance * step.response:
            found = search_plan(module, workload, truth.cost, step.gpus, name="oracle")
            if found.plan is not None:
                oracle_plans = ([found.plan] + oracle_plans)[:3]
            oracle_key = (key, step.response)
        best = math.inf
        # hindsight: the recent searches' winners and every plan another policy runs now
        for plan in oracle_plans + [current[name] for name in policies if name != "oracle"]:
            got = truth.step(plan, workload, step.gpus)
            if got.feasible and got.step_s < best:
                best = got.step_s
        best_per_step.append(best)
        row = {"step": i, "response": step.response, "gpus": step.gpus, "best_s": best}
        for name in policies:
            run = runs[name]
            if name == "oracle":
                run.latencies.append(best)
                row[name] = best
                continue
            plan = current[name]
            began = time.perf_counter()
            if name == "fixed":
                fits = all(g < step.gpus for p in plan.placements for g in p.gpus)
                if step.gpus != last_gpus.get(name, step.gpus) or not fits:
                    wanted = scaled_plan(module, initial, step.gpus)
                    if plan_key(wanted) != plan_key(plan):
                        seconds = truth.transition(workload, plan, wanted)
                        run.transitions.append((i, seconds, f"rescale DP to {step.gpus} GPUs"))
                        current[name] = plan = wanted
                last_gpus[name] = step.gpus
            else:
                controller = controllers[name]
                decision = controller.decide(i, workload, step.gpus)
                run.overhead_s.append(time.perf_counter() - began)
                if decision.switch:
                    seconds = truth.transition(workload, plan, decision.plan)
                    predicted = controller.transition_estimate(workload, plan, decision.plan)
                    controller.transitioned(decision.plan, seconds, predicted, step=i)
                    run.transitions.append((i, seconds, decision.why))
                    current[name] = plan = decision.plan
            got = truth.step(plan, workload, step.gpus)
            # an infeasible step would run out of memory; its latency is still reported (as
            # if memory allowed) and counted in infeasible_steps, so no policy hides behind it
            latency = got.step_s
            if not got.feasible:
                run.infeasible_steps += 1
            run.latencies.append(latency)
            row[name] = latency
            if name in controllers:
                began = time.perf_counter()
                controller = controllers[name]
                for ms, seconds in got.stage_seconds.items():
                    controller.observe(ms, plan, workload, seconds * (1.0 + 0.02 * (2 * noise.random() - 1)))
                controller.observe_step(sum(got.stage_seconds.values()))
                run.overhead_s[-1] += time.perf_counter() - began
        rows.append(row)
    summary = {name: run.summary(best_per_step) for name, run in runs.items()}
    decisions = controllers["nereus"].log if "nereus" in controllers else []
    return {"policies": summary, "steps": rows,
            "transitions": {name: [{"step": s, "seconds": t, "why": w} for s, t, w in run.transitions]
                            for name, run in runs.items()},
            "decisions": [d.to_json() for d in decisions if d.switch or d.reason not in ("no-gain",)],
            "searches": {name: c.searches for name, c in controllers.items()}}
