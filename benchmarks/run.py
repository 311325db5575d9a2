"""The benchmarks' one harness: list them, run one, check its result and keep it.

    python benchmarks/run.py --list                          # every benchmark: machine, what it measures
    python benchmarks/run.py NAME [ARGS...]                  # run it; ARGS go to the benchmark
    python benchmarks/run.py --out DIR NAME [ARGS...]        # and keep its JSON as DIR/NAME.json
    python benchmarks/run.py --nproc 4 multi_gpu/reshard --quick --backend gloo --device cpu
    python benchmarks/run.py NAME --help                     # the benchmark's own options

A benchmark's last stdout line is one JSON object (docs/measuring.md). run.py streams the
benchmark's output as it comes, then checks that line: a benchmark that fails (run.py
exits with its status) or whose last line is not one JSON object (exit 1) is an error
named on stderr; an unknown NAME exits 2. With --out,
DIR/NAME.json holds that object ('/' in NAME becomes '_') and DIR/NAME.run.json the run:
command, UTC start, seconds, exit status, commit, host and CPU count. Scripts under
multi_gpu/ marked torchrun run under `python -m torch.distributed.run --standalone` with
--nproc processes (one per GPU). The figures and where they were taken:
benchmarks/RESULTS.md. `nereus bench` runs through this file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass(frozen=True)
class Benchmark:
    """One runnable benchmark: `path` is relative to benchmarks/; `launch` is how it starts
    ("python", "torchrun": one process per GPU, "bash")."""

    name: str
    path: str
    machine: str
    what: str
    launch: str = "python"


def _mg(stem: str, machine: str, what: str, launch: str = "torchrun", suffix: str = ".py") -> Benchmark:
    return Benchmark(f"multi_gpu/{stem}", f"multi_gpu/{stem}{suffix}", machine, what, launch)


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("calibrate_cost", "calibrate_cost.py", "CPU (on measured data)",
              "the transition cost model fitted on measured warm transitions; refit predictions at 256 GPUs"),
    Benchmark("calibrate_layers", "calibrate_layers.py", "1 GPU",
              "latency table of llama-shaped layer stacks (forward, backward, decode) for the cost model"),
    Benchmark("checkpoint_stall", "checkpoint_stall.py", "CPU, 2 gloo processes",
              "what --save-every costs a training step; the bytes a --resume into another plan reads"),
    Benchmark("controller_compile_moves", "controller_compile_moves.py", "CPU",
              "compile time of the moves a controller estimates on a trace, pass by pass"),
    Benchmark("controller_fit_layers", "controller_fit_layers.py", "CPU",
              "held-out error of the per-layer latency fit on the measured H200 table"),
    Benchmark("controller_real_steps", "controller_real_steps.py", "CPU, 2 gloo processes (--backend nccl: 2 GPUs)",
              "the cost model's one-step-ahead predictions against `nereus train --controller` steps"),
    Benchmark("controller_search", "controller_search.py", "CPU",
              "plan-search time (70B GRPO on 1,024 GPUs) and controller overhead per step"),
    Benchmark("controller_share_floor", "controller_share_floor.py", "CPU",
              "the least transition share a plan sequence reaches, and what it costs in total time"),
    Benchmark("controller_simulate", "controller_simulate.py", "CPU",
              "fixed, greedy and Nereus policies against the DP oracle on the drift traces (--margin)"),
    Benchmark("coordination", "coordination.py", "CPU",
              "coordinated transitions under memory pressure against lockstep and one-at-a-time legs"),
    Benchmark("interop_reshard", "interop_reshard.py", "CPU, 4 gloo ranks (--cuda: GPUs)",
              "reshard_module against DCP and redistribute on FSDP2 / TP layouts of a transformers Llama"),
    Benchmark("lowering_cost", "lowering_cost.py", "CPU",
              "one rank's lowering of a transition phase by phase, and its replay tables"),
    Benchmark("pack_kernels", "pack_kernels.py", "1 GPU (--smoke: CPU)",
              "Triton pack/unpack against per-segment and batched torch copies and the copy ceiling"),
    Benchmark("part_check_cost", "part_check_cost.py", "CPU",
              "a rank's own checks of its part against the part's lowering and compile"),
    Benchmark("plan_scale", "plan_scale.py", "CPU",
              "compile time per pass at 32-1,024 GPUs; --rank-programs, --prove, --zero-compare"),
    Benchmark("reshard_vs_checkpoint", "reshard_vs_checkpoint.py", "CPU, 4 gloo ranks",
              "a transition against DCP save + load, DCP restart and gather-then-scatter"),
    Benchmark("sync_codecs", "sync_codecs.py", "1 GPU (--quick: CPU)",
              "delta and FP8 sync kernels against the copy ceiling; a 70B-shaped layer set's sync bytes"),
    Benchmark("sync_codecs_cpu", "sync_codecs_cpu.py", "CPU, 2 gloo processes",
              "delta and FP8 weight syncs in the bundled GRPO example: bytes, rollouts, rewards, logits"),
    Benchmark("transition_host_cost", "transition_host_cost.py", "CPU, 2 gloo ranks",
              "the host cost of a warm transition of many tiny pieces; control collectives per call"),
    Benchmark("verify_cli", "verify_cli.py", "CPU",
              "`nereusc verify` of a 157 MB whole program, this tree against another (--base)"),
    Benchmark("weight_sync", "weight_sync.py", "CPU, 4 gloo ranks",
              "the compiled weight sync against gather-then-slice and bucketed broadcast"),
    _mg("run_all", "2-8 GPUs (--cpu N: gloo)",
        "correctness, 8B reshard, weight sync, DTensor and a failure's end on every GPU, one budget",
        launch="bash", suffix=".sh"),
    _mg("rl_bf16", "2 GPUs (--cpu: gloo)", "bf16 PPO with two plan changes against its control run",
        launch="bash", suffix=".sh"),
    _mg("correctness", "2+ GPUs", "random transition chains, byte-exact after each; a fault rolled back"),
    _mg("reshard", "2+ GPUs", "8B actor + critic with Adam: GPU doubling, TP, PP against DCP, gather-scatter, bound"),
    _mg("weight_sync", "2+ GPUs", "8B actor training -> generation layout against gather-then-push and buckets"),
    _mg("dtensor_compare", "2+ GPUs", "TP <-> DP transitions beside DTensor redistribute on the same weights"),
    _mg("moe_reshard", "2+ GPUs", "Qwen3-30B-A3B expert-parallel <-> tensor/data-parallel changes"),
    _mg("offload_check", "2 GPUs", "transitions into and out of offload layouts against the PCIe bound"),
    _mg("variants", "2+ GPUs", "TP -> DP and weight-sync figures under executor variants, interleaved"),
    _mg("host_profile", "2 GPUs", "cProfile of rank 0 over warm TP <-> DP calls"),
    _mg("offload_paths", "1 GPU (--nproc 1)", "one rank's offloaded pieces across PCIe: in place against copying"),
    _mg("host_only", "1 GPU (--device cpu: CPU)", "one rank's host work of a TP <-> DP or MoE change with no peer",
        launch="python"),
    _mg("cold_phases", "1 GPU (CPU)", "host_only.py's first calls phase by phase (OUT.json -- HOST_ONLY_ARGS)",
        launch="python"),
    _mg("thread_steps", "1 GPU", "the lowering-ahead thread's steps for a MoE change, one by one", launch="python"),
    _mg("ahead_interference", "1 GPU", "what lowering ahead costs a training loop beside it", launch="python"),
    _mg("size_fit", "none (reads dtensor_compare JSON)", "fixed cost and bandwidth fitted over dtensor_compare sizes",
        launch="python"),
)

# Files of benchmarks/ that are no benchmark: this harness, modules the scripts import, and
# drivers that run other scripts (ab_trees.sh: two trees interleaved, results in a tarball).
HELPERS = ("run.py", "multi_gpu/mg_common.py", "multi_gpu/mg_baselines.py", "multi_gpu/mg_profile.py",
           "multi_gpu/summarize.py", "multi_gpu/ab_trees.sh")


class BenchmarkError(Exception):
    """A benchmark that failed (`status`: its exit status) or whose last stdout line is not
    one JSON object (`status` 1)."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


class UnknownBenchmark(LookupError):
    """A name that is no benchmark of the list."""


def find(name: str, benchmarks: Sequence[Benchmark] = BENCHMARKS) -> Benchmark:
    for bench in benchmarks:
        if bench.name == name:
            return bench
    raise UnknownBenchmark(f"no benchmark named {name!r}; choose one of: {', '.join(b.name for b in benchmarks)}")


def listing(benchmarks: Sequence[Benchmark] = BENCHMARKS) -> str:
    width = max(len(b.name) for b in benchmarks)
    machine = max(len(b.machine) for b in benchmarks)
    return "\n".join(f"{b.name:<{width}}  {b.machine:<{machine}}  {b.what}" for b in benchmarks)


def command(bench: Benchmark, args: Sequence[str], nproc: int) -> list[str]:
    script = os.path.join(HERE, bench.path)
    if bench.launch == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script,
                *args]
    if bench.launch == "bash":
        return ["bash", script, *args]
    return [sys.executable, script, *args]


def environment() -> dict:
    """This process's environment with the repository root first on PYTHONPATH (the
    scripts import nereus from the checkout they belong to)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))


def last_json(lines: Sequence[str]) -> dict:
    """The benchmark's result: its last non-empty stdout line, which must be one JSON object."""
    text = [line for line in lines if line.strip()]
    if not text:
        raise BenchmarkError("printed nothing on stdout (its last line must be one JSON object)")
    try:
        value = json.loads(text[-1])
    except ValueError:
        raise BenchmarkError(f"its last stdout line is not JSON: {text[-1].strip()[:200]!r}") from None
    if not isinstance(value, dict):
        raise BenchmarkError(f"its last stdout line is JSON but not one object: {text[-1].strip()[:200]!r}")
    return value


def _commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(bench: Benchmark, args: Sequence[str], out: Optional[str] = None, nproc: int = 2) -> dict:
    """Run `bench` with `args`, echoing its stdout; its result, also kept under `out`."""
    argv = command(bench, args, nproc)
    started, began = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
    lines = []
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=environment()) as child:
        for line in child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
    seconds = time.perf_counter() - began
    if child.returncode != 0:
        raise BenchmarkError(f"exited with status {child.returncode}", status=child.returncode)
    result = last_json(lines)
    if out:
        os.makedirs(out, exist_ok=True)
        stem = os.path.join(out, bench.name.replace("/", "_"))
        with open(stem + ".json", "w") as handle:
            handle.write(json.dumps(result) + "\n")
        meta = {"benchmark": bench.name, "command": argv, "started_utc": started.isoformat(timespec="seconds"),
                "seconds": round(seconds, 3), "exit_status": child.returncode, "commit": _commit(),
                "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
        with open(stem + ".run.json", "w") as handle:
            json.dump(meta, handle, indent=1)
            handle.write("\n")
    return result


def main(argv: Optional[Sequence[str]] = None, benchmarks: Sequence[Benchmark] = BENCHMARKS) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/run.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="list every benchmark: name, machine, what it measures")
    parser.add_argument("--out", metavar="DIR", help="keep the result as DIR/NAME.json, the run as DIR/NAME.run.json")
    parser.add_argument("--nproc", type=int, default=2, help="processes of a torchrun benchmark (default 2)")
    parser.add_argument("name", nargs="?", help="the benchmark (see --list)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark")
    options = parser.parse_args(argv)
    if options.list or not options.name:
        print(listing(benchmarks))
        return 0
    try:
        bench = find(options.name, benchmarks)
    except UnknownBenchmark as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in options.args):
        # the benchmark's own help: nothing to check or keep
        return subprocess.call(command(bench, options.args, options.nproc), env=environment())
    try:
        run(bench, options.args, options.out, options.nproc)
    except BenchmarkError as error:
        print(f"error: benchmark {bench.name}: {error}", file=sys.stderr)
        return error.status if error.status > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
