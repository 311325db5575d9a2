"""`nereus simulate TRACE [--json] [--plot out.png] [--margin x] [--steps]`: replay a drift trace
under the fixed, greedy and Nereus policies and the DP oracle (nereus.controller.simulator).
Progress goes to stderr; the summary table to stdout, or with --json one JSON object
(the table then goes to stderr with the progress)."""

from __future__ import annotations

import json
import math
import os
import re
import sys

import click

from nereus.cli.errors import reports_errors, traceback_option
from nereus.cli.progress import StderrProgress

COLORS = {"fixed": "tab:gray", "greedy": "tab:orange", "nereus": "tab:blue", "oracle": "tab:green"}


def _fmt(x) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.2f}"


def plot(result: dict, path: str, title: str) -> None:
    """Per-step latency of every policy, its transitions, and an ✕ where a policy failed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in result["steps"]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for name, summary in result["policies"].items():
        ys = [r.get(name) if r.get(name) is not None else float("nan") for r in result["steps"]]
        mean = summary["mean_step_s"]
        label = f"{name} (mean {mean:.1f} s)" if mean is not None else name
        failed = summary["failed_at"]
        if failed is not None:
            label += f", failed at step {failed}"
        top.plot(steps, ys, label=label, color=COLORS.get(name), lw=1.2)
        for t in result["transitions"].get(name, []):
            top.axvline(t["step"], color=COLORS.get(name), alpha=0.25, lw=0.8)
        if failed is not None:
            before = [y for y in ys[:failed] if y == y]
            top.plot([failed], [before[-1] if before else 0.0], marker="X", markersize=12, color=COLORS.get(name),
                     markeredgecolor="black", linestyle="none")
            top.axvline(failed, color=COLORS.get(name), ls="--", lw=1.0)
    top.set_ylabel("step latency (s)")
    top.set_title(title)
    top.legend(loc="upper left", fontsize=8)
    bottom.plot(steps, [r["response"] for r in result["steps"]], color="tab:purple", label="response tokens")
    twin = bottom.twinx()
    twin.step(steps, [r["gpus"] for r in result["steps"]], color="tab:red", where="post", label="GPUs")
    bottom.set_ylabel("response")
    twin.set_ylabel("GPUs")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def move_line(name: str, move: dict) -> str:
    """One policy's move: the seconds it took in the simulated world, labelled as such
    apart from the prediction its reason quotes (two unlabelled transition times before)."""
    why = re.sub(r"^step \d+: ", "", move["why"])  # the line names the step once
    return f"{name}: step {move['step']}: moved in {move['seconds']:.2f} s (true transition time) — {why}"


@click.command("simulate")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object on stdout (the table goes to stderr).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a PNG of per-step latency.")
@click.option("--margin", type=float, default=0.1, show_default=True, help="Admission margin (confidence setting).")
@click.option("--steps", "show_steps", is_flag=True, help="Print every step's latency per policy.")
@click.option("--estimate-transitions", is_flag=True,
              help="Controllers estimate transition costs from bytes/bandwidth instead of compiling each one.")
@click.option("--oracle-grid", type=float, default=0.05, show_default=True,
              help="Response ratio between the oracle's extra search points.")
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
@traceback_option
@reports_errors
def simulate_command(trace, as_json, plot_path, margin, show_steps, estimate_transitions, oracle_grid, quiet,
                     traceback):
    """Replay a drift trace under fixed, greedy and Nereus policies and the DP oracle."""
    if not (math.isfinite(margin) and 0 <= margin < 1):
        raise click.BadParameter(f"must be at least 0 and below 1 (a share of the predicted gain), not {margin}",
                                 param_hint="--margin")
    if not (math.isfinite(oracle_grid) and oracle_grid > 0):
        raise click.BadParameter(f"must be a finite ratio > 0 (0.05: responses 5% apart), not {oracle_grid}",
                                 param_hint="--oracle-grid")
    if plot_path:
        from nereus.cli.extras import require

        require(("matplotlib",), "`nereus simulate --plot`")
        folder = os.path.dirname(os.path.abspath(plot_path))
        if not os.path.isdir(folder):  # before the replay, not after it
            raise click.BadParameter(f"its folder {folder} does not exist", param_hint="--plot")
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        extension = os.path.splitext(plot_path)[1].lstrip(".").lower()
        if extension not in kinds:
            raise click.BadParameter(f"{plot_path!r}: the file name must end in one of "
                                     f"{', '.join('.' + k for k in sorted(kinds))}", param_hint="--plot")
    from nereus.controller.simulator import load_trace, oracle_points, simulate

    loaded = load_trace(trace)
    try:
        oracle_points(loaded, oracle_grid)  # checked before the replay, not after it
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--oracle-grid") from None
    if not quiet:
        click.echo(f"simulating {len(loaded.steps)} steps of {trace} ...", err=True)
    result = simulate(loaded, margin=margin, transition_method="estimate" if estimate_transitions else "compile",
                      oracle_grid=oracle_grid, progress=None if quiet else StderrProgress())
    # with --json, stdout is the one JSON object: the table and the moves go to stderr
    say = (lambda text: click.echo(text, err=True)) if as_json else click.echo
    names = list(result["policies"])
    if show_steps:
        say("step  response  gpus  " + "  ".join(f"{n:>9s}" for n in names))
        for r in result["steps"]:
            say(f"{r['step']:4d}  {r['response']:8d}  {r['gpus']:4d}  "
                       + "  ".join(f"{_fmt(r.get(n)):>9s}" for n in names))
    for name, moves in result["transitions"].items():
        for move in moves:
            if name != "oracle" or show_steps:
                say(move_line(name, move))
    say(f"{'policy':8s} {'steps run':>9s} {'failed at':>9s} {'mean step s':>12s} {'total s':>10s} "
               f"{'vs oracle':>10s} {'transitions':>11s} {'transition s':>12s} {'share':>8s} {'ctl ms/step':>11s}")
    for name, s in result["policies"].items():
        gap = "-" if s.get("gap_to_oracle") is None else f"{100 * s['gap_to_oracle']:+.2f}%"
        ctl = f"{s['controller_ms_per_step']:.2f}" if "controller_ms_per_step" in s else "-"
        failed = "-" if s["failed_at"] is None else str(s["failed_at"])
        say(f"{name:8s} {s['steps_run']:9d} {failed:>9s} {_fmt(s['mean_step_s']):>12s} {s['total_s']:10.1f} "
                   f"{gap:>10s} {s['transitions']:11d} {s['transition_s']:12.2f} {100 * s['transition_share']:7.3f}% "
                   f"{ctl:>11s}")
    for name, s in result["policies"].items():
        if s["failed_at"] is not None and s.get("failed_why"):
            say(f"{name} failed at step {s['failed_at']}: {s['failed_why']}")
    common = next(iter(result["policies"].values()))["common_steps"]
    if common == 0:  # nothing to compare on: say so, not "over the 0 steps"
        idle = [name for name, s in result["policies"].items() if s["steps_run"] == 0]
        say(f"no step is common to every policy ({', '.join(idle)} ran no step): "
            "each policy is summarised over the steps it ran")
    elif common < len(result["steps"]):
        say(f"over the {common} steps every policy ran: " + ", ".join(
            f"{name} {_fmt(s['common_mean_step_s'])} s/step" for name, s in result["policies"].items()))
    if plot_path:
        plot(result, plot_path, f"{trace} (margin {margin:g})")
        click.echo(f"wrote {plot_path}", err=as_json)
    if as_json:
        from nereus.cli.launch import json_safe

        click.echo(json.dumps(json_safe({"name": "simulate", "trace": trace, "margin": margin,
                                         "policies": result["policies"], "oracle": result["oracle"]}),
                              allow_nan=False))
    sys.stderr.flush()
