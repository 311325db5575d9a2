"""Admission: switch plans only when the current plan cannot run the next step, or when the
predicted saving over the remaining steps repays the transition with confidence, and the
evidence for it has held for more than one step.

Input: predicted step seconds of the current plan and of the best candidate (at the
workload level, see `Controller`), their feasibility for the actual next step, the remaining
steps H, the corrected transition estimate Ĉ, the gain's uncertainty σ, and how many
consecutive earlier decisions already wanted this candidate. Output: a `Decision` that
carries every number and says why (`Decision.why`). Pure.

Rule (after Pollux's discounted speedups and Sia's restart-cost accounting):
  1. infeasible now — the current plan does not fit the known workload (the next step's GPU
     budget, the latest observed response) — and a feasible candidate exists: switch (a
     forced move, charged its transition like any other).
  2. the next step alone repays the move: at the known workload the candidate saves more
     than Ĉ + z·σ on it while being no slower (up to ρ_min) at the workload level (at a generation-wave
     cliff a step costs 25–30% more; waiting one step for the level to catch up costs that).
  3. otherwise, with g = t_cur − t_cand, switch iff all of
       (g − z·σ)·H·(1 − margin) > Ĉ                             (payback with confidence)
         or g·H·(1 − margin) − Ĉ > 2Ĉ + D·max(0, z·σ − g)       (a trial worth its risk)
       g / t_cur ≥ ρ_min                                         (not a tie)
       steps since the last switch ≥ D_min
       for a trial (not the confident test): the same candidate passed the tests above at
       the `confirm` − 1 previous decisions too, unless the GPU budget just changed
                                                                 (hysteresis)
     The trial test covers a candidate the model cannot vouch for yet (a layout never
     measured): a move is reversible, so its worst plausible loss is the move, the move back,
     and D = `trial_steps` steps at up to z·σ − g slower before the measurements show it;
     when the expected saving over the remaining steps exceeds that, trying is the better bet
     (otherwise a clearly better plan is never tried, and never measured).
σ is the uncertainty of the *difference* t_cur − t_cand (the controller computes it):
σ² = s0²/k + Σ_changed (ε_ms·t_ms)², with s0 the std of the k measured steps of the current
plan (shrinks as k grows) and the sum over the model-stages whose layout the candidate
changes (unchanged ones cancel), ε_ms the fit's relative error inflated by √(n/(n − f)) for f
fitted coefficients on n observations (shrinks with evidence), floored for a layout never
measured. A model-stage the switch does not touch adds nothing, so a clearly better plan is
not held back by noise elsewhere; a gain inside the noise never passes the confident test,
and a trial that looks worth it at a single step waits for the confirmation. A confident
gain moves at once: a one-step delay at a generation-wave cliff costs a whole step's 25–30%.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Optional

from nereus.ir.model import Plan


@dataclass(frozen=True)
class AdmissionSettings:
    margin: float = 0.1  # fraction of the predicted saving not counted on
    z: float = 1.645  # one-sided 95% confidence on the predicted gain
    rho_min: float = 0.0025  # least relative gain worth a switch (ties are not worth a move)
    min_interval: int = 1  # least steps between two switches
    confirm: int = 2  # consecutive decisions that must want the same candidate (hysteresis)
    trial_steps: int = 3  # steps a trial needs before the model has measured the candidate
    default_error: float = 0.05  # ε before the model has two observations of a model-stage
    # ε floor for a candidate layout never measured: the fit is checked only on layouts the
    # job ran, and its error on other layouts is larger (the simulator's hidden per-term
    # coefficients differ from the prior by ~25%)
    unobserved_error: float = 0.05

    def __post_init__(self):
        """Every setting in its range (a margin of 1 or more would flip the payback test:
        (1 − margin) ≤ 0 makes a gain inside the noise pass), else a SettingError naming it."""
        from nereus.ir.diagnostics import SettingError

        def number(name: str, low: float, high: float = math.inf, high_open: bool = False, whole: bool = False):
            value = getattr(self, name)
            try:
                ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and \
                    low <= value and (value < high if high_open else value <= high) and \
                    (not whole or value == int(value))
            except OverflowError:  # an integer past a float's range
                ok = False
            if not ok:
                span = f"at least {low:g}" + (f" and below {high:g}" if high_open else
                                             f" and at most {high:g}" if math.isfinite(high) else "")
                raise SettingError(f"AdmissionSettings {name}={value!r}: must be {'a whole number ' if whole else ''}"
                                   f"{span}", hint=f"the default is {getattr(AdmissionSettings, name)!r}")

        number("margin", 0.0, 1.0, high_open=True)
        number("z", 0.0)
        number("rho_min", 0.0, 1.0, high_open=True)
        number("min_interval", 0, whole=True)
        number("confirm", 1, whole=True)
        number("trial_steps", 0, whole=True)
        number("default_error", 0.0)
        number("unobserved_error", 0.0)


@dataclass(frozen=True)
class Decision:
    step: int
    switch: bool
    # infeasible-now | pays-back-now | pays-back | trial | no-gain | below-min-gain | no-payback | too-soon |
    # confirming | no-feasible-plan; the greedy baseline: faster (any faster plan, whatever the move costs)
    reason: str
    current_s: float  # predicted step latency of the current plan (inf if infeasible)
    candidate_s: float  # predicted step latency of the best plan found
    remaining_steps: int
    transition_s: float  # corrected transition-cost estimate (0 if no candidate, NaN if not needed)
    sigma_s: float  # uncertainty of the gain
    margin: float
    saving_s: float  # confident saving over the remaining steps, after the margin
    plan: Optional[Plan] = field(default=None, compare=False)  # the candidate (the target when switch)
    z: float = 1.645  # the settings' z: the rule subtracted z·σ from the gain
    now_gain_s: Optional[float] = None  # predicted saving per step at the known workload (rule 2)

    @property
    def why(self) -> str:
        """The decision in words. Every transition time here is the prediction the rule used
        (`predicted transition`), not the time a move took."""
        if self.reason == "infeasible-now":
            return (f"step {self.step}: switch, the current plan does not fit; candidate predicted "
                    f"{self.candidate_s:.2f} s/step, predicted transition {self.transition_s:.2f} s")
        if self.reason == "no-feasible-plan":
            return f"step {self.step}: stay, no feasible plan exists for this workload and GPU budget"
        verb = "switch" if self.switch else "stay"
        gain = self.current_s - self.candidate_s
        if self.reason == "faster":
            current, candidate = distinct_seconds(self.current_s, self.candidate_s)
            return (f"step {self.step}: switch (faster; the greedy baseline ignores the move's cost): current "
                    f"{current} s, candidate {candidate} s, predicted transition {self.transition_s:.2f} s")
        # σ is the gain's uncertainty; the rule subtracts z·σ (z: AdmissionSettings.z)
        noise = f"z·σ {self.z * self.sigma_s:.3f} (σ {self.sigma_s:.3f})"
        if self.reason == "pays-back-now" and self.now_gain_s is not None:
            # rule 2 decides on the gain at the known workload, not at the predicted level
            return (f"step {self.step}: {verb} ({self.reason}): gain now {self.now_gain_s:.3f} s/step (at the "
                    f"known workload) − {noise} > predicted transition {self.transition_s:.2f} s; at the predicted level "
                    f"current {self.current_s:.2f} s, candidate {self.candidate_s:.2f} s")
        if not math.isfinite(self.transition_s):  # not estimated: no transition cost could change it
            return (f"step {self.step}: {verb} ({self.reason}): current {self.current_s:.2f} s, candidate "
                    f"{self.candidate_s:.2f} s, gain {gain:.3f} s/step − {noise}")
        return (f"step {self.step}: {verb} ({self.reason}): current {self.current_s:.2f} s, candidate "
                f"{self.candidate_s:.2f} s, gain {gain:.3f} s/step − {noise}, × {self.remaining_steps}"
                f" steps × (1 − {self.margin:g}) = {self.saving_s:.1f} s vs predicted transition "
                f"{self.transition_s:.2f} s")

    def to_json(self) -> dict:
        def num(x):
            return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(x, 6)

        return {"step": self.step, "switch": self.switch, "reason": self.reason,
                "current_s": num(self.current_s), "candidate_s": num(self.candidate_s),
                "remaining_steps": self.remaining_steps, "transition_s": num(self.transition_s),
                "sigma_s": num(self.sigma_s), "margin": self.margin, "saving_s": num(self.saving_s),
                "now_gain_s": num(self.now_gain_s), "why": self.why}


def distinct_seconds(a: float, b: float) -> tuple[str, str]:
    """Two step times with the fewest decimals (2 to 9) that tell them apart, so that a
    faster plan never reads as an equal one ('1.23 s, candidate 1.23 s')."""
    for decimals in range(2, 10):
        shown = f"{a:.{decimals}f}", f"{b:.{decimals}f}"
        if shown[0] != shown[1]:
            return shown
    return shown


def admit(step: int, current_s: float, current_feasible: bool, candidate_s: float, candidate_feasible: bool,
          remaining_steps: int, transition_s: float, settings: AdmissionSettings, sigma_s: float = 0.0,
          steps_since_switch: int = 1 << 30, candidate: Optional[Plan] = None,
          confirmations: int = 1 << 30, now_gain_s: float = 0.0) -> Decision:
    """Apply the admission rule (module docstring) to predicted numbers. Pure.

    `confirmations`: consecutive earlier decisions that wanted this same candidate and passed
    the payback, gain and interval tests (the caller counts them; default: confirmed).
    `now_gain_s`: predicted seconds the candidate saves at the known workload (the next
    step's GPUs, the latest observed response; rule 2)."""
    def decide(switch: bool, reason: str, saving: float) -> Decision:
        return Decision(step, switch, reason, current_s if current_feasible else math.inf, candidate_s,
                        remaining_steps, transition_s, sigma_s, settings.margin, saving, candidate, settings.z,
                        now_gain_s)

    if not candidate_feasible:
        return decide(False, "no-feasible-plan", 0.0)
    if not current_feasible:
        return decide(True, "infeasible-now", 0.0)
    gain = current_s - candidate_s
    saving = (gain - settings.z * sigma_s) * remaining_steps * (1.0 - settings.margin)
    no_slower = gain >= -settings.rho_min * current_s  # at the level, up to a tie
    if no_slower and now_gain_s - settings.z * sigma_s > transition_s and steps_since_switch >= settings.min_interval:
        return decide(True, "pays-back-now", saving)
    if gain <= 0:
        return decide(False, "no-gain", saving)
    if gain / current_s < settings.rho_min:
        return decide(False, "below-min-gain", saving)
    # a reversible trial: at worst the candidate is z·σ − gain slower per step, that shows within
    # `trial_steps` observed steps, and moving back costs another transition
    worst_loss = 2.0 * transition_s + settings.trial_steps * max(0.0, settings.z * sigma_s - gain)
    expected = gain * remaining_steps * (1.0 - settings.margin) - transition_s
    trial = expected > worst_loss
    if saving <= transition_s and not trial:
        return decide(False, "no-payback", saving)
    if steps_since_switch < settings.min_interval:
        return decide(False, "too-soon", saving)
    if saving <= transition_s and confirmations + 1 < settings.confirm:
        return decide(False, "confirming", saving)  # only a trial waits: a confident gain is no noise
    return decide(True, "pays-back" if saving > transition_s else "trial", saving)


def gain_sigma(changed: list, measured_std: float = 0.0, measured_count: int = 0) -> float:
    """σ = √(s0²/k + Σ (ε_ms·t_ms)²) over `changed` = [(ε_ms, t_ms)] of the model-stages the
    switch changes (module docstring; the measured term is dropped when k = 0)."""
    measured = measured_std ** 2 / measured_count if measured_count > 0 else 0.0
    return math.sqrt(measured + sum((error * seconds) ** 2 for error, seconds in changed))
