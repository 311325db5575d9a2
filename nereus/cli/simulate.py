"""`nereus simulate TRACE [--json] [--plot out.png] [--margin x]`: replay a drift trace under the
fixed, greedy, Nereus and oracle policies (nereus.controller.simulator)."""

from __future__ import annotations

import json
import math

import click

from nereus.cli.errors import reports_errors, traceback_option


def _fmt(x) -> str:
    return "inf" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.2f}"


def plot(result: dict, path: str, title: str) -> None:
    """Per-step latency of every policy and the transitions each took (cf. the paper's Fig. 11)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in result["steps"]]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    colors = {"fixed": "tab:gray", "greedy": "tab:orange", "nereus": "tab:blue", "oracle": "tab:green"}
    for name, summary in result["policies"].items():
        ys = [r[name] if math.isfinite(r[name]) else float("nan") for r in result["steps"]]
        top.plot(steps, ys, label=f"{name} (mean {summary['mean_step_s']:.1f} s)", color=colors.get(name), lw=1.2)
        for t in result["transitions"].get(name, []):
            top.axvline(t["step"], color=colors.get(name), alpha=0.25, lw=0.8)
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


@click.command("simulate")
@click.argument("trace", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object on the last line.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a PNG of per-step latency.")
@click.option("--margin", type=float, default=0.1, show_default=True, help="Admission margin (confidence setting).")
@click.option("--steps", "show_steps", is_flag=True, help="Print every step's latency per policy.")
@click.option("--estimate-transitions", is_flag=True,
              help="Estimate transition costs from bytes/bandwidth instead of compiling each transition.")
@traceback_option
@reports_errors
def simulate_command(trace, as_json, plot_path, margin, show_steps, estimate_transitions, traceback):
    """Replay a drift trace under fixed, greedy, Nereus and oracle policies."""
    if plot_path:
        from nereus.cli.extras import require

        require(("matplotlib",), "`nereus simulate --plot`")
    from nereus.controller.simulator import load_trace, simulate

    loaded = load_trace(trace)
    result = simulate(loaded, margin=margin, transition_method="estimate" if estimate_transitions else "compile")
    if show_steps:
        names = list(result["policies"])
        click.echo("step  response  gpus  " + "  ".join(f"{n:>9s}" for n in names) + "   best")
        for r in result["steps"]:
            click.echo(f"{r['step']:4d}  {r['response']:8d}  {r['gpus']:4d}  "
                       + "  ".join(f"{_fmt(r[n]):>9s}" for n in names) + f"  {_fmt(r['best_s'])}")
    for name, moves in result["transitions"].items():
        for move in moves:
            click.echo(f"{name}: step {move['step']}: transition {move['seconds']:.2f} s — {move['why']}")
    click.echo(f"{'policy':8s} {'mean step s':>12s} {'gap to best':>12s} {'transitions':>12s} {'transition s':>13s} "
               f"{'share':>8s} {'ctl ms/step':>12s}")
    for name, s in result["policies"].items():
        gap = "-" if s["mean_gap_to_best"] is None else f"{100 * s['mean_gap_to_best']:.1f}%"
        ctl = f"{s['controller_ms_per_step']:.2f}" if "controller_ms_per_step" in s else "-"
        click.echo(f"{name:8s} {s['mean_step_s']:12.2f} {gap:>12s} {s['transitions']:12d} {s['transition_s']:13.2f} "
                   f"{100 * s['transition_share']:7.3f}% {ctl:>12s}")
    if plot_path:
        plot(result, plot_path, f"{trace} (margin {margin:g})")
        click.echo(f"wrote {plot_path}")
    if as_json:
        click.echo(json.dumps({"name": "simulate", "trace": trace, "margin": margin,
                               "policies": result["policies"]}))
