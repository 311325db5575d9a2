"""One rank's host work in a TP <-> DP transition, with no peer: a single process, no data moved.

    python3 benchmarks/multi_gpu/host_only.py --layers 8            # 1 GPU: rank 0 of a 2-GPU job
    python3 benchmarks/multi_gpu/host_only.py --device cpu --layers 8 --shape tiny
    python3 benchmarks/multi_gpu/host_only.py --moe gen-ep2-tp2 --layers 6     # Qwen3-30B-A3B, EP -> TP

Why: the 2-GPU TP -> DP figures sit at 1.45-1.60x of the link bound, and part of the gap is
host work around the transfers (benchmarks/RESULTS.md). That work (the plan's views, the
allocations, the pack and copy launches, the agreements, the commit) can be measured on
one GPU: this process joins torch's "fake" process group as rank `--rank` of `--world`,
whose collectives and point-to-point ops return at once and move nothing, and runs that
rank's program of the transitions of dtensor_compare.py on real tensors of the real
shapes. The same-GPU copies and the pack/unpack kernels run; the peers' bytes never
arrive (the received pieces keep whatever the allocator gave), so nothing is checked.

Per call (synchronize before, synchronize after, as the 2-GPU benchmarks time it): wall
time, and where rank 0's call was: first op posted (`posted_at_s`; `local_s` of it is the
work before the agreement), last op posted, device time of the rounds (CUDA events),
ready (device synchronized) and returned (`wall_s`). Every kernel variant is compiled
before the timing (`prepare` of both targets). `--ab-replay` times the calls with the
replayed launches of runtime/replay.py off and on, alternating in the one process (the
host's speed varies between processes by as much as the effect). `--profile FILE` runs as many more
calls under cProfile and writes the top functions. These are host figures: NCCL's own
host cost per posted batch (about 0.1-0.2 ms on the H200 host) is not in them. Last
stdout line: one JSON object; its `cold_details` has, per first and second call of each
direction: whether the lowering-ahead thread lowered it, torch-path fallbacks, the waits
for the thread, compile, seconds and wall, each round's host/device split and the block
reserved ahead of its allocations (`reserved_bytes`), and the replays
in the call's execution plan and those it ran (`replays_in_plan`, `replays_used`), for
each torch-path fallback the kernel variants not compiled yet and who asked (`missing`),
whether the lowering-ahead thread still had work when the call began (`ahead_busy`), and
the caching allocator's reserved and allocated bytes after the call, and how long each
kernel variant compile during it took (`compiles_s`); the summary's `compile_log` has
every compile of the run, its `profiled` the direction `--profile-cold` profiled
(`--profile-case`), its `setup` the seconds of the Runtime's construction and of
building and registering the state (device synchronized) after it, and its
`ahead_steps` the lowering-ahead thread's steps (Ahead.step_log: pair, who ran it, what
it was, start and seconds; times from the start of the Runtime's construction, as each
first call's `called_at_s`). Each call's `cpu_s` is this process's CPU time in it
(time.process_time, every thread's: on a shared CPU box the wall time also holds other
processes' turns).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist

from dtensor_compare import TAG, module_source, weight_specs
from mg_common import SHAPES, build_local, machine

# (label, target) of the timed change and of the way back; --moe: plans A and B
DIRECTIONS = (("tp-dp", "DP"), ("dp-tp", "TP"))
ROUND_SPLITS = ("seconds", "local_s", "exchange_s", "unpack_s", "posted_at_s", "device_s", "reserved_bytes")
# cpu_s: the process's CPU time in the call (time.process_time): on a shared CPU box the
# wall time also holds other processes' turns
SPLITS = ("call_s", "local_s", "posted_at_s", "posted_done_s", "device_s", "ready_s", "wall_s", "cpu_s")


def join_fake(rank: int, world: int) -> None:
    """Join a fake process group; every group created later is fake too (a gloo group
    would wait for peers that do not exist)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    real_new_group = dist.new_group

    def fake_group(*args, **kwargs):
        kwargs["backend"] = "fake"
        return real_new_group(*args, **kwargs)

    dist.new_group = fake_group

    # the fake group moves no bytes; object collectives on CUDA would unpickle empty
    # buffers, so every rank "receives" what this one holds, as the CPU fake group does
    def all_gather_object(out, obj, group=None):
        out[:] = [obj] * len(out)

    def scatter_object_list(out, inputs, src=0, group=None):
        out[0] = inputs[dist.get_rank()] if inputs is not None else None

    def broadcast_object_list(objects, src=0, group=None, device=None):
        return None

    dist.all_gather_object, dist.scatter_object_list = all_gather_object, scatter_object_list
    dist.broadcast_object_list = broadcast_object_list

    # the agreement sums every rank's sends minus receives to 0; one rank alone holds only
    # its own term, so its balance is computed (its cost stays timed) and reported as 0
    from nereus.runtime import part_check

    real_balance = part_check.balance

    def balance(pair_digests, rank):
        real_balance(pair_digests, rank)
        return 0

    part_check.balance = balance


def replays_used(rt, report) -> dict:
    """Of the call's program: its replays (a round's copies, a stream's chunks) in the
    execution plan, and those this call ran (marked with its execution's number). A first
    execution builds none, so what it ran the lowering-ahead thread had built."""
    from nereus.runtime import streams
    from nereus.runtime.execution_plan import plan_for

    progs = [p for key, p in rt._lowered.items() if key[:2] == (report.source, report.target)]
    if not progs:
        return {"replays_in_plan": None, "replays_used": None}
    plan = plan_for(progs[-1], streams.CHUNK_BYTES)
    kept = [k for k in plan.launches if k[0] in ("copy", "send", "recv")]
    used = [k for k in kept if plan.launches_used.get(k) == plan.executions[0]]
    return {"replays_in_plan": len(kept), "replays_used": len(used)}


def watch_missing() -> list:
    """A list that receives, for each `ready` call of the packer that finds kernel
    variants not compiled (the call then takes the torch path), [the missing variants,
    the calling function, start]; empty off Triton."""
    out: list = []
    packer = packer_or_none()
    if packer is None:
        return out
    ready = packer.ready

    def watched(classes, device, start=True):
        missing = sorted(set(classes) - packer.compiled)
        ok = ready(classes, device, start)
        if not ok:
            caller = sys._getframe(1).f_code
            out.append([[list(m) for m in missing], f"{caller.co_name}@{os.path.basename(caller.co_filename)}", start])
        return ok

    packer.ready = watched
    return out


def packer_or_none():
    from nereus.runtime import packing as runtime_packing

    kernels = runtime_packing.kernels()
    return kernels.default_packer() if kernels is not None else None


def compile_log() -> list:
    """The default packer's ((variant), seconds) per kernel variant compile so far."""
    packer = packer_or_none()
    return list(packer.compile_log) if packer is not None else []


def footprint(device) -> dict:
    """The caching allocator's reserved and allocated bytes now (CUDA)."""
    if device.type != "cuda":
        return {}
    return {"reserved_bytes": torch.cuda.memory_reserved(device), "allocated_bytes": torch.cuda.memory_allocated(device)}


def write_profile(profiler, path: str, top: int) -> None:
    """cProfile's top functions by cumulative and by own time, to `path`."""
    text = io.StringIO()
    for key in ("cumulative", "tottime"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(top)
    with open(path, "w") as f:
        f.write(text.getvalue())


def timed_calls(rt, device, repeats: int, profiler=None) -> dict:
    out: dict = {case: [] for case, _ in DIRECTIONS}
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(repeats):
        for case, target in DIRECTIONS:
            sync()
            if profiler is not None:
                profiler.enable()
            t0, c0 = time.perf_counter(), time.process_time()
            report = rt.transition(target)
            sync()
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            if profiler is not None:
                profiler.disable()
            first = report.rounds[0] if report.rounds else {}
            last = report.rounds[-1] if report.rounds else {"posted_at_s": 0.0, "exchange_s": 0.0}
            device_s = sum(r["device_s"] or 0.0 for r in report.rounds)
            out[case].append((seconds, first.get("local_s", 0.0), first.get("posted_at_s", 0.0),
                              last["posted_at_s"] + last["exchange_s"], device_s, report.seconds, report.wall_s, cpu))
    return out


def gpu_busy(rt, device, repeats: int, path: str) -> dict:
    """Medians over `repeats` TP -> DP calls (each followed by an untraced DP -> TP) of the
    call's wall time and of the GPU's busy time inside it (the union of every kernel and
    copy interval on any stream), from the PyTorch profiler's CUDA activity. Each call is
    wrapped, with the synchronize after it, in a `record_function` range: the trace's
    clock is shared by host ranges and GPU events, and no GPU work of a call can run
    outside its range (synchronized at both ends)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            torch.cuda.synchronize(device)
            with record_function("nereus-forward"):
                rt.transition(DIRECTIONS[0][1])
                torch.cuda.synchronize(device)
            rt.transition(DIRECTIONS[1][1])
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ranges = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "nereus-forward"
                    and e.get("cat") == "user_annotation")
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    rows = []
    for t0, t1 in ranges:
        call = [e for e in gpu if t0 <= e["ts"] <= t1]
        busy, end = 0.0, None
        for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in call):
            if end is None or a > end:
                busy, end = busy + b - a, b
            elif b > end:
                busy, end = busy + b - end, b
        rows.append(((t1 - t0) / 1e6, busy / 1e6, sum(e["dur"] for e in call if e["cat"] == "kernel") / 1e6,
                     sum(e["dur"] for e in call if e["cat"] != "kernel") / 1e6, len(call)))
    if not rows:
        return {"error": "no traced call found"}
    cols = [statistics.median(c) for c in zip(*rows)]
    return dict(zip(("call_s", "busy_s", "kernel_s", "memcpy_s", "launches"), cols))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shape", choices=sorted(set(SHAPES) | {"host"}), default="8b",
                        help="with --moe: 8b = Qwen3-30B-A3B's shapes, tiny, or host (its piece counts on tiny "
                             "dimensions)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--profile", default=None, help="also run --repeats calls under cProfile; write here")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--trace", default=None,
                        help="CUDA: also run --repeats TP -> DP calls under the PyTorch profiler; write "
                             "the Chrome trace here and report how much of each call the GPU was busy")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile-cold", default=None,
                        help="run the first TP -> DP call under cProfile and write it here; the second to "
                             "PATH.second")
    parser.add_argument("--profile-case", default=None, metavar="DIRECTION",
                        help="with --profile-cold: the direction whose two first calls are profiled "
                             "(tp-dp, dp-tp; with --moe a-b, b-a); default: the first")
    parser.add_argument("--moe", default=None, metavar="CASE",
                        help="a case of moe_reshard.py instead (gen-ep2-tp2, train-ep2-tp2, train-ep2-dp2; "
                             "Qwen3-30B-A3B shapes, --layers of its 48): plans A -> B and back")
    parser.add_argument("--wait-ahead", action="store_true",
                        help="before each first call, wait until the lowering-ahead thread (on by default on "
                             "CUDA, NEREUS_LOWER_AHEAD) has done its work, as in a job that trains a while "
                             "between switches; default: call right after registering the state, and each "
                             "first call right after the one before")
    parser.add_argument("--ab-replay", action="store_true",
                        help="time calls with replayed launches off and on (NEREUS_REPLAY), alternating call by "
                             "call in this one process; reported as replay-off and replay-on")
    args = parser.parse_args(argv)
    if args.shape == "host" and not args.moe:
        parser.error("--shape host is a MoE shape: give --moe CASE too")
    kind = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    join_fake(args.rank, args.world)

    import nereus.ir as ir
    from nereus.backends.json_program import plan_units_json
    from nereus.runtime import Runtime

    global DIRECTIONS
    mem = torch.cuda.get_device_properties(device).total_memory if kind == "cuda" else 141 * 10**9
    setup: dict = {}  # seconds: the Runtime's construction, building and registering the state
    if args.moe:
        import moe_reshard as mr

        shape = mr.SHAPES[{"8b": "30b-a3b"}.get(args.shape, args.shape)]
        module = ir.parse_source(mr.module_source(args.moe, args.world, mem, shape, args.layers), "host_only.nir")
        ms = str(next(iter(module.workload.model_stages())))
        DIRECTIONS = (("a-b", "B"), ("b-a", "A"))
        first_plan, tag = "A", ms

        def local() -> dict:
            return build_local(plan_units_json(module, "A", ms), args.rank, mr.stage_specs(module, ms), args.seed,
                               ms, device, step=mr.STEP if ms.endswith(".training") else None)
    else:
        module = ir.parse_source(module_source(args.world, mem, SHAPES[args.shape], args.layers), "host_only.nir")
        plain = {n: (s, d) for n, (s, d, _) in weight_specs(module).items()}
        first_plan, tag = "TP", TAG

        def local() -> dict:
            return build_local(plan_units_json(module, "TP", TAG), args.rank, plain, args.seed, TAG, device)
    # the construction's start: the lowering-ahead thread's steps and the first calls are timed from it
    origin, started = time.monotonic(), time.perf_counter()
    rt = Runtime(module, first_plan, device=device)
    setup["construct_s"] = time.perf_counter() - started
    rt.register(tag, local())
    if kind == "cuda":
        torch.cuda.synchronize(device)
    setup["register_s"] = time.perf_counter() - started - setup["construct_s"]
    if args.profile_case is not None and args.profile_case not in dict(DIRECTIONS):
        raise SystemExit(f"host_only.py: --profile-case {args.profile_case}: the directions here are "
                         f"{', '.join(case for case, _ in DIRECTIONS)}")
    sync = (lambda: torch.cuda.synchronize(device)) if kind == "cuda" else (lambda: None)
    cold: dict = {}
    profiled = None
    details: dict = {}  # per first call: its part lowered ahead, torch-path fallbacks of the packer
    def fallbacks() -> int:
        packer = packer_or_none()
        return packer.fallback_calls if packer is not None else 0

    missed_log = watch_missing()

    def compiles() -> int:  # kernel variant compiles so far (the thread's, the background's, a call's own)
        return len(compile_log())

    for call in ("cold", "second"):  # each direction's first call (compile, lower, the execution
        for case, target in DIRECTIONS:  # plan and its replays built, first
            sync()  # allocations and kernels), then its second (kernel variants compiling aside)
            waited = time.perf_counter()
            if args.wait_ahead and call == "cold":
                rt.wait_ahead()
            waited = time.perf_counter() - waited
            first = cProfile.Profile() if args.profile_cold and case == (args.profile_case or DIRECTIONS[0][0]) else None
            if first is not None:
                profiled = case
                first.enable()
            busy = rt._ahead is not None and not rt._ahead.idle(0)
            missed_log.clear()
            called_at = time.monotonic() - origin
            t0, c0, missed, compiled = time.perf_counter(), time.process_time(), fallbacks(), compiles()
            report = rt.transition(target)
            sync()
            cold[f"{call} {case}"] = time.perf_counter() - t0
            cpu = time.process_time() - c0  # this process's, all threads (the lowering-ahead thread's too)
            details[f"{call} {case}"] = {"called_at_s": called_at,
                                         "lowered_ahead": report.lowered_ahead, "fallbacks": fallbacks() - missed,
                                         "waited_s": waited, "ahead_wait_s": report.ahead_wait_s,
                                         # where the call's time went: compile, the rounds'
                                         # host and device parts, the rest (commit, registry)
                                         "seconds": report.seconds, "wall_s": report.wall_s, "cpu_s": cpu,
                                         "compile_s": report.compile_s,
                                         "rounds": [{k: r.get(k) for k in ROUND_SPLITS} for r in report.rounds],
                                         **replays_used(rt, report),
                                         # why each fallback: the variants not compiled, the caller
                                         "missing": list(missed_log), "ahead_busy": busy,
                                         # variants compiled during the call (beside it), seconds each
                                         "compiles_s": [t for _, t in compile_log()[compiled:]],
                                         **footprint(device)}
            if first is not None:
                first.disable()
                write_profile(first, args.profile_cold + ("" if call == "cold" else ".second"), args.top)
    print("first calls: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in cold.items()), flush=True)
    print(f"first calls' details: {details}", flush=True)
    for _ in range(2):  # more warm-up
        for _, target in DIRECTIONS:
            rt.transition(target)
    # every kernel variant compiled before anything is timed: prepare() compiles those of
    # the stream chunks and replays (runtime/replay.py), and the background compiles the
    # warm-up calls started are waited for (a call that met an uncompiled variant took the
    # per-piece path)
    for _, target in DIRECTIONS:
        rt.prepare(target)
        rt.transition(target)
    from nereus.runtime import replay

    packer = packer_or_none()
    if packer is not None:
        packer.wait_compiled()
    summary: dict = {"cold": cold, "cold_details": details, "setup": setup,
                     # the lowering-ahead thread's steps (and those a call ran): [source,
                     # target, who, what, start (s from the construction's start), seconds]
                     "ahead_steps": [[a, b, who, what, at - origin, sec] for a, b, who, what, at, sec in
                                     (list(rt._ahead.step_log) if rt._ahead is not None else [])],
                     # the direction whose first calls --profile-cold profiled (None: none)
                     "profiled": profiled,
                     # every kernel variant compile of the run and how long it took (Triton's
                     # disk cache warm or not)
                     "compile_log": [[list(v), t] for v, t in compile_log()]}
    passes = [("plain", None)]
    if args.ab_replay:  # the same calls with replays off and on, alternating in this process
        passes = [("replay-off", None), ("replay-on", None)]
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        passes.append(("profiled", profiler))
    timed: dict = {}
    default = replay.ENABLED
    for _ in range(args.repeats if args.ab_replay else 1):
        for label, prof in passes:
            replay.ENABLED = {"replay-off": False, "replay-on": True}.get(label, default)
            for case, rows in timed_calls(rt, device, 1 if args.ab_replay else args.repeats, prof).items():
                timed.setdefault(label, {}).setdefault(case, []).extend(rows)
    replay.ENABLED = default
    for label, prof in passes:
        summary[label] = {}
        for case, rows in timed[label].items():
            f = dict(zip(SPLITS, (statistics.median(c) for c in zip(*rows))))
            summary[label][case] = f
            print(f"{label} {case}: call {f['call_s'] * 1e3:.2f} ms; first op posted at "
                  f"{f['posted_at_s'] * 1e3:.2f} ms (local work {f['local_s'] * 1e3:.2f}), posting done "
                  f"{f['posted_done_s'] * 1e3:.2f}, device work {f['device_s'] * 1e3:.2f}, ready "
                  f"{f['ready_s'] * 1e3:.2f}, returned {f['wall_s'] * 1e3:.2f} ms", flush=True)
    if args.trace and kind == "cuda":
        summary["trace"] = gpu_busy(rt, device, args.repeats, args.trace)
        t = summary["trace"]
        print(t) if "error" in t else print(f"trace {DIRECTIONS[0][0]}: call {t['call_s'] * 1e3:.2f} ms, GPU busy {t['busy_s'] * 1e3:.2f} ms "
              f"(kernels {t['kernel_s'] * 1e3:.2f}, copies {t['memcpy_s'] * 1e3:.2f}; summed over streams), "
              f"{t['launches']:.0f} launches per call", flush=True)
    if profiler is not None:
        write_profile(profiler, args.profile, args.top)
    result = {"name": "multi_gpu_host_only", "device": kind, "world": args.world, "rank": args.rank,
              "shape": args.shape, "moe": args.moe, "layers": args.layers, "repeats": args.repeats, **summary,
              "env": {k: v for k, v in os.environ.items() if k.startswith("NEREUS_")}, "machine": machine()}
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(json.dumps(result) + "\n")
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
