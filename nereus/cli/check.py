"""`nereusc check FILE`: parse, validate and check every plan's memory feasibility."""

from __future__ import annotations

import json
import sys

import click

from nereus.cli.errors import reports_errors, traceback_option
from nereus.ir.diagnostics import NereusError, SemanticError
from nereus.ir.node_groups import node_span_warnings
from nereus.ir.model import Module
from nereus.ir.units import human_bytes

set_option = click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE",
    help="Override a value before checking, e.g. --set workload.response=8192 (repeatable).")


def load_module(path: str, overrides=()) -> Module:
    """Parse `path` and apply `--set` overrides; raises NereusError on bad input."""
    from nereus.ir import apply_overrides, parse_file

    module = parse_file(path)
    if overrides:
        module = apply_overrides(module, list(overrides))
    return module


def _read(path) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, TypeError, UnicodeDecodeError):
        return None


def _braces_cause(model, config: dict, entries: dict, changed: list) -> list:
    """The brace keys that make the checkpoint not fit: the first one whose return to
    config.json's value alone makes it fit, else all of them when their return together
    does, else none (the checkpoint does not fit its own config). A field the braces did
    not write but derive (head_dim from an overridden hidden) returns with each key."""
    import dataclasses

    from nereus.models.safetensors_header import compare_with_model

    derived = {k: v for k, v in config.items() if k not in changed and k not in ("dtype", "head")
               and hasattr(model, k) and getattr(model, k) != v}

    def fits(keys) -> bool:
        try:
            back = dataclasses.replace(model, **derived, **{k: config[k] for k in keys})
            return not compare_with_model(back, entries)[0]
        except (TypeError, ValueError):
            return False

    for key in changed:
        if fits([key]):
            return [key]
    return list(changed) if changed and fits(changed) else []


def _has_weights(directory: str) -> bool:
    """Whether the folder holds weights at all: a config.json alone, or with only its index
    (`huggingface-cli download ... --include "*.json"`), plans a run before the download."""
    import os

    try:
        return any(name.endswith(".safetensors") for name in os.listdir(directory))
    except OSError:
        return False


def check_checkpoints(module: Module, source: str | None = None, strict: bool = False) -> list[str]:
    """Each `hf("...")` model against its checkpoint's safetensors headers (no tensor data
    read): a tensor missing, of another shape or dtype is the error the runtime would give
    after launch, raised here at the model (at the brace keys, when reverting them to
    config.json's values removes it); the checkpoint's tensors no weight reads are
    returned as warnings. Unreadable or absent weights: an error when `strict` (a run is
    next; it names the files looked for), else a warning or nothing (planning needs none)."""
    from nereus.ir.diagnostics import NereusError
    from nereus.ir.model import key_loc
    from nereus.ir.printer import _value
    from nereus.models.hf import TIED_HEAD_HINT
    from nereus.models.safetensors_header import checkpoint_entries, compare_with_model, tied_head_conflict

    warnings = []
    for model in module.models:
        if model.checkpoint_dir is None or (not strict and not _has_weights(model.checkpoint_dir)):
            continue  # a config.json alone plans a run (no weights needed until it starts)
        try:
            entries = checkpoint_entries(model.checkpoint_dir)
        except NereusError as error:
            if strict:  # a run reads them next
                raise SemanticError(f"model {model.name}: {error.message}", model.loc, error.hint,
                                    source=source) from None
            # planning needs no weights (a Git LFS pointer, shards still downloading): said,
            # not refused; `nereus train` refuses them
            warnings.append(f"model {model.name}: its weights cannot be read yet ({error.message}); "
                            "nereus train will refuse them")
            continue
        problems, unused = compare_with_model(model, entries)
        conflict = tied_head_conflict(model, entries)
        if conflict is not None:
            raise SemanticError(f"model {model.name}: its checkpoint {model.checkpoint} {conflict}", model.loc,
                                TIED_HEAD_HINT, source=source)
        config = dict(model.checkpoint_fields)
        written = [k for k, _ in model.key_locs]  # the keys of the braces, in order
        changed = [k for k in written if k in config and getattr(model, k) != config[k] and k not in ("dtype", "head")]
        if problems:
            _, message = problems[0]
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            text = f"model {model.name}: its checkpoint {model.checkpoint} {message}{more}"
            cause = _braces_cause(model, config, entries, changed)
            if cause:
                shown = ", ".join(f"{k} {_value(getattr(model, k))} (config.json: {_value(config[k])})"
                                  for k in cause)
                raise SemanticError(text, key_loc(model, cause[0]),
                                    f"the braces set {shown}: remove them, or use a checkpoint with those values",
                                    source=source)
            raise SemanticError(text, model.loc, "its tensors do not match the sizes its own config.json states: "
                                "is config.json the checkpoint's own, and every shard complete?", source=source)
        if unused:
            shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
            why = f" (the braces set {', '.join(changed)})" if changed else ""
            warnings.append(f"model {model.name}: {len(unused)} tensors of {model.checkpoint} are not read{why}: "
                            f"{shown}; the model computes without them")
    return warnings


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def describe(module: Module) -> str:
    c, w = module.cluster, module.workload
    return (f"cluster {c.name}: {c.num_gpus} GPUs ({c.nodes} x {c.gpus_per_node}, {human_bytes(c.usable_gpu_bytes)} usable each); "
            f"{_count(len(module.models), 'model')}; workload {w.name} (batch {w.batch}, "
            f"prompt {w.prompt}, response {w.response}); "
            f"{_count(len(module.plans), 'plan')}; {_count(len(module.transitions), 'transition')}")


def feasibility_table(reports) -> str:
    header = ("plan", "fits", "worst GPU", "stage", "used", "headroom", "largest contributors")
    rows = []
    for r in reports:
        top = ", ".join(f"{c.model_stage} {c.kind} {human_bytes(c.bytes)}" for c in r.worst.contributors[:3])
        headroom = r.headroom_bytes
        rows.append((r.plan, "yes" if r.feasible else "NO", str(r.worst.gpu), r.worst.stage,
                     human_bytes(r.worst.bytes), ("+" if headroom >= 0 else "-") + human_bytes(abs(headroom)), top))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    return "\n".join(lines)


def model_sizes(module: Module) -> list[dict]:
    """Each model's parameter count (as transformers' num_parameters() counts it: a tied
    head once) and the bytes of its weights at its dtype."""
    from nereus.models import parameter_count

    return [{"model": m.name, "architecture": m.architecture, "parameters": parameter_count(m), "dtype": m.dtype,
             "bytes": parameter_count(m) * m.dtype_bytes, "checkpoint": m.checkpoint} for m in module.models]


def report_plans(module: Module, as_json: bool = False, plans=None, collect: dict | None = None,
                 warnings: list | None = None) -> bool:
    """Check every plan (or those named in `plans`), print the feasibility table and for
    each infeasible plan an error at the plan's location naming the worst GPU and stage
    (stderr); or, when `as_json`, one JSON object whose `error` field is the first
    infeasible plan's error object (nereus.cli.errors; absent when every plan fits), so
    that stdout is the whole answer (with `collect`, the fields are stored there for the
    caller to print in its own object instead). Returns True iff every plan fits."""
    from nereus.cli.errors import error_json
    from nereus.passes.feasibility import check_plan
    from nereus.passes.infeasible import infeasible_error

    selected = [p for p in module.plans if plans is None or p.name in plans]
    reports = [check_plan(module, plan) for plan in selected]
    errors = []
    source = None
    for plan, report in zip(selected, reports):
        if report.feasible:
            continue
        if source is None:
            try:
                with open(module.file, encoding="utf-8") as handle:
                    source = handle.read()
            except OSError:
                source = ""
        errors.append(infeasible_error(plan, report, source, module))
    if as_json:
        payload = {"file": module.file, "models": model_sizes(module), "plans": [r.to_json() for r in reports],
                   "feasible": not errors,
                   "warnings": [w.text() if isinstance(w, NereusError) else w for w in warnings or ()]}
        if errors:
            payload["error"] = error_json(errors[0])
        if collect is not None:
            collect.update(payload)
        else:
            click.echo(json.dumps(payload))
        return not errors
    click.echo(feasibility_table(reports))
    for error in errors:
        click.echo(error.format(), err=True)
    return not errors


@click.command("check")
@click.argument("file", type=click.Path())  # a folder: reported by the command (JSON with --json)
@set_option
@click.option("--plan", "plans", multiple=True, help="Check only these plans (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@traceback_option
@reports_errors
def check_command(file, overrides, plans, as_json, traceback):
    """Parse and validate FILE, then check that every plan fits in GPU memory.

    Exits 0 when everything fits, 2 on a syntax or rule error or an infeasible plan.
    """
    module = load_module(file, overrides)
    warnings = check_checkpoints(module, _read(module.file))
    unknown = [p for p in plans if p not in {plan.name for plan in module.plans}]
    if unknown:
        raise SemanticError(f"no plan named {unknown[0]!r} in {file}",
                            hint=f"--plan takes one of: {', '.join(plan.name for plan in module.plans)}")
    warnings += node_span_warnings(module, _read(module.file))
    if not as_json:
        click.echo(f"{file}: {describe(module)}")
        print_warnings(file, warnings)
    if not report_plans(module, as_json, set(plans) if plans else None, warnings=warnings):
        sys.exit(2)


def print_warnings(file: str, warnings: list) -> None:
    """Warnings on stderr: a located one as errors are (file:line:col, the line, a caret, a
    hint), a checkpoint's after the file name."""
    for warning in warnings:
        if isinstance(warning, NereusError):
            click.echo(warning.format(), err=True)
        else:
            click.echo(f"{file}: warning: {warning}", err=True)
