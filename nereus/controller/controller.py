"""The controller: at each step boundary, observe, then decide whether to change plans.

    ctl = Controller(module, module.plan("S1"), total_steps=1000)
    ctl.observe("actor.generation", plan, workload, 41.7)     # per model-stage timings
    decision = ctl.decide(step, workload, gpus=64)            # Decision, logged in ctl.log
    if decision.switch:
        report = rt.transition(...)                           # the runtime moves the state
        ctl.transitioned(decision.plan, seconds=report_seconds)

Cheap per step: the plan search runs only when the GPU budget changes, the workload drifts
by more than `research_tolerance` since the last search, `refit_every` new observations
have changed the cost model, or the model has changed since the last search `trial_steps`
decisions after a move (after a forced move also 2×, 4×, ... as many); otherwise decide() re-predicts two cached plans (current and
candidate) and applies the admission rule. Transition costs are cached per plan pair.

Noise: decisions are judged at the workload *level* — a robust line through the last
`level_window` responses — so one long step neither triggers a search nor flips a plan, while
feasibility is judged on the step's own workload (a plan that cannot run the next step
forces a move). The admission rule (admission.py) adds a confidence term σ on the gain and
a confirmation over consecutive decisions.
A forced move's target is the search's pick, admitted against nothing; until the next move,
a correction of that pick is not held back by the tie threshold (`admission_settings`).
"""

from __future__ import annotations

import math
import numbers
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from nereus.ir.diagnostics import SettingError
from nereus.ir.model import ModelStage, Module, Plan, Workload

from .admission import AdmissionSettings, Decision, admit, gain_sigma
from .cost_model import CostModel, layout_of, step_seconds, workload_key
from .memory import PlanMemory, plan_memory
from .search import SearchResult, search_plan
from .transition_cost import transition_seconds


@dataclass(frozen=True)
class PlanPrediction:
    feasible: bool
    step_s: float
    stage_seconds: dict  # str(ms) -> seconds
    waves: dict  # str(ms) -> waves


LEVEL_GRID = math.log(1.01)
# the greedy baseline: any faster plan, whatever the move costs; a relative gain below one
# part per million is float noise between two equal predictions, not a faster plan (greedy
# "switched (faster)" between times that printed equal)
GREEDY_SETTINGS = AdmissionSettings(margin=0.0, z=0.0, rho_min=1e-6, min_interval=0, confirm=1)
_STAYS_AT_ANY_COST = ("no-gain", "below-min-gain", "no-payback")  # admission reasons independent of Ĉ > 0
SPREAD_QUANTILES = (12.5, 37.5, 62.5, 87.5)  # a 4-point rule for the mean over recent residuals


def _on_grid(response: float) -> int:
    """The nearest point of a 1% geometric grid (whole tokens): the level moves a little every
    step, and on the grid its memory and cost terms are computed once per 1% of drift."""
    return max(1, int(round(math.exp(round(math.log(max(response, 1.0)) / LEVEL_GRID) * LEVEL_GRID))))


def plan_key(plan: Plan) -> tuple:
    return tuple((str(p.model_stage), p.dp, p.tp, p.pp, p.offload, p.gpus, p.zero, p.ep) for p in plan.placements)


def predict_plan(module: Module, workload: Workload, cost: CostModel, plan: Plan, gpus: Optional[int] = None,
                 allow_waves: bool = True, memory: Optional[PlanMemory] = None) -> PlanPrediction:
    """Predicted step latency of any plan under `workload`; infeasible when it does not fit
    or uses a GPU id ≥ `gpus` (a GPU no longer available). `memory`: the plan's
    `plan_memory` under `workload` when the caller has it (it does not depend on the cost)."""
    if memory is None:
        memory = plan_memory(module, workload, plan, allow_waves)
    out_of_budget = gpus is not None and any(g >= gpus for p in plan.placements for g in p.gpus)
    times = {}
    for placement in plan.placements:
        waves = memory.waves.get(placement.model_stage, 1)
        times[placement.model_stage] = cost.predict(workload, placement.model_stage, layout_of(module, placement, waves))
    feasible = memory.feasible and not out_of_budget
    return PlanPrediction(feasible, step_seconds(module, plan, times), {str(k): v for k, v in times.items()},
                          {str(k): v for k, v in memory.waves.items()})


def _check_seconds(seconds, what: str, zero: bool = False) -> None:
    """A measured time is finite and positive (0 too where `zero`: a model-stage that ran
    nothing, which the cost model skips); else a SettingError naming the call."""
    number = isinstance(seconds, numbers.Real) and not isinstance(seconds, bool)
    if not (number and (seconds >= 0 if zero else seconds > 0) and seconds < math.inf):
        from nereus.ir.diagnostics import SettingError

        raise SettingError(f"{what}: {seconds!r} is not a measured time (finite seconds "
                           f"{'≥' if zero else '>'} 0)",
                           hint="pass the step's wall seconds, e.g. time.perf_counter() differences")


@dataclass
class Controller:
    module: Module
    plan: Plan
    total_steps: int
    settings: AdmissionSettings = field(default_factory=AdmissionSettings)
    greedy: bool = False  # switch to any faster plan, ignoring transition cost (a baseline)
    transition_method: str = "compile"
    allow_waves: bool = True
    research_tolerance: float = 0.05
    # search for a response this much longer than the current one: a plan chosen at the
    # edge of its KV capacity needs one more generation wave at the next longer step (a
    # ~30% cliff on the length-growth trace), so candidates keep some headroom
    headroom: float = 0.05
    refit_every: int = 100  # steps: re-search at least this often once the cost model has changed
    level_window: int = 16  # responses the workload level is fitted to (1: the step's own)
    # a forced move's candidates: the best plans for these shares above the longest recent
    # response; the one of least step time plus its move spread over the steps it will run
    # before the trend outgrows it (`forced_target`)
    forced_headrooms: tuple = (0.05, 0.1, 0.2, 0.4, 0.8)
    cost: Optional[CostModel] = None
    log: list = field(default_factory=list)

    def __post_init__(self):
        if type(self.total_steps) is not int or self.total_steps < 1:
            # 0 or fewer: no decision could ever pay back, and none said why
            raise SettingError(f"Controller total_steps={self.total_steps!r}: must be a whole number ≥ 1",
                               hint="the steps the run will take in all (the payback horizon counts down from it)")
        if self.cost is None:
            self.cost = CostModel(self.module)
        self._search: Optional[SearchResult] = None
        self._search_key = None
        self._search_version = -1
        self._search_workload: Optional[Workload] = None
        self._transition_cache: dict = {}
        self._correction: list[tuple[float, float]] = []  # (predicted, measured)
        self._last_switch = -(1 << 30)
        self._step_times: list[float] = []
        self._prediction_cache: dict = {}
        self._memory_cache: dict = {}  # (plan key, workload key) -> PlanMemory
        self._search_memo: dict = {}  # the plan search's memory vectors, kept across searches
        self.searches = 0
        self.transition_cpu_s = 0.0  # CPU seconds spent estimating transitions (compiling the moves)
        self._decisions = 0
        self._search_step = 0
        self._responses: list[int] = []
        self._streak: tuple = (None, 0)  # (candidate key, consecutive decisions that wanted it)
        self._last_gpus: Optional[int] = None
        self._research_at: Optional[int] = None  # decision count at which to search again after a move
        self._moved_at = 0  # decision count of the last move
        self._forcing = False  # the last decision was a forced move (infeasible-now)
        self._slope = 0.0  # tokens per step of the level's line (0 until it has 3 responses)
        self._upper = 0.0  # the level's line shifted by the largest spread quantile, at this step
        self._on_forced = False  # the running plan is the target of a forced move, not yet corrected

    # -- observations -------------------------------------------------------------------
    def observe(self, model_stage, plan: Plan, workload: Workload, seconds: float) -> None:
        """One measured latency of a model-stage under `plan` (the layout it ran with)."""
        _check_seconds(seconds, "observe", zero=True)
        ms = ModelStage.parse(model_stage) if isinstance(model_stage, str) else model_stage
        placement = plan.placement(ms)
        waves = 1
        if ms.stage == "generation":
            waves = self._predict(plan, workload, None).waves.get(str(ms), 1)
        self.cost.observe(workload, ms, layout_of(self.module, placement, waves), seconds)

    def observe_step(self, seconds: float) -> None:
        """A measured whole-step latency of the current plan (for the confidence term): a
        finite number of seconds > 0, else a SettingError (a NaN would surface decisions
        later as a TypeError inside the statistics)."""
        _check_seconds(seconds, "observe_step")
        self._step_times.append(float(seconds))
        del self._step_times[:-50]

    def transitioned(self, plan: Plan, seconds: Optional[float] = None, predicted: Optional[float] = None,
                     step: Optional[int] = None) -> None:
        """The runtime moved to `plan`; `seconds` is how long it took (corrects estimates)."""
        if seconds is not None and predicted:
            self._correction.append((predicted, seconds))
        self.plan = plan
        self._on_forced, self._forcing = self._forcing, False
        self._step_times.clear()
        self._streak = (None, 0)
        self._moved_at = self._decisions
        self._research_at = self._decisions + self.settings.trial_steps
        if step is not None:
            self._last_switch = step

    @property
    def correction(self) -> float:
        """measured/predicted transition time, pooled over past transitions (1 before any)."""
        if not self._correction:
            return 1.0
        return sum(m for _, m in self._correction) / sum(p for p, _ in self._correction)

    # -- decisions ----------------------------------------------------------------------
    def _predict(self, plan: Plan, workload: Workload, gpus: Optional[int]) -> PlanPrediction:
        where = (plan_key(plan), workload_key(workload))
        key = (where, self.cost.version)
        hit = self._prediction_cache.get(key)
        if hit is None:
            if len(self._prediction_cache) > 256:
                self._prediction_cache.clear()
            # memory and waves depend on the plan and the workload (on the 1% grid), not on the
            # fitted coefficients: computed once per (plan, length bucket), reused after refits
            memory = self._memory_cache.get(where)
            if memory is None:
                if len(self._memory_cache) > 4096:
                    self._memory_cache.clear()
                memory = self._memory_cache[where] = plan_memory(self.module, workload, plan, self.allow_waves)
            hit = predict_plan(self.module, workload, self.cost, plan, None, self.allow_waves, memory)
            self._prediction_cache[key] = hit
        if gpus is not None and hit.feasible and max(max(p.gpus) for p in plan.placements) >= gpus:
            return PlanPrediction(False, hit.step_s, hit.stage_seconds, hit.waves)
        return hit

    def _needs_search(self, workload: Workload, gpus: int) -> Optional[str]:
        """Why the search must run now ("gpus", "refit", "research", "drift"), or None."""
        if self._search is None or self._search_key != gpus:
            return "gpus"
        if self.cost.version != self._search_version and self._decisions - self._search_step >= self.refit_every:
            return "refit"
        if self._research_at is not None and self._decisions >= self._research_at:
            # a few steps on a plan whose layouts were never measured: the model has now seen
            # them, and if the move was a mistake the search says so now, not 100 steps later.
            # On a forced move's target (picked, never admitted: `admission_settings`) again
            # after 2×, 4×, ... as many decisions while the fit settles on its layouts, until
            # `refit_every` takes over or a move ends it
            delay = 2 * (self._research_at - self._moved_at)
            self._research_at = self._moved_at + delay if self._on_forced and delay < self.refit_every else None
            if self.cost.version != self._search_version:
                return "research"
        last = self._search_workload
        for name in ("batch", "prompt", "response"):
            a, b = getattr(last, name), getattr(workload, name)
            if abs(a - b) > self.research_tolerance * max(a, b):
                return "drift"
        return None

    def admission_settings(self) -> AdmissionSettings:
        """The admission settings of the next decision: `settings`, without the tie threshold
        while the running plan is a forced move's target not yet corrected. That target was
        the search's pick on a model that had not measured it, never admitted against an
        alternative; once measured, a better plan that passes the payback or trial test (σ,
        confirmation and all) corrects the pick even when the model calls the gain a tie.
        Any later move restores the threshold, so it cannot feed a chase of ties."""
        return replace(self.settings, rho_min=0.0) if self._on_forced else self.settings

    def best_plan(self, workload: Workload, gpus: int, longest: int = 0, exact: bool = False) -> SearchResult:
        """The search's best plan for `workload` (cached until `_needs_search`), planned for the
        longer of `headroom` above its response and `longest` (the longest recent response: a
        plan without a generation-wave cliff below the long steps that noise brings).
        `exact`: planned for `workload` itself, searched now (a forced move's last resort:
        the step fits some plan, but none with headroom).

        The drift test is on the level (plus `headroom`). Testing a quantity that follows only
        the trend (the second longest recent response) halved the searches on a ±10% trace,
        but the searches that the level's wander brings are what found, 45 steps sooner, the
        plan that leaves a KV-wave cliff (length-growth-noisy-1024, steps 300–400)."""
        trigger = replace(workload, response=_on_grid(workload.response * (1.0 + self.headroom)))
        why = "exact" if exact else self._needs_search(trigger, gpus)
        if why:
            # on the level's 1% grid, so memory terms computed for one search serve the next
            response = _on_grid(max(workload.response * (1.0 + self.headroom), longest))
            ahead = workload if exact else replace(workload, response=response)
            # the running plan and the last candidate bound the search from the start (search.py)
            known = (self.plan, self._search.plan if self._search is not None else None)
            self._search = search_plan(self.module, ahead, self.cost, gpus, name="candidate",
                                       allow_waves=self.allow_waves, incumbents=known, memo=self._search_memo)
            self._search_key, self._search_version = gpus, self.cost.version
            self._search_workload = trigger
            self._search_step = self._decisions
            self.searches += 1
        return self._search

    def forced_target(self, workload: Workload, spread: tuple, gpus: int, remaining: int) -> Optional[SearchResult]:
        """The target of a forced move (the running plan cannot run the next step), or None
        when no plan fits `forced_headrooms` above the longest recent response.

        The fastest plan with a little headroom is outgrown again within a few steps when the
        responses keep growing (on a small trace of 4 GPUs: five forced moves in 16 steps where
        the oracle made one). So the candidates are the best plans for each headroom, and
        the pick is the one of least expected step time (over `spread`) plus its corrected
        transition estimate spread over the steps it runs before the trend outgrows it:
        (largest response it fits − the level's upper line) / the level's slope, at most the
        remaining steps (all of them when the level does not grow)."""
        longest = max([workload.response, *self._responses])
        remaining = max(1, remaining)
        best, best_cost, seen = None, math.inf, set()
        for headroom in self.forced_headrooms:
            ahead = replace(workload, response=_on_grid(longest * (1.0 + headroom)))
            found = search_plan(self.module, ahead, self.cost, gpus, name="candidate", allow_waves=self.allow_waves,
                                memo=self._search_memo)
            self.searches += 1
            if found.plan is None:
                break  # a longer response fits nothing either
            key = plan_key(found.plan)
            if key in seen or not self._predict(found.plan, workload, gpus).feasible:
                continue
            seen.add(key)
            runs = remaining
            if self._slope > 0:
                fits = self._largest_response(found.plan, ahead)
                runs = min(remaining, max(1.0, (fits - self._upper) / self._slope))
            moved = self.transition_estimate(workload, self.plan, found.plan) * self.correction
            cost = self._expected(found.plan, spread, gpus).step_s + moved / runs
            if cost < best_cost:
                best, best_cost = found, cost
        return best

    def _largest_response(self, plan: Plan, fits: Workload, ceiling: float = 16.0) -> int:
        """The longest response `plan` fits (memory, with waves), searched by bisection above
        `fits` (a workload it fits) up to `ceiling` times it."""
        low, high = fits.response, int(fits.response * ceiling)
        if plan_memory(self.module, replace(fits, response=high), plan, self.allow_waves).feasible:
            return high
        while high - low > max(1, low // 200):  # to 0.5%
            middle = (low + high) // 2
            if plan_memory(self.module, replace(fits, response=middle), plan, self.allow_waves).feasible:
                low = middle
            else:
                high = middle
        return low

    def transition_estimate(self, workload: Workload, source: Plan, target: Plan) -> float:
        """Predicted transition seconds (uncorrected), cached per plan pair."""
        key = (plan_key(source), plan_key(target))
        if key not in self._transition_cache:
            began = time.thread_time()
            self._transition_cache[key] = transition_seconds(self.module, workload, source, target,
                                                             self.transition_method)[0]
            self.transition_cpu_s += time.thread_time() - began
        return self._transition_cache[key]

    def level(self, workload: Workload, again: bool = False) -> tuple[Workload, tuple[Workload, ...]]:
        """(level, spread): the workload the decision is judged at and the workloads its step
        times are averaged over.

        The level is the step's own workload with the response replaced by a robust line
        (Theil–Sen: the median of pairwise slopes, the median intercept) through the last
        `level_window` responses (this one included), read at this step: one long or short
        step barely moves it, so it neither triggers a search nor makes a plan look better;
        ±x% noise per step moves it by a fraction of x; a steady trend moves it without the lag
        of a moving median or mean. The spread is the level shifted by the lower and upper
        quartiles of the recent responses' residuals from that line: a plan one generation
        wave short of the upper quartile pays its KV-wave cliff in the average, as it will in
        about a quarter to a half of the coming steps. All three lie on a 1% grid (`_on_grid`):
        memory and cost terms are then computed once per 1% of drift, not every step.
        `again`: a second decision for the same step, whose response replaces the last one."""
        if again and self._responses:
            self._responses.pop()
        self._responses.append(workload.response)
        del self._responses[:-self.level_window]
        n = len(self._responses)
        if self.level_window <= 1 or n < 3:
            self._slope, self._upper = 0.0, float(workload.response)
            return workload, (workload,)
        y = np.asarray(self._responses, dtype=float)
        x = np.arange(n)
        i, j = np.triu_indices(n, 1)
        slope = float(np.median((y[j] - y[i]) / (j - i)))
        intercept = float(np.median(y - slope * x))
        at = intercept + slope * (n - 1)
        shifts = np.percentile(y - (intercept + slope * x), SPREAD_QUANTILES)
        self._slope, self._upper = slope, at + float(shifts[-1])
        level = replace(workload, response=_on_grid(at))
        return level, tuple(replace(workload, response=_on_grid(at + d)) for d in shifts)

    def _expected(self, plan: Plan, spread: tuple, gpus: int) -> PlanPrediction:
        """The plan's prediction with step_s averaged over the spread's workloads."""
        predictions = [self._predict(plan, w, gpus) for w in spread]
        if len(predictions) == 1:
            return predictions[0]
        first = predictions[0]
        return PlanPrediction(first.feasible, sum(p.step_s for p in predictions) / len(predictions),
                              first.stage_seconds, first.waves)

    def _sigma(self, candidate: Plan, current_pred: PlanPrediction, candidate_pred: PlanPrediction) -> float:
        """σ of the predicted gain: measured step noise over the k steps on the current plan,
        and the model error of each model-stage whose layout the switch changes."""
        changed = []
        for placement in candidate.placements:
            ms = placement.model_stage
            try:
                before = self.plan.placement(ms)
            except KeyError:
                before = None
            if before is not None and (before.dp, before.tp, before.pp, before.offload, before.gpus, before.zero,
                                       before.ep) == (placement.dp, placement.tp, placement.pp, placement.offload,
                                                      placement.gpus, placement.zero, placement.ep):
                continue  # the same layout on the same GPUs: its error cancels in the difference
            fitted = self.cost.relative_error(ms)
            error = fitted if math.isfinite(fitted) else self.settings.default_error
            if not self.cost.observed_layout(ms, layout_of(self.module, placement)):
                error = max(error, self.settings.unobserved_error)
            changed.append((error, candidate_pred.stage_seconds[str(ms)]))
            if before is not None:
                changed.append((error, current_pred.stage_seconds.get(str(ms), 0.0)))
        measured_std = statistics.pstdev(self._step_times) if len(self._step_times) > 1 else 0.0
        return gain_sigma(changed, measured_std, len(self._step_times))

    def decide(self, step: int, workload: Workload, gpus: int, after_failure: bool = False) -> Decision:
        """Should the job leave `self.plan` before running `step` on GPUs 0..gpus−1?
        `workload` is what is known before the step: its response is the last one observed
        (this step's own is generated during it). Feasibility is judged on `workload` itself,
        latencies over `level(workload)`. `after_failure`: the step was attempted and did not
        fit; `workload` now carries its own response (it replaces the last one in the level).
        Returns (and logs) a Decision; it does not change `self.plan`."""
        gpus_total = self.module.cluster.num_gpus
        if isinstance(gpus, bool) or not isinstance(gpus, numbers.Integral) or not 0 < gpus <= gpus_total:
            from nereus.ir.diagnostics import SettingError

            raise SettingError(f"decide: gpus={gpus!r} is not a GPU count of cluster {self.module.cluster.name} "
                               f"(1..{gpus_total})", hint="the GPUs available before this step: ids 0..gpus-1")
        self._decisions += 1
        remaining = max(0, self.total_steps - step)
        level, spread = self.level(workload, again=after_failure)
        last_gpus, self._last_gpus = self._last_gpus, gpus
        current_now = self._predict(self.plan, workload, gpus)
        fits = current_now.feasible
        current = self._expected(self.plan, spread, gpus)
        found = self.best_plan(level, gpus, max(self._responses))
        candidate = self._predict(found.plan, workload, gpus) if found.plan is not None else None
        if not fits and not self.greedy:
            # forced: the plan that pays for the move best over the steps it will run
            # (`forced_target`); the greedy baseline takes the fastest, whatever it costs
            target = self.forced_target(workload, spread, gpus, remaining)
            if target is not None:
                found = self._search = target
                candidate = self._predict(found.plan, workload, gpus)
                self._search_key, self._search_version = gpus, self.cost.version
                self._search_workload = replace(level, response=_on_grid(level.response * (1.0 + self.headroom)))
                self._search_step = self._decisions
        if not fits and (candidate is None or not candidate.feasible):
            self._search = None  # forced: search at this step's own workload, which the level hid
            found = self.best_plan(workload, gpus)
            candidate = self._predict(found.plan, workload, gpus) if found.plan is not None else None
            if candidate is None or not candidate.feasible:
                # nothing fits `headroom` above the step, but a plan may fit the step itself
                # (a job about to outgrow every plan): run it while it fits, as the oracle does
                found = self.best_plan(workload, gpus, exact=True)
                candidate = self._predict(found.plan, workload, gpus) if found.plan is not None else None
        if candidate is None or not candidate.feasible or plan_key(found.plan) == plan_key(self.plan):
            self._streak = (None, 0)
            if not fits and candidate is not None and candidate.feasible:
                decision = admit(step, current.step_s, False, candidate.step_s, True, remaining, 0.0,
                                 self.settings, candidate=found.plan)
            else:
                decision = admit(step, current.step_s, fits, current.step_s, fits or bool(candidate and candidate.feasible),
                                 remaining, 0.0, self.settings, candidate=None)
            self._forcing = decision.switch and decision.reason == "infeasible-now"
            self.log.append(decision)
            return decision
        candidate_now = candidate
        candidate = self._expected(found.plan, spread, gpus)

        def transition() -> float:
            return self.transition_estimate(workload, self.plan, found.plan) * self.correction

        if self.greedy:
            decision = admit(step, current.step_s, fits, candidate.step_s, True, remaining, 0.0,
                             GREEDY_SETTINGS, candidate=found.plan)
            # the baseline ignores the transition's cost: its reason says so, not "pays-back"
            reason = "faster" if decision.switch and decision.reason != "infeasible-now" else decision.reason
            decision = Decision(decision.step, decision.switch, reason, decision.current_s,
                                decision.candidate_s, remaining, transition() if decision.switch else math.nan,
                                0.0, 0.0, decision.saving_s, found.plan)
        else:
            sigma = self._sigma(found.plan, current, candidate) if fits else 0.0
            key = plan_key(found.plan)
            streak = self._streak[1] if self._streak[0] == key else 0
            if last_gpus is not None and gpus != last_gpus:
                streak = self.settings.confirm  # a new GPU budget is a fact, not noise: no need to confirm

            settings = self.admission_settings()

            def judge(transition_s: float) -> Decision:
                return admit(step, current.step_s, fits, candidate.step_s, True, remaining, transition_s,
                             settings, sigma, step - self._last_switch, found.plan, streak,
                             now_gain_s=current_now.step_s - candidate_now.step_s)

            # every test only gets harder as Ĉ grows: a candidate that fails them at Ĉ = 0 fails
            # them at any Ĉ, and its transition (a compile of the move, ~0.5 s at 1,024 GPUs) is
            # never estimated
            decision = judge(0.0)
            if decision.reason in _STAYS_AT_ANY_COST:
                decision = replace(decision, transition_s=math.nan)
            else:
                decision = judge(transition())
            passed = decision.reason in ("confirming", "pays-back", "trial")
            self._streak = (key, streak + 1) if passed else (None, 0)
        self._forcing = decision.switch and decision.reason == "infeasible-now"
        self.log.append(decision)
        return decision
