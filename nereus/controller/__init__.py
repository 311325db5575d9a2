"""The Nereus controller: calibrated cost model, plan search, payback admission, drift simulator.

    from nereus.controller import Controller, search_plan, CostModel
    ctl = Controller(module, module.plan("S1"), total_steps=1000, settings=AdmissionSettings(margin=0.1))
    ctl.observe("actor.generation", plan, workload, seconds)   # after each step, per model-stage
    decision = ctl.decide(step, workload, gpus)                # decision.switch, decision.plan, decision.why

Pure Python + numpy; imports neither torch nor triton. Modules: nnls (Lawson–Hanson),
layer_model + calibrated (per-layer roofline fitted on a measured H200 table), cost_model
(stage terms and online fit), memory (the feasibility pass's bytes, with generation waves),
search (branch and bound over per-model-stage layouts), admission (the switch rule),
transition_cost (compiler estimate with a fallback), controller, simulator.
"""

from .admission import AdmissionSettings, Decision, admit
from .controller import Controller, PlanPrediction, predict_plan
from .cost_model import CostModel, Layout, stage_terms, step_seconds
from .memory import plan_memory
from .nnls import fit_relative, nnls
from .search import SearchResult, brute_force_plan, search_plan, search_plans

__all__ = ["AdmissionSettings", "Decision", "admit", "Controller", "PlanPrediction", "predict_plan", "CostModel",
           "Layout", "stage_terms", "step_seconds", "plan_memory", "fit_relative", "nnls", "SearchResult",
           "brute_force_plan", "search_plan", "search_plans"]
