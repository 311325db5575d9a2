"""The lowering-ahead thread's work for a MoE change, step by step, on one GPU: each step's
wall and CPU seconds (time.thread_time of the thread that ran it), and inside each replay
step the host time of its parts (the launch tables' build, pinning, the copy's call, the
wait for the upload). Why: in host_only.py's step log (session 20, one H200) a replay step
took 0.08-1.3 s on the GPU host, against 0.07-0.15 s for the same build on a CPU box; this
says where the difference goes.

    cd benchmarks/multi_gpu
    python3 thread_steps.py --moe train-ep2-tp2 --layers 6                  # alone
    python3 thread_steps.py --moe train-ep2-tp2 --layers 6 --beside build   # beside building the state
    python3 thread_steps.py --moe train-ep2-tp2 --layers 6 --beside alloc   # beside allocating it only

It runs nereus.runtime.ahead_steps.steps (the thread's own generator, lowering in the
thread: no lowering process) for A -> B and then B -> A, rank 0 of 2 on a fake process
group, in a thread of its own. `--beside build` builds and registers rank 0's state of
plan A in the main thread meanwhile, as host_only.py does right after the construction;
`--beside alloc` only allocates its shards (torch.empty: the caching allocator's cudaMalloc).
Each step also reports the thread's getrusage (user and kernel CPU, page faults, context
switches).
Without CUDA only the lowering step runs (replays are built on CUDA only). Last stdout
line: one JSON object."""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import resource
import statistics
import sys
import threading
import time

import torch

import moe_reshard as mr
from host_only import join_fake
from mg_common import build_local, machine, my_shards

PARTS = ("build", "pin", "copy", "wait")  # the parts of a replay step timed apart
COUNTED = PARTS + ("bytes",)  # what instrument() adds up per thread
# the thread's own resource use per step (getrusage(RUSAGE_THREAD)): CPU in user and kernel
# mode, minor page faults, voluntary and involuntary context switches
RUSAGE = (("user_s", "ru_utime"), ("sys_s", "ru_stime"), ("faults", "ru_minflt"), ("switches", "ru_nvcsw"),
          ("preempted", "ru_nivcsw"))


def instrument(totals: collections.Counter) -> None:
    """Add each replay part's host seconds (and the uploaded bytes) to `totals`, keyed by
    the thread that spent them; patches the functions the replay build calls."""
    from nereus.backends.triton import replay as triton_replay

    build_launches, stream_sync = triton_replay.build_launches, torch.cuda.Stream.synchronize

    def add(part: str, seconds: float) -> None:
        totals[(threading.get_ident(), part)] += seconds

    def timed_build(*args, **kwargs):
        started = time.perf_counter()
        try:
            return build_launches(*args, **kwargs)
        finally:
            add("build", time.perf_counter() - started)

    def timed_upload(table, device):  # tables.upload's two steps, each timed (keep them alike)
        device = torch.device(device)
        if device.type != "cuda" or table.device.type != "cpu":
            return table.to(device)
        started = time.perf_counter()
        pinned = table.pin_memory()
        add("pin", time.perf_counter() - started)
        started = time.perf_counter()
        out = pinned.to(device, non_blocking=True)
        add("copy", time.perf_counter() - started)
        totals[(threading.get_ident(), "bytes")] += table.numel() * table.element_size()
        return out

    def timed_sync(self):
        started = time.perf_counter()
        try:
            return stream_sync(self)
        finally:
            add("wait", time.perf_counter() - started)

    triton_replay.build_launches, triton_replay.upload = timed_build, timed_upload
    torch.cuda.Stream.synchronize = timed_sync


def run_pairs(module, device, pairs, totals: collections.Counter, out: list) -> None:
    """Each pair's steps, one after another, each step timed (appended to `out`)."""
    from nereus.runtime import ahead_steps

    me = threading.get_ident()
    for source, target in pairs:
        generator = ahead_steps.steps(module, 0, device, 1 << 20, False, None, source, target)
        while True:
            before = {p: totals[(me, p)] for p in COUNTED}
            usage = resource.getrusage(resource.RUSAGE_THREAD)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                value = next(generator)
            except StopIteration:
                break
            step = {"pair": f"{source}->{target}", "what": "lowered" if isinstance(value, ahead_steps.Lowered)
                    else ahead_steps.step_name(value), "wall_s": time.perf_counter() - wall, "cpu_s": time.thread_time() - cpu}
            now = resource.getrusage(resource.RUSAGE_THREAD)
            step.update({name: getattr(now, field) - getattr(usage, field) for name, field in RUSAGE})
            step.update({p: totals[(me, p)] - before[p] for p in COUNTED if totals[(me, p)] > before[p]})
            out.append(step)


def build_beside(args, module, ms: str, device, cuda: bool) -> dict:
    """What the main thread does while the steps run (`--beside`), timed from the
    Runtime's construction: build and register plan A's state, or only allocate it."""
    if args.beside == "none":
        return {}
    from nereus.backends.json_program import plan_units_json
    from nereus.runtime import Runtime

    at = time.perf_counter()
    rt = Runtime(module, "A", device=device, ahead="off")
    units, specs = plan_units_json(module, "A", ms), mr.stage_specs(module, ms)
    step = mr.STEP if ms.endswith(".training") else None
    if args.beside == "build":
        local = build_local(units, 0, specs, args.seed, ms, device, step=step)
        rt.register(ms, local)
    else:  # (shards of several boxes left out: not a whole state, so not registered)
        local = {name: torch.empty([hi - lo for lo, hi in boxes[0]], dtype=specs[name][1], device=device)
                 for name, boxes in my_shards(units, 0).items() if len(boxes) == 1}
    if cuda:
        torch.cuda.synchronize(device)
    return {"tensors": len(local), "seconds": time.perf_counter() - at}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--moe", default="train-ep2-tp2", choices=mr.case_names(2))
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--beside", choices=("none", "build", "alloc"), default="none",
                        help="what the main thread does meanwhile: nothing (default: it waits), build and register "
                             "the state (its values computed on the device), or only allocate it (torch.empty)")
    parser.add_argument("--intraop", choices=("one", "inherit"), default="one",
                        help="the thread's torch intra-op threads: one, as the runtime's lowering-ahead thread sets "
                             "(nereus.runtime.intraop; default), or the process's team, as before session 20")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="write the thread's cProfile statistics (pstats) here, and print its top 25 by own time")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    join_fake(0, 2)

    import nereus.ir as ir
    from nereus.runtime import packing

    mem = torch.cuda.get_device_properties(device).total_memory if cuda else 141 * 10**9
    module = ir.parse_source(mr.module_source(args.moe, 2, mem, mr.SHAPES["30b-a3b"], args.layers), "thread_steps.nir")
    ms = str(next(iter(module.workload.model_stages())))
    kernels = packing.kernels()
    if cuda and kernels is not None:  # Triton's start, not in the first step (the constructor starts it too)
        kernels.default_packer().compile({("pack", 8, 2, 2, 2048)}, device)
    totals: collections.Counter = collections.Counter()
    instrument(totals)
    steps: list = []
    errors: list = []
    team: list = []  # the thread's intra-op threads

    def thread() -> None:
        if args.intraop == "one":
            from nereus.runtime import intraop

            intraop.one_intraop_thread()
        team.append(torch.get_num_threads())
        profiler = cProfile.Profile() if args.profile else None
        if profiler is not None:
            profiler.enable()
        try:
            run_pairs(module, device, (("A", "B"), ("B", "A")), totals, steps)
        except BaseException as error:  # noqa: BLE001 - reported in the JSON, the run fails
            errors.append(repr(error))
        finally:
            team.append(torch.get_num_threads())  # still one after the steps?
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(args.profile)

    started = time.perf_counter()
    worker = threading.Thread(target=thread, name="thread-steps")
    worker.start()
    try:
        beside = build_beside(args, module, ms, device, cuda)
    finally:  # (a failure here is raised once the thread is done)
        worker.join()
    total_s = time.perf_counter() - started
    replays = [s for s in steps if s["what"] == "replay"]
    result = {"name": "thread_steps", "moe": args.moe, "layers": args.layers, "beside": args.beside,
              "intraop": args.intraop, "intraop_threads": team, "main_intraop_threads": torch.get_num_threads(),
              "device": str(device), "total_s": total_s, "beside_s": beside, "errors": errors, "steps": steps,
              "replay_wall_s": sorted(s["wall_s"] for s in replays),
              "replay_cpu_s": sorted(s["cpu_s"] for s in replays),
              "replay_parts_s": {p: sum(s.get(p, 0.0) for s in replays) for p in COUNTED},
              "machine": machine()}
    for s in steps:
        parts = " ".join(f"{p} {s[p] * 1e3:.0f}" for p in PARTS if p in s)
        print(f"{s['pair']:5} {s['what']:8} wall {s['wall_s'] * 1e3:7.1f} ms  cpu {s['cpu_s'] * 1e3:7.1f} ms "
              f"(sys {s['sys_s'] * 1e3:.0f}, faults {s['faults']}, switches {s['switches']}+{s['preempted']})  {parts}"
              + (f"  {s['bytes'] / 2**20:.1f} MiB" if "bytes" in s else ""))
    if replays:
        print(f"replays: {len(replays)}, wall median {statistics.median(result['replay_wall_s']) * 1e3:.0f} ms, "
              f"cpu median {statistics.median(result['replay_cpu_s']) * 1e3:.0f} ms")
    if args.profile:
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
