"""`nereusc search FILE`: the fastest plans that fit the file's cluster, models and workload.

Input: a `.nir` file (its cluster, models and workload; its plans only for `--from`).
Output on stdout: the `--top` fastest plans of the controller's search space under the cost
model (nereus.controller.search.search_plans, with the cost model's prior coefficients: the
calibrated H200 layer table, no job measurements), each a `.nir` plan block preceded by
comment lines (predicted seconds per stage, the worst GPU's memory as `nereusc check`
computes it, and with `--from` the compiled transition and its payback). The whole output is
valid `.nir`: appended to the file, `nereusc check` accepts every block and reports the same
memory (tests/cli/test_search.py). With `--json`, one JSON object instead.
Invariant: a printed plan fits by the feasibility pass (the search's memory model is the
pass's; a plan the pass would refuse is never printed).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

import click

from nereus.cli.check import load_module, set_option
from nereus.cli.errors import reports_errors, traceback_option
from nereus.ir.units import human_bytes

MAX_TOP = 100


def _cluster_for(module, gpus: int):
    """The module with a cluster of at least `gpus` GPUs (nodes added when `--gpus` asks
    for more than the file's cluster has; the search places plans on GPUs 0..gpus−1)."""
    cluster = module.cluster
    if gpus <= cluster.num_gpus:
        return module
    return replace(module, cluster=replace(cluster, nodes=gpus // cluster.gpus_per_node))


def _check_gpus(module, gpus) -> int:
    cluster = module.cluster
    if gpus is None:
        return cluster.num_gpus
    per_node = cluster.gpus_per_node
    if gpus < 1 or (gpus > per_node and gpus % per_node):
        raise click.BadParameter(f"{gpus} is not a GPU count the search places: 1..{per_node} (part of one "
                                 f"node) or whole nodes of {per_node} GPUs ({per_node}, {2 * per_node}, ...)",
                                 param_hint="--gpus")
    return gpus


def _names(module, top: int) -> str:
    """A plan-name prefix that gives names no plan of the file has (the blocks can be pasted)."""
    taken = {plan.name for plan in module.plans}
    prefix = "best"
    while any(f"{prefix}{k}" in taken for k in range(1, top + 1)):
        prefix += "_"
    return prefix


def _plan_text(plan, stage_seconds: dict, waves: dict) -> list[str]:
    """The plan block as `nereusc fmt` prints it, each placement line ending in a comment
    with its predicted seconds (and its generation waves, when more than one)."""
    from nereus.ir.printer import print_plan

    lines = []
    for anchor, text in print_plan(plan):
        name = anchor[2] if len(anchor) == 3 and anchor[2] != "}" else None
        if name is None:
            lines.append(text)
            continue
        note = f"# {stage_seconds[name]:.2f} s"
        if waves.get(name, 1) > 1:
            note += f" in {waves[name]} waves"
        lines.append(f"{text}  {note}")
    return lines


def _memory(module, workload, result):
    """The worst GPU's memory of a found plan as `nereusc check` computes it ("checked":
    true), or, for a plan whose generation runs in waves (--waves), as the search computes
    it with those waves ("checked": false: the check sizes the KV cache for every sequence at
    once and refuses it); None when the check refuses a plan without waves (a bug)."""
    from nereus.controller.memory import plan_memory
    from nereus.passes.feasibility import check_plan

    report = check_plan(module, result.plan)
    if report.feasible:
        return {"worst_gpu": report.worst.gpu, "stage": report.worst.stage, "used_bytes": report.worst.bytes,
                "capacity_bytes": report.capacity_bytes, "headroom_bytes": report.headroom_bytes, "checked": True}
    if all(w <= 1 for w in result.waves.values()):
        return None
    waved = plan_memory(module, workload, result.plan, allow_waves=True)
    return {"worst_gpu": waved.worst_gpu, "stage": waved.worst_stage, "used_bytes": waved.worst_bytes,
            "capacity_bytes": waved.capacity_bytes, "headroom_bytes": waved.capacity_bytes - waved.worst_bytes,
            "checked": False}


def _payback(source_s: float, source_fits: bool, target_s: float, transition_s: float):
    """(gain s/step, steps until the move has paid for itself, or None): None when the
    target is not faster; 0 when the source cannot run the workload (any move is forced)."""
    if not source_fits:
        return None, 0
    gain = source_s - target_s
    if gain <= 0:
        return gain, None
    return gain, math.ceil(transition_s / gain) if transition_s > 0 else 0


@click.command("search")
@click.argument("file", type=click.Path())
@set_option
@click.option("--gpus", type=int, metavar="N",
              help="Search for N GPUs (ids 0..N-1): part of one node or whole nodes; more than the cluster "
                   "has adds nodes to it. Default: the whole cluster.")
@click.option("--top", type=int, default=3, show_default=True, metavar="K", help="How many plans, fastest first.")
@click.option("--from", "source", metavar="PLAN",
              help="A plan of FILE the job runs now: add each plan's compiled transition from it (predicted "
                   "seconds) and the steps the move takes to pay back.")
@click.option("--waves", is_flag=True,
              help="Let generation run in KV-cache waves (a serving engine's batching) when a replica's "
                   "sequences do not fit at once. `nereusc check` sizes the cache for all of them, so it "
                   "refuses such plans.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of .nir text.")
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
@traceback_option
@reports_errors
def search_command(file, overrides, gpus, top, source, waves, as_json, quiet, traceback):
    """Print the fastest plans that fit FILE's cluster, models and workload.

    Plans are printed as .nir plan blocks (valid .nir: append them to FILE and `nereusc
    check` accepts them) with comment lines: the predicted seconds per stage and per
    model-stage under the cost model, and the worst GPU's memory. The search space places
    every model-stage on GPUs 0..N-1 (colocated): dp, tp (inside a node), pp, offload of
    inference units. Exits 2 on bad input or when no plan fits.
    """
    from nereus.cli.progress import StderrProgress
    from nereus.controller.controller import predict_plan
    from nereus.controller.cost_model import CostModel, stage_breakdown
    from nereus.controller.search import search_plans
    from nereus.controller.transition_cost import transition_seconds
    from nereus.ir.diagnostics import SemanticError
    from nereus.passes.feasibility import check_plan

    if not 1 <= top <= MAX_TOP:
        raise click.BadParameter(f"must be 1..{MAX_TOP}, not {top}", param_hint="--top")
    module = load_module(file, overrides)
    gpus = _check_gpus(module, gpus)
    plans = {plan.name: plan for plan in module.plans}
    if source is not None and source not in plans:
        raise click.BadParameter(f"no plan named {source!r} in {file}" + (
            f"; its plans: {', '.join(plans)}" if plans else " (it has no plans)"), param_hint="--from")
    progress = None if quiet else StderrProgress(after=2.0)
    wide = _cluster_for(module, gpus)
    workload = module.workload
    cost = CostModel(wide)
    prefix = _names(module, top)
    found = [replace(r, plan=replace(r.plan, name=f"{prefix}{k + 1}"))  # best1 also when --top 1
             for k, r in enumerate(search_plans(wide, workload, cost, gpus, top, prefix, allow_waves=waves))
             if r.plan is not None]
    if not found:
        raise SemanticError(
            f"no plan of the search space fits workload {workload.name} (batch {workload.batch}, response "
            f"{workload.response}) on {gpus} GPUs of cluster {module.cluster.name}", workload.loc,
            "try more GPUs (--gpus), a smaller microbatch, `recompute full`"
            + (", or --waves (generation in KV-cache waves)" if not waves else ""))
    if progress:
        progress("search", 1, 1)
    source_info = None
    if source is not None:
        before = plans[source]
        predicted = predict_plan(wide, workload, cost, before, gpus, allow_waves=waves)
        beyond = max(g for p in before.placements for g in p.gpus) >= gpus
        source_info = {"plan": source, "fits": predicted.feasible, "predicted_step_s": predicted.step_s,
                       "why_not": None if predicted.feasible else
                       f"it uses GPUs beyond 0..{gpus - 1}" if beyond else "it does not fit in memory"}
    results = []
    for k, r in enumerate(found):
        memory = _memory(wide, workload, r)
        if memory is None:  # the search's memory model is the pass's: a bug if they differ
            report = check_plan(wide, r.plan)
            click.echo(f"warning: {r.plan.name} fits by the search but not by `nereusc check` "
                       f"(GPU {report.worst.gpu}: {human_bytes(report.worst.bytes)}); left out", err=True)
            continue
        times = {p.model_stage: r.stage_seconds[str(p.model_stage)] for p in r.plan.placements}
        entry = {"name": r.plan.name, "predicted_step_s": r.predicted_s,
                 "stage_seconds": stage_breakdown(wide, r.plan, times), "model_stage_seconds": r.stage_seconds,
                 "waves": r.waves, "memory": memory}
        if source_info is not None:
            seconds, how = transition_seconds(wide, workload, plans[source], r.plan)
            gain, steps = _payback(source_info["predicted_step_s"], source_info["fits"], r.predicted_s, seconds)
            entry["transition"] = {"seconds": seconds, "how": how, "gain_s_per_step": gain, "payback_steps": steps}
            if progress:
                progress("transitions compiled", k + 1, len(found))
        entry["plan"] = r.plan
        results.append(entry)
    summary = {"file": file, "gpus": gpus, "cluster": module.cluster.name, "workload": workload.name,
               "candidates": found[0].candidates, "leaves": found[0].leaves, "search_s": found[0].search_s,
               "waves": waves, "from": source_info}
    if as_json:
        from nereus.cli.launch import json_safe

        plans_json = []
        for entry in results:
            plan = entry.pop("plan")
            plans_json.append({**entry, "nir": "\n".join(_plan_text(plan, entry["model_stage_seconds"],
                                                                      entry["waves"]))})
        click.echo(json.dumps(json_safe({**summary, "plans": plans_json}), allow_nan=False))
        return
    click.echo(_header(module, file, gpus, workload, summary, source_info))
    for entry in results:
        click.echo("")
        click.echo("\n".join(_comments(entry, source)))
        click.echo("\n".join(_plan_text(entry["plan"], entry["model_stage_seconds"], entry["waves"])))
    sys.stdout.flush()


def _header(module, file, gpus, workload, summary, source_info) -> str:
    cluster = module.cluster
    extra = "" if gpus <= cluster.num_gpus else f" (it has {cluster.num_gpus}: set `nodes {gpus // cluster.gpus_per_node}` to check these plans)"
    lines = [f"# nereusc search {file}: {gpus} GPUs of cluster {cluster.name}{extra}; workload {workload.name} "
             f"(batch {workload.batch}, prompt {workload.prompt}, response {workload.response})",
             f"# cost model: the roofline with the calibrated H200 layer table, no job measurements; "
             f"{summary['candidates']} layouts searched"]
    if source_info is not None:
        state = f"predicted {source_info['predicted_step_s']:.2f} s/step" if source_info["fits"] else \
            f"cannot run this workload: {source_info['why_not']} (any move is forced)"
        lines.append(f"# from {source_info['plan']}: {state}")
    return "\n".join(lines)


def _comments(entry: dict, source) -> list[str]:
    stages = " + ".join(f"{stage} {seconds:.2f}" for stage, seconds in entry["stage_seconds"].items())
    memory = entry["memory"]
    headroom = memory["headroom_bytes"]
    lines = [f"# {entry['name']}: predicted {entry['predicted_step_s']:.2f} s/step = {stages} s",
             f"# worst GPU {memory['worst_gpu']}: {human_bytes(memory['used_bytes'])} of "
             f"{human_bytes(memory['capacity_bytes'])} usable in {memory['stage']} "
             f"(headroom {'+' if headroom >= 0 else '-'}{human_bytes(abs(headroom))})"]
    if not memory["checked"]:
        waves = ", ".join(f"{ms} {w}" for ms, w in entry["waves"].items() if w > 1)
        lines[-1] += f" with generation in waves ({waves}); `nereusc check` sizes the KV cache for every sequence " \
                     "at once and refuses this plan"
    move = entry.get("transition")
    if move is not None:
        text = f"# from {source}: transition {move['seconds']:.3f} s ({move['how']})"
        if move["gain_s_per_step"] is None:
            text += "; forced (the current plan does not fit), paid at once"
        elif move["payback_steps"] is None:
            text += f"; not faster ({move['gain_s_per_step']:+.2f} s/step): never pays back"
        else:
            steps = move["payback_steps"]
            text += f"; saves {move['gain_s_per_step']:.2f} s/step: pays back in {steps} step{'' if steps == 1 else 's'}"
        lines.append(text)
    return lines
