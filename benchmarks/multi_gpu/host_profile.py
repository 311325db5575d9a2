"""Where a warm transition's host time goes: cProfile of rank 0 over repeated TP <-> DP calls.

    torchrun --nproc-per-node 2 benchmarks/multi_gpu/host_profile.py                  # 2 H200s
    torchrun --nproc-per-node 2 benchmarks/multi_gpu/host_profile.py --backend gloo --device cpu

The tensors are those of dtensor_compare.py (`--layers` Llama-3.1-8B-shaped layers of bf16
generation weights, TP n <-> DP n); on CPU the tiny shapes, so the data path is negligible
and what is left is the per-piece and per-collective host work that every size pays.
First `--repeats` warm TP -> DP / DP -> TP pairs run plain, then as many with rank 0 under
cProfile, which writes the `--top` functions by cumulative and by own time, and the
callees of the call and of the executor, to `--out` (default stdout). Logged per pass and
case: the median call (slowest rank) and rank 0's medians of where its call was: first
op posted (local work: before the agreement), last op posted (posted_done), device time
of the rounds (CUDA events, first post to last work), ready (device synchronized) and
returned. Also the latency of one control collective. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys

from dtensor_compare import TAG, module_source, weight_specs
from mg_common import SHAPES, Env, add_common_args, build_local, machine


def control_latency(env: Env, gather: bool = False, repeats: int = 200) -> float:
    """Median seconds of one small collective on the gloo group the runtime's control
    protocol uses (what each agreement costs, ranks already in step)."""
    import time

    import torch
    import torch.distributed as dist

    flag = torch.zeros(1, dtype=torch.int64)
    rows = [torch.empty_like(flag) for _ in range(env.world)]
    times = []
    env.barrier()
    for _ in range(repeats):
        t0 = time.perf_counter()
        if gather:
            dist.all_gather(rows, flag, group=env.ctrl)
        else:
            dist.all_reduce(flag, group=env.ctrl)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


SPLITS = ("median_s", "local_s", "posted_at_s", "posted_done_s", "device_s", "ready_s", "wall_s")


def timed_pairs(env: Env, rt, repeats: int, profiler=None) -> dict:
    """{case: [(seconds of the slowest rank, then this rank's splits of SPLITS[1:])]}
    over `repeats` TP -> DP -> TP pairs; `profiler` (rank 0) records the calls."""
    out: dict = {"tp-dp": [], "dp-tp": []}
    for _ in range(repeats):
        for case, target in (("tp-dp", "DP"), ("dp-tp", "TP")):
            env.barrier()
            if profiler is not None and env.rank == 0:
                profiler.enable()
            report, seconds = env.timed(lambda: rt.transition(target))
            if profiler is not None and env.rank == 0:
                profiler.disable()
            first = report.rounds[0] if report.rounds else {}
            last = report.rounds[-1] if report.rounds else {"posted_at_s": 0.0, "exchange_s": 0.0}
            posted_done = last["posted_at_s"] + last["exchange_s"]
            device = sum(r["device_s"] or 0.0 for r in report.rounds)
            out[case].append((seconds, first.get("local_s", 0.0), first.get("posted_at_s", 0.0), posted_done,
                              device, report.seconds, report.wall_s))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20, help="profiled TP -> DP -> TP pairs")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", default=None, help="write the profile text here (rank 0)")
    args = parser.parse_args(argv)
    env = Env(args)

    import nereus.ir as ir
    from nereus.backends.json_program import plan_units_json
    from nereus.runtime import Runtime

    shape = SHAPES["8b"] if env.cuda else SHAPES["tiny"]
    module = ir.parse_source(module_source(env.world, env.gpu_mem_bytes(), shape, args.layers), "host.nir")
    plain = {n: (s, d) for n, (s, d, _) in weight_specs(module).items()}
    rt = Runtime(module, "TP", device=env.device, timeout_s=args.timeout_s)
    rt.register(TAG, build_local(plan_units_json(module, "TP", TAG), env.rank, plain, args.seed, TAG, env.device))
    for _ in range(2):  # compile, lower, first-call allocations
        rt.transition("DP")
        rt.transition("TP")
    profiler = cProfile.Profile()
    summary = {"control_all_reduce_s": control_latency(env), "control_all_gather_s": control_latency(env, True)}
    env.log(f"one control collective (gloo, 1 int64): all_reduce {summary['control_all_reduce_s'] * 1e6:.0f} us, "
            f"all_gather {summary['control_all_gather_s'] * 1e6:.0f} us")
    # first without the profiler (the figures a user gets), then under it (where the time goes)
    for label, prof in (("plain", None), ("profiled", profiler)):
        summary[label] = {}
        for case, rows in timed_pairs(env, rt, args.repeats, prof).items():
            cols = list(zip(*rows))
            summary[label][case] = dict(zip(SPLITS, (statistics.median(c) for c in cols)))
            f = summary[label][case]
            env.log(f"{label} {case}: median {f['median_s'] * 1e3:.2f} ms; this rank: first op posted at "
                    f"{f['posted_at_s'] * 1e3:.2f} ms (local work {f['local_s'] * 1e3:.2f}), posting done "
                    f"{f['posted_done_s'] * 1e3:.2f}, device work {f['device_s'] * 1e3:.2f}, ready "
                    f"{f['ready_s'] * 1e3:.2f}, returned {f['wall_s'] * 1e3:.2f} ms")
    if env.rank == 0:
        text = io.StringIO()
        for key in ("cumulative", "tottime"):
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats(key).print_stats(args.top)
        # what the call's own steps cost: the direct callees of the API call and of the executor
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_callees(r"runtime\.py:\d+\(transition\)|executor\.py:\d+\((_?execute|_round)\)")
        if args.out:
            with open(args.out, "w") as f:
                f.write(text.getvalue())
        else:
            print(text.getvalue())
    env.finish({"name": "multi_gpu_host_profile", "gpus": env.world, "backend": env.backend,
                "device": env.device.type, "layers": args.layers, "repeats": args.repeats, **summary,
                "machine": machine()}, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
