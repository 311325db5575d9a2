"""Controller-driven transitions for the RL loop (`nereus train --controller`).

Rank 0 feeds the Nereus controller (nereus.controller.Controller) the step's
measured per-model-stage seconds, asks it at each step boundary whether to move, and
broadcasts the answer, so every rank enters the collective `transition` together (the
ranks' own timings differ, their decisions must not).

The controller searches plans of its own; the runtime moves only between plans the
`.nir` declares (the compiler checked them). So this loop restricts the controller's
choice to the declared plans that this loop can run: `DeclaredPlans.best_plan` ranks them
by the controller's calibrated prediction, and the admission rule is the controller's.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch.distributed as dist

from nereus.ir.model import Module, Plan, Workload
from nereus.controller.controller import Controller, predict_plan
from nereus.controller.search import SearchResult


class DeclaredPlans(Controller):
    """The Nereus controller whose plan search is the list of declared, runnable plans."""

    runnable: tuple = ()

    def best_plan(self, workload: Workload, gpus: int, longest: int = 0) -> SearchResult:
        started = time.perf_counter()
        best: Optional[tuple[Plan, object]] = None
        candidates = [p for p in self.module.plans if not self.runnable or p.name in self.runnable]
        for plan in candidates:
            prediction = self._predict(plan, workload, gpus)
            if prediction.feasible and (best is None or prediction.step_s < best[1].step_s):
                best = (plan, prediction)
        if best is None:
            return SearchResult(None, math.inf, {}, {}, len(candidates), len(candidates), time.perf_counter() - started)
        return SearchResult(best[0], best[1].step_s, best[1].stage_seconds, best[1].waves, len(candidates),
                            len(candidates), time.perf_counter() - started)


class ControllerPolicy:
    """Observe → decide → (maybe) name a plan, the same on every rank."""

    def __init__(self, module: Module, plan: str, total_steps: int, runnable: tuple[str, ...]):
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.controller = None
        if self.rank == 0:
            # the loop numbers steps 1..N and the controller counts the steps still to run
            # from the one it decides before (total − step, 0-based): one more total keeps the
            # loop's numbers and counts that step itself
            self.controller = DeclaredPlans(module, module.plan(plan), total_steps + 1)
            self.controller.runnable = runnable
        self.decisions: list[dict] = []
        self._checked: dict = {}  # last step's predicted vs measured seconds, sent with the next decision
        self._moved: Optional[dict] = None  # the last transition's predicted vs measured seconds

    def observe(self, module: Module, plan: str, workload: Workload, stage_seconds: dict, step_seconds: float) -> None:
        if self.controller is None:
            return
        self.controller.module = module
        # the model's one-step-ahead prediction of what was just measured (before it learns
        # from it), reported with the next decision: its error is the cost model's real error
        predicted = predict_plan(module, workload, self.controller.cost, module.plan(plan))
        self._checked = {"plan": plan, "predicted_stage_s": predicted.stage_seconds, "predicted_step_s": predicted.step_s,
                         "measured_stage_s": dict(stage_seconds), "measured_step_s": step_seconds}
        if self._moved is not None:  # the move made before this step, reported once
            self._checked["transition"], self._moved = self._moved, None
        for ms, seconds in stage_seconds.items():
            self.controller.observe(ms, module.plan(plan), workload, seconds)
        self.controller.observe_step(step_seconds)

    def decide(self, step: int, workload: Workload, gpus: int) -> Optional[str]:
        """The plan to move to before `step` (the loop's number, 1..N), or None; collective
        (rank 0 decides)."""
        box: list = [None]
        if self.controller is not None:
            decision = self.controller.decide(step, workload, gpus)
            record = decision.to_json()
            target = decision.plan.name if decision.switch and decision.plan is not None else None
            if target == self.controller.plan.name:
                target = None
            record["target"] = target
            record.update(self._checked)
            box[0] = record
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        self.decisions.append(box[0])
        return box[0]["target"]

    def transitioned(self, module: Module, plan: str, seconds: float, step: int) -> None:
        """The loop moved to `plan` before `step` (its number, as `decide` took it)."""
        if self.controller is not None:
            # the estimate of this very move (a scripted event may differ from the decision's
            # candidate), uncorrected, as the controller's measured/predicted ratio expects
            source = self.controller.plan
            predicted = self.controller.transition_estimate(module.workload, source, module.plan(plan))
            self._moved = {"from": source.name, "to": plan, "measured_s": seconds,
                           "predicted_s": predicted * self.controller.correction}
            self.controller.transitioned(module.plan(plan), seconds, predicted, step)
