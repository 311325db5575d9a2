"""`nereusc FILE [--transition S1:S2] [--set K=V]... [--emit summary|text|dot|json] [-o OUT]`.

Without --emit: check every plan's memory (the `check` table), then compile every declared
transition and print its summary; exit 1 if a plan does not fit. With --emit: compile the
chosen transition (`--transition`, or the only one declared) and write that level: summary,
dag (the transition DAG's records in their stable order), text (a listing of rounds),
dot (Graphviz) or json (the program, docs/program.md).
"""

from __future__ import annotations

import json
import os
import sys

import click

from nereus.cli.errors import reports_errors, traceback_option
from nereus.ir.diagnostics import NereusError, SemanticError
from nereus.ir.units import human_bytes


TRANSITION_HINT = "write --transition S1:S2 (or quote the arrow: --transition 'S1->S2')"


def split_transition(text: str) -> tuple[str, str]:
    """`S1:S2` (shell-safe, the documented form) or `S1->S2` (needs quotes in a shell,
    where an unquoted `>` is a redirect) → ("S1", "S2"); SemanticError otherwise."""
    for separator in ("->", ":"):
        source, sep, target = text.partition(separator)
        if sep and source.strip() and target.strip() and ":" not in target and "->" not in target:
            return source.strip(), target.strip()
    raise SemanticError(f"--transition {text!r} is not of the form S1:S2", hint=TRANSITION_HINT)


def _pairs(module, transition: str | None) -> list[tuple[str, str]]:
    if transition:
        source, target = split_transition(transition)
        names = [plan.name for plan in module.plans]
        for plan in (source, target):
            if plan not in names:  # before any output: the plan table would only bury the error
                raise SemanticError(f"--transition names no plan {plan!r} of {module.file}",
                                    hint=f"plans: {', '.join(names)}")
        if source == target:  # as `transition S1 -> S1` in a file
            raise SemanticError(f"--transition from plan {source} to itself",
                                hint="a transition goes between two different plans")
        return [(source, target)]
    return [(t.source, t.target) for t in module.transitions]


RANK_PIPELINE = "diff,dag,resources,fusion,lower"


def _source_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


def summary_text(summary: dict) -> str:
    """A human summary of `nereus.passes.summarize`'s dict."""
    if "bytes" not in summary:  # the pipeline stopped before lower
        return "\n".join([f"transition {summary['transition']}"] + [
            f"  {name}  {' '.join(s['primitives']) or ('unchanged' if s['unchanged'] else '-')}"
            for name, s in summary["stages"].items()])
    b = summary["bytes"]
    lines = [f"transition {summary['transition']}: {summary['rounds']} rounds, {summary['messages']} messages,"
             f" predicted {summary['predicted_seconds']:.3f} s",
             f"  bytes moved {human_bytes(b['total'])} (local {human_bytes(b['local'])}, intra-node {human_bytes(b['intra_node'])},"
             f" inter-node {human_bytes(b['inter_node'])}, staged {human_bytes(b['staged'])}); kept in place {human_bytes(b['kept'])}",
             f"  lower bound (bytes whose owner changes) {human_bytes(summary['lower_bound_bytes'])};"
             f" sent {human_bytes(b['intra_node'] + b['inter_node'])}"]
    bounds = summary.get("bounds")
    if bounds and bounds["busiest_nic_seconds"]:
        ratio = summary["predicted_seconds"] / bounds["busiest_nic_seconds"]
        lines.append(f"  link bounds: busiest NIC {bounds['busiest_nic_seconds']:.3f} s (node {bounds['busiest_node']}),"
                     f" average NIC {bounds['average_nic_seconds']:.3f} s; predicted {ratio:.2f}x the busiest")
    peak = summary["peak_memory"]
    when = "before round 0" if peak["round"] < 0 else f"in round {peak['round']}"
    free = peak["free_bytes"]
    # the model is named where it is not the compiler's default (cuda)
    model = "" if peak.get("memory_model", "cuda") == "cuda" else f" ({peak['memory_model']} memory model)"
    lines.append(f"  peak memory {human_bytes(peak['bytes'])} of {human_bytes(peak['capacity_bytes'])} usable"
                 f" ({peak['fraction']:.1%}) on GPU {peak['gpu']} {when}{model}; headroom {human_bytes(peak['headroom_bytes'])};"
                 f" {'-' if free < 0 else ''}{human_bytes(abs(free))} of the GPU's {human_bytes(peak['gpu_bytes'])} free")
    if peak["warning"]:
        lines.append(f"  warning: GPU {peak['gpu']} peaks with less than {peak['free_margin']:.0%} of its memory free"
                     " during this transition: the CUDA context, NCCL's buffers and allocator fragmentation, which the"
                     " compiler does not count, can make it run out")
        lines.append(f"  hint: {peak['hint']}")
    if summary["resource_edges"]:
        edges = ", ".join(f"{k} {v}" for k, v in sorted(summary["resource_edges"].items()))
        lines.append(f"  resource edges: {edges}")
    for note in summary["notes"]:
        lines.append(f"  note: {note}")
    rows = []
    for name, stage in summary["stages"].items():
        if stage["unchanged"]:
            rows.append((name, "unchanged", ""))
            continue
        kinds: dict = {}
        for p in stage["primitives"]:
            kind = p.split("(")[0]
            kinds[kind] = kinds.get(kind, 0) + 1
        prims = " ".join(f"{k}×{n}" for k, n in kinds.items()) or "-"
        if stage["kept_units"]:
            prims += f" kept×{stage['kept_units']}"
        rows.append((name, prims, " ".join(f"{k} {n}" for k, n in stage.get("ops", {}).items())))
    # each column as wide as its widest cell (a fixed 24 shifted the ops of a long row)
    width = max(len(name) for name, _, _ in rows)
    prims_width = max([24] + [len(prims) for _, prims, ops in rows if ops])
    for name, prims, ops in rows:
        lines.append(f"  {name:<{width}}  {prims:<{prims_width}} {ops}".rstrip() if ops else f"  {name:<{width}}  {prims}")
    return "\n".join(lines)


def _print_after(name: str, state) -> None:
    parts = [f"after {name}:"]
    if name == "diff":
        parts.append(f"{len(state.diff.changed())} model-stage(s) change")
    elif name == "dag":
        d = state.dag
        parts.append(f"{len(d.allocs)} allocs, {len(d.xfers)} transfers, {len(d.frees)} frees")
    elif name == "resources":
        s = state.schedule
        parts.append(f"{len(s.rounds)} rounds, {len(s.edges)} resource edges, {s.chunked} chunked")
    elif name == "fusion":
        parts.append(f"{sum(len(m) for m in state.messages)} messages")
    elif name == "lower":
        parts.append(f"program of {state.program.num_rounds} rounds")
    elif name == "cost":
        parts.append(f"{state.cost.seconds:.4f} s predicted, {human_bytes(state.cost.bytes_total)}")
    click.echo(" ".join(parts), err=True)


@click.command("compile")
@click.argument("file", type=click.Path())  # a folder: reported by the command (JSON with --json)
@click.option("--transition", metavar="S1:S2",
              help="Compile this transition (any two plans of FILE); 'S1->S2' quoted also works.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a value first, e.g. --set workload.response=8192 (repeatable).")
@click.option("--emit", type=click.Choice(["summary", "dag", "text", "dot", "json"]),
              help="Output level: summary, dag (the transition DAG's records), text (rounds), dot, json (program).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              help="Write the output here instead of stdout.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output (summaries and plan checks as JSON).")
@click.option("--time-passes", is_flag=True, help="Print each pass's wall time to stderr.")
@click.option("--print-after-all", is_flag=True, help="Print a line about the IR after every pass to stderr.")
@click.option("--pipeline", metavar="PASSES", help="Pass pipeline, e.g. diff,dag,resources,fusion{bucket=256MiB},lower,cost.")
@click.option("--rank", type=int, metavar="R",
              help="With --emit json: write rank R's program alone (its ops, shards and peers; docs/program.md).")
@click.option("--program-version", type=click.Choice(["1", "2"]), default="2", show_default=True,
              help="With --emit json: the JSON program version (2: families and ranges; 1: every member named).")
@click.option("--memory-model", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="Device memory model the rounds are made safe under and the program records: cuda (GPUs: a "
                   "send's buffers on both GPUs, also out of host memory) or cpu (the gloo runtime; docs/program.md).")
@traceback_option
@reports_errors
def compile_command(file, transition, overrides, emit, output, as_json, time_passes, print_after_all, pipeline,
                    rank, program_version, memory_model, traceback):
    """Check FILE's plans and compile its transitions."""
    from nereus.cli.check import load_module
    from nereus.passes import compile_transition
    from nereus.backends.json_program import program_json

    module = load_module(file, overrides)
    pairs = _pairs(module, transition)
    fits = True
    checked: dict = {}
    if rank is not None and emit != "json":
        raise SemanticError("--rank selects one rank's program: it needs --emit json",
                            hint="nereusc FILE --transition S1:S2 --emit json --rank R")
    if rank is not None and pipeline is None:
        pipeline = RANK_PIPELINE  # one rank's program needs no cost estimate
    if pipeline:  # an error in the option is the command line's: said once, before any output
        from nereus.passes.manager import parse_pipeline

        parse_pipeline(pipeline)
    if emit is None:
        from nereus.cli.check import check_checkpoints, describe, print_warnings, report_plans
        from nereus.ir.node_groups import node_span_warnings

        warnings = check_checkpoints(module, _source_text(module.file))
        warnings += node_span_warnings(module, _source_text(module.file))
        if not as_json:
            click.echo(f"{file}: {describe(module)}")
            print_warnings(file, warnings)
        fits = report_plans(module, as_json, collect=checked, warnings=warnings)
    elif emit == "summary":  # the plans summarized (every plan without --transition), checked: an unfit one is the error
        from nereus.passes.infeasible import require_fit

        try:
            named = {plan for pair in pairs for plan in pair} if transition else {p.name for p in module.plans}
            require_fit(module, *(p.name for p in module.plans if p.name in named))
        except NereusError as error:
            raise error.with_source(_source_text(module.file)) if error.loc is not None else error
    elif len(pairs) != 1:
        raise SemanticError(f"--emit {emit} writes one transition and {file} declares {len(pairs)}",
                            hint="choose one with --transition S1:S2")
    hook = _print_after if print_after_all else None
    results = []
    unfit = set()
    if not fits:  # the table above already reported these plans: compile only what fits
        from nereus.passes.feasibility import check_plan

        unfit = {p.name for p in module.plans if not check_plan(module, p).feasible}
    failed: list = []  # without --emit: a transition that cannot compile is reported, the others still are
    declared = {(t.source, t.target): t.loc for t in module.transitions}
    for source, target in pairs:
        if source in unfit or target in unfit:
            continue
        try:
            # the plan table above has checked every plan already (emit None)
            compiled = compile_transition(module, source, target, pipeline=pipeline, print_after_all=hook,
                                          check_fit=emit is not None, memory_model=memory_model)
        except NereusError as error:  # quote the source line, as `nereusc check` does
            from nereus.passes.manager import PipelineError

            if error.loc is None and declared.get((source, target)) is not None and not isinstance(error, PipelineError):
                error.loc = declared[(source, target)]  # at the transition's declaration
            error = error.with_source(_source_text(module.file)) if error.loc is not None else error
            if emit is not None:
                raise error
            failed.append(error)
            continue
        results.append(compiled)
        if time_passes:
            total = sum(compiled.timings.values())
            listing = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in compiled.timings.items())
            click.echo(f"time {source} -> {target}: {listing}; total {total * 1000:.1f} ms", err=True)
    _check_emitted(results, emit)
    over = [c for c in results if (c.summary.get("peak_memory") or {}).get("fraction", 0.0) > 1.0]
    if over and emit == "json":  # a program that cannot run is not written
        raise NereusError(_over_memory(over[0]), hint=_OVER_HINT)
    if failed and as_json and "error" not in checked:  # the first error of the run, as a plan's would be
        from nereus.cli.errors import error_json

        checked["error"] = error_json(failed[0])
    if emit in (None, "summary"):
        if as_json:
            text = json.dumps({**checked, "transitions": [c.summary for c in results]}, indent=None)
        else:
            text = "\n".join(summary_text(c.summary) for c in results)
    elif emit == "json" and rank is not None:
        from nereus.backends.rank_json import rank_program_json

        text = json.dumps(rank_program_json(results[0], rank, int(program_version)), separators=(",", ":"))
    elif emit == "json":
        text = json.dumps(program_json(results[0], int(program_version)), separators=(",", ":"))
    elif emit == "dag":
        from nereus.backends.text import dag_text

        text = dag_text(results[0].dag).rstrip("\n")
    elif emit == "text":
        from nereus.backends.text import program_text

        text = program_text(results[0].program, results[0].summary).rstrip("\n")
    else:
        from nereus.backends.dot import program_dot

        text = program_dot(results[0].program).rstrip("\n")
    if not results and emit == "summary":  # nothing declared: an empty list, and a word why
        if as_json:
            click.echo(json.dumps({"transitions": []}))
        else:
            click.echo(f"{file} declares no transition: nothing to summarize", err=True)
    elif not results and not (as_json and checked):
        pass  # nothing declared: the plan table said it all
    elif output and output != "-":
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
        # a word where the output went (a 16-GPU program is tens of MB, written in silence before)
        click.echo(f"wrote {output} ({human_bytes(os.path.getsize(output))})", err=True)
    else:
        click.echo(text)
    if failed:
        if not as_json:
            for error in failed:
                click.echo(error.format(), err=True)
        sys.exit(2)
    if over:  # shown above, and an error: the program would run out of memory
        click.echo(f"error: {_over_memory(over[0])}\nhint: {_OVER_HINT}", err=True)
        sys.exit(2)
    if not fits:  # like `nereusc check`: an infeasible plan is an error
        sys.exit(2)


# the IR each emit level prints, and the pass that makes it
_EMIT_NEEDS = {"json": ("program", "lower"), "text": ("program", "lower"), "dot": ("program", "lower"),
               "dag": ("dag", "dag")}


def _check_emitted(results: list, emit) -> None:
    """The IR `emit` prints exists: a --pipeline that stops before the pass making it is
    the user's error, named as such."""
    if emit not in _EMIT_NEEDS or not results:
        return
    what, stage = _EMIT_NEEDS[emit]
    if getattr(results[0], what) is None:
        noun = "program" if what == "program" else "DAG"
        raise SemanticError(f"the pipeline stopped before '{stage}': no {noun} to emit",
                            hint=f"--emit {emit} needs '{stage}' in --pipeline (and the passes before it), "
                                 "or leave --pipeline out")


_OVER_HINT = "keep the `resources` pass in --pipeline: it schedules the transition within memory"


def _over_memory(compiled) -> str:
    peak = compiled.summary["peak_memory"]
    return (f"transition {compiled.summary['transition']} needs {human_bytes(peak['bytes'])} on GPU {peak['gpu']} "
            f"in round {peak['round']}, {peak['fraction']:.1%} of its usable memory: the program does not fit")
