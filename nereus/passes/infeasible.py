"""infeasible: a plan the feasibility pass rejects → the error that says why and what fits.

`infeasible_error` is the error every command gives for such a plan (`nereusc check`,
`nereusc FILE`, a transition into or out of it: `require_fit`): the worst GPU and stage, the
largest contributor, and the changes that make the plan fit (`alternatives`).

`alternatives`: input a validated `Module`, one of its plans that the feasibility pass
rejects, and that pass's report. Output: `Alternative`s, each a change that makes the whole plan fit, as
`.nir` text to paste: one model-stage's placement on the same GPUs with `zero 1` or `zero 3`
(training), `offload`, tp or pp doubled with dp halved (within the IR's rules, TP groups
inside a node), up to three of these changes at once, fewest first; or, when no placement
of those model-stages fits, a smaller `microbatch` or more `recompute` in the workload.
Invariant: every alternative returned makes `check_plan` accept the plan (the placement ones
are judged by `_Rest`, which applies the feasibility pass's per-GPU rule to the plan with one
placement replaced, without recomputing the others: tests check it against `check_plan`).
Pure; never mutates its input.

Cost: the model-stages tried are those on the worst GPU and stage, largest first (at most
`MODEL_STAGES`); each costs one pass over the other placements' GPUs, then one pass over its
own GPUs per variant: on examples/grpo-405b-4096.nir without `zero 1` the alternatives take
16-23 ms of CPU after a check of 83-105 ms; when nothing fits, about the check's own time
(the workload changes are full checks, a bisection over the microbatches, tried only where
working memory could cover the excess).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nereus.ir.model import STAGES, Module, Placement, Plan, Workload
from nereus.ir.node_groups import spanning_groups
from nereus.ir.printer import placement_lines
from nereus.ir.validate import valid_tps

from nereus.ir.diagnostics import InfeasibleError
from nereus.ir.units import human_bytes

from .feasibility import FeasibilityReport, _placement_contributions, check_plan, host_held_bytes

MODEL_STAGES = 3  # model-stages of the worst GPU tried, largest contributor first
SHOWN = 3  # alternatives named in the hint
RESIDENT_KINDS = ("weights", "grads", "optimizer")  # feasibility's resident kinds; the rest is working memory


@dataclass(frozen=True)
class Alternative:
    lines: tuple[str, ...]  # .nir to paste: plan lines, or a workload key
    where: str  # "plan S1" or "workload ppo"
    changes: int  # keys changed from the plan as written


def _alternative(plan: Plan, placements: list[Placement], changes: int) -> Alternative:
    return Alternative(tuple(placement_lines(placements)), f"plan {plan.name}", changes)


def describe(alternatives: list[Alternative]) -> str:
    """The alternatives as hint text: numbered, one .nir line each under its number."""
    if len(alternatives) == 1:
        return f"this makes it fit, in {alternatives[0].where}:" + "".join(f"\n    {line}" for line in
                                                                           alternatives[0].lines)
    out = "each of these makes it fit:"
    for i, alternative in enumerate(alternatives, 1):
        first, *more = alternative.lines
        out += f"\n  {i}. in {alternative.where}: {first}" if len(alternative.lines) == 1 else \
            f"\n  {i}. in {alternative.where}:" + "".join(f"\n       {line}" for line in alternative.lines)
    return out


class _Rest:
    """The plan without some model-stages: per GPU and stage, the resident bytes of the others
    and the largest of their working sets (the feasibility pass's rule), so that candidate
    placements of the left-out model-stages on their own GPUs are judged by a walk over those
    GPUs alone."""

    def __init__(self, module: Module, plan: Plan, left_out: list[Placement]):
        self.module = module
        self.stages = [s for s in STAGES if module.workload.models_in(s)]
        self.capacity = module.cluster.usable_gpu_bytes
        names = {p.model_stage for p in left_out}
        contributions = []  # (stage, offload, resident total, working total)
        signature: dict[int, list[int]] = {}
        self.host: dict[int, int] = {}
        for placement in plan.placements:
            if placement.model_stage in names:
                continue
            for gpus, resident, working in _placement_contributions(module, placement):
                contributions.append(_entry(placement, resident, working))
                for gpu in gpus:
                    signature.setdefault(gpu, []).append(len(contributions) - 1)
                self._add_host(placement, gpus, resident, self.host)
        cells: dict[tuple, tuple] = {}
        self.cell_of: dict[int, tuple] = {}
        for gpu, ids in signature.items():
            key = tuple(ids)
            if key not in cells:
                cells[key] = tuple(_cell([contributions[c] for c in ids], stage) for stage in self.stages)
            self.cell_of[gpu] = cells[key]
        self.empty = tuple((0, 0) for _ in self.stages)
        inside = {gpu for p in left_out for gpu in p.gpus}
        # GPUs the left-out model-stages do not touch keep their bytes whatever they become
        self.outside_fits = all(res + work <= self.capacity for gpu, cell in self.cell_of.items()
                                if gpu not in inside for res, work in cell)

    def _add_host(self, placement: Placement, gpus, resident: dict, host: dict) -> None:
        if placement.offload:
            width = self.module.cluster.gpus_per_node
            for gpu in gpus:
                host[gpu // width] = host.get(gpu // width, 0) + host_held_bytes(resident)

    def fits(self, placements: list[Placement]) -> bool:
        """Whether the plan fits with `placements` in place of the left-out ones (same GPUs)."""
        if not self.outside_fits:
            return False
        host = dict(self.host)
        added: dict[int, list] = {}
        for placement in placements:
            for gpus, resident, working in _placement_contributions(self.module, placement):
                entry = _entry(placement, resident, working)
                for gpu in gpus:
                    added.setdefault(gpu, []).append(entry)
                self._add_host(placement, gpus, resident, host)
        seen = set()
        for gpu, entries in added.items():
            cell = self.cell_of.get(gpu, self.empty)
            key = (id(cell), tuple(entries))
            if key in seen:
                continue
            seen.add(key)
            for stage, (rest, rest_work) in zip(self.stages, cell):
                res, work = _cell(entries, stage)
                if rest + res + max(rest_work, work) > self.capacity:
                    return False
        return all(n <= self.module.cluster.host_mem_bytes for n in host.values())


def _entry(placement: Placement, resident: dict, working: dict) -> tuple:
    return placement.model_stage.stage, placement.offload, sum(resident.values()), sum(working.values())


def _cell(entries, stage: str) -> tuple[int, int]:
    """(resident bytes, largest working set) in `stage` of the entries on a GPU
    (feasibility.check_plan's rule: an offloaded unit is resident in its own stage only;
    units of one stage on a GPU run one after another)."""
    resident = sum(total for own, offload, total, _ in entries if not offload or own == stage)
    working = max((work for own, _, _, work in entries if own == stage and work), default=0)
    return resident, working


# The changes tried, cheapest at run time first: zero 1 (the same traffic as plain data
# parallelism), a wider or a deeper mesh (dp halved), zero 3, offload (host traffic every
# step), then two and three of them at once. A change that does not apply to a placement
# (zero outside training, tp beyond the model's rules or a node) leaves it out.
CHANGES = tuple(sorted(
    ((zero, mesh, offload) for zero in (0, 1, 3) for mesh in ("", "tp", "pp") for offload in (False, True)
     if zero or mesh or offload),
    key=lambda c: (bool(c[0]) + bool(c[1]) + c[2], c[2], c[0] == 3, ("", "tp", "pp").index(c[1]), c[0])))


def _changed(module: Module, placement: Placement, change: tuple) -> Placement | None:
    """`placement` with `change` (zero, mesh, offload) applied, or None where it does not apply."""
    zero, mesh, offload = change
    model = module.model(placement.model_stage.model)
    out = placement
    if zero:
        if placement.model_stage.stage != "training" or placement.ep != 1 or placement.zero >= zero:
            return None
        out = replace(out, zero=zero)
    if offload:
        if placement.offload:
            return None
        out = replace(out, offload=True)
    if mesh:
        if placement.dp % 2:
            return None
        if mesh == "tp":
            out = replace(out, dp=out.dp // 2, tp=out.tp * 2)
            if out.tp not in valid_tps(model) or spanning_groups(module.cluster, out, "tp"):
                return None
        else:
            out = replace(out, dp=out.dp // 2, pp=out.pp * 2)
            if out.pp > model.layers or (model.tie_embeddings and model.head == "lm"):
                return None
    return out


def _workload_changes(module: Module, plan: Plan) -> list[Alternative]:
    """The largest smaller microbatch (a divisor of batch) with which `plan` fits, and one more
    level of recompute (training only) if the plan fits with it. Working memory grows with
    the microbatch, so the microbatch is found by bisection over the divisors."""
    workload = module.workload
    where = f"workload {workload.name}"

    def fits(changed: Workload) -> bool:
        return check_plan(replace(module, workload=changed), plan).feasible

    out = []
    smaller = [m for m in range(1, workload.microbatch) if workload.batch % m == 0]
    if smaller and fits(replace(workload, microbatch=smaller[0])):
        lo, hi = 0, len(smaller) - 1  # smaller[lo] fits; find the last that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(replace(workload, microbatch=smaller[mid])) else (lo, mid - 1)
        out.append(Alternative((f"microbatch {smaller[lo]}",), where, 1))
    levels = ("none", "selective", "full")
    if workload.models_in("training") and workload.recompute != "full":
        more = levels[levels.index(workload.recompute) + 1]
        if fits(replace(workload, recompute=more)):
            out.append(Alternative((f"recompute {more}",), where, 1))
    return out


def alternatives(module: Module, plan: Plan, report: FeasibilityReport) -> list[Alternative]:
    """Changes that make `plan` fit (module docstring), fewest first: of one model-stage of
    the worst GPU, else the same change to all of them, else of the workload; [] when its
    GPUs fit and only host memory overflows, or when nothing tried fits."""
    if not report.overflowing:
        return []
    names = []
    for contributor in report.worst.contributors:
        if contributor.model_stage not in names:
            names.append(contributor.model_stage)
    culprits = [plan.placement(name) for name in names[:MODEL_STAGES]]
    found: list[Alternative] = []
    for current in culprits:
        rest = _Rest(module, plan, [current])
        for change in CHANGES if rest.outside_fits else ():
            candidate = _changed(module, current, change)
            if candidate is not None and rest.fits([candidate]):
                found.append(_alternative(plan, [candidate], _count(change)))
                if len(found) >= SHOWN:
                    return found
    if found:
        return found
    if len(culprits) > 1:
        rest = _Rest(module, plan, culprits)
        for change in CHANGES if rest.outside_fits else ():
            changed = [_changed(module, p, change) for p in culprits]
            if any(changed) and rest.fits([new or old for new, old in zip(changed, culprits)]):
                found.append(_alternative(plan, [new for new in changed if new is not None],
                                          _count(change) * sum(map(bool, changed))))
                if len(found) >= SHOWN:
                    return found
    if found:
        return found
    # a workload change shrinks working sets only: it cannot fix the worst GPU when they are
    # smaller than its excess
    working = sum(c.bytes for c in report.worst.contributors if c.kind not in RESIDENT_KINDS)
    if working < report.worst.bytes - report.capacity_bytes:
        return []
    return _workload_changes(module, plan)


def _count(change: tuple) -> int:
    zero, mesh, offload = change
    return bool(zero) + bool(mesh) + offload


def _apart(need: int, have: int) -> tuple[str, str]:
    """`need` and `have` in one human unit each, with more digits where that rounding
    would print them equal ("needs 2.1 MiB but has 2.1 MiB")."""
    need_text, have_text = human_bytes(need), human_bytes(have)
    if need_text == have_text and need != have:
        return f"{need:,} B", f"{have:,} B"
    return need_text, have_text


def infeasible_error(plan: Plan, report: FeasibilityReport, source: str | None = None,
                     module: Module | None = None) -> InfeasibleError:
    """The error `nereusc check` prints for a plan that does not fit, at the plan's name:
    the worst GPU and stage, and the largest contributor in the hint; with `module`, the
    hint also names the changes that make the plan fit, as .nir lines to paste
    (`placement_alternatives`). One wording for the check and for every command that
    refuses an infeasible plan."""
    worst = report.worst
    if not report.overflowing and report.host_overflowing:  # the GPUs fit; host memory does not
        node, used = report.host_overflowing[0]
        used_text, has_text = _apart(used, report.host_capacity_bytes)
        return InfeasibleError(
            f"plan {plan.name} does not fit: node {node} holds {used_text} of offloaded state in host memory "
            f"but has {has_text} ({len(report.host_overflowing)} node(s) overflow)",
            plan.loc, "offload fewer model-stages, spread their GPUs over more nodes, or raise the cluster's host_mem",
            source or None, width=len(plan.name) if plan.loc else 1)
    top = worst.contributors[0]
    need_text, has_text = _apart(worst.bytes, report.capacity_bytes)
    hint = f"the largest contributor is {top.model_stage} {top.kind} ({human_bytes(top.bytes)}); "
    if module is None:
        hint += "raise its tp/pp, offload it, or lower the microbatch"
    else:
        found = alternatives(module, plan, report)
        if found:
            hint += describe(found)
        else:
            names = ", ".join(list(dict.fromkeys(c.model_stage for c in worst.contributors))[:3])
            hint += (f"no change of {names} on their GPUs (zero 1 or 3, offload, tp or pp doubled) fits, nor a "
                     "smaller microbatch or more recompute: give the plan more GPUs or GPUs with more memory")
    return InfeasibleError(
        f"plan {plan.name} does not fit: GPU {worst.gpu} needs {need_text} in {worst.stage} "
        f"but has {has_text} ({len(report.overflowing)} GPU x stage pairs overflow)",
        plan.loc, hint, source or None, width=len(plan.name) if plan.loc else 1)


def require_fit(module: Module, *plans: str) -> None:
    """Raise `infeasible_error` for the first of `plans` that does not fit (the check is
    what `nereusc check` runs: a transition into or out of such a plan is refused before
    any pass spends time on it)."""
    for name in plans:
        plan = module.plan(name)
        report = check_plan(module, plan)
        if not report.feasible:
            raise infeasible_error(plan, report, module=module)
