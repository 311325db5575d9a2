"""One rank's lowering of a transition, phase by phase, in CPU seconds: what the runtime
does with a transition before it moves a byte (on CUDA the lowering-ahead thread and the
lowering process do it ahead, else the first call does), on the CPU, no device.

    python benchmarks/lowering_cost.py --moe gen-ep2-tp2 --layers 48     # Qwen3-30B-A3B, EP 2 -> TP 2
    python benchmarks/lowering_cost.py --moe train-ep2-tp2 --layers 6
    python benchmarks/lowering_cost.py --layers 32                       # dense 8B-shaped TP 2 <-> DP 2

The cases are benchmarks/multi_gpu/host_only.py's (`--moe CASE`: moe_reshard.py's plans A
and B, else dtensor_compare.py's TP and DP), both directions, for rank `--rank` of
`--world`. Phases, each timed with time.process_time (the machine may be shared; the CPU
time of this process is what the lowering costs):

- compile: `compile_transition` (the passes keep caches: the first repetition is the cold one);
- part: this rank's part (`proof.rank_part`) and its canonical JSON text;
- lower: the text parsed and lowered into the work list (`program.lower_text`:
  json.loads, part_facts, rank_program);
- plan: the execution plan (`execution_plan.build_plan`);
- replays: the replays' tables of every round's copies and streams (`replay.warm`), with
  the Triton kernels forced under the interpreter (NEREUS_PACK_BACKEND=triton,
  TRITON_INTERPRET=1, set here): their tables are built on the host as on a GPU, and
  nothing is launched. `--no-replays` leaves them out.

It also counts the work list's pieces and the tensors they move (a piece of a v2 range
moves one slice of each of its tensors). Per direction: the first repetition and the
median of `--repeats`. `--profile FILE` writes cProfile's top functions of one more
lowering (lower, plan, replays) of the first direction. Runs on any checkout of Nereus
(put it first on PYTHONPATH): it uses only the functions named above. Last stdout line:
one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ("compile_s", "part_s", "lower_s", "plan_s", "replays_s")


def _module(args):
    sys.path.insert(0, os.path.join(HERE, "multi_gpu"))
    import nereus.ir as ir

    mem = 141 * 10**9
    if args.moe:
        import moe_reshard as mr

        source = mr.module_source(args.moe, args.world, mem, mr.SHAPES[args.shape], args.layers)
        return ir.parse_source(source, "lowering.nir"), (("a-b", "A", "B"), ("b-a", "B", "A"))
    from dtensor_compare import module_source
    from mg_common import SHAPES

    source = module_source(args.world, mem, SHAPES[{"30b-a3b": "8b"}.get(args.shape, args.shape)], args.layers)
    return ir.parse_source(source, "lowering.nir"), (("tp-dp", "TP", "DP"), ("dp-tp", "DP", "TP"))


def lower_once(module, source: str, target: str, rank: int, replays: bool, profiler=None) -> tuple:
    """({phase: CPU seconds}, (pieces, tensors moved)) of one lowering."""
    import torch

    from nereus.backends.proof import rank_part
    from nereus.backends.rank_json import canonical_json
    from nereus.passes import compile_transition
    from nereus.runtime import replay, streams
    from nereus.runtime.execution_plan import build_plan
    from nereus.runtime.program import DIRECT_MIN_BYTES, lower_text

    clock = time.process_time
    out = {}
    t = clock()
    compiled = compile_transition(module, source, target)
    out["compile_s"], t = clock() - t, clock()
    text = canonical_json(rank_part(compiled, rank))
    out["part_s"], t = clock() - t, clock()
    if profiler is not None:
        profiler.enable()
    facts, prog = lower_text(text, rank, DIRECT_MIN_BYTES)
    out["lower_s"], t = clock() - t, clock()
    plan = build_plan(prog, streams.CHUNK_BYTES)
    out["plan_s"], t = clock() - t, clock()
    if replays:
        replay.warm(prog, plan, torch.device("cpu"), streams.DEPTH, facts.offloaded)
        out["replays_s"] = clock() - t
    if profiler is not None:
        profiler.disable()
    pieces = [p for w in prog.rounds for p in list(w.copies) + [p for m in w.sends + w.recvs for p in m.pieces]]
    return out, (len(pieces), sum(getattr(p, "count", 1) for p in pieces)), len(text)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=HERE, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--moe", default=None, metavar="CASE",
                        help="a case of moe_reshard.py (gen-ep2-tp2, train-ep2-tp2, train-ep2-dp2); default: the "
                             "dense TP <-> DP change of dtensor_compare.py")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shape", default="30b-a3b", help="moe_reshard.SHAPES (MoE) or mg_common.SHAPES (dense: "
                                                          "8b for the default)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-replays", action="store_true", help="leave the replays' tables out")
    parser.add_argument("--profile", default=None, help="write cProfile's top functions of one more lowering here")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    replays = not args.no_replays
    if replays:  # before anything imports the kernels: their tables build on the CPU, nothing launches
        os.environ.setdefault("NEREUS_PACK_BACKEND", "triton")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    torch.set_num_threads(1)
    module, directions = _module(args)
    result: dict = {}
    for case, source, target in directions:
        rows, counts, size = [], None, 0
        for _ in range(args.repeats):
            phases, counts, size = lower_once(module, source, target, args.rank, replays)
            rows.append(phases)
        median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        result[case] = {"first": rows[0], "median": median, "median_total_s": sum(median.values()),
                        "pieces": counts[0], "tensors_moved": counts[1], "part_bytes": size}
        print(f"{case}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in median.items())
              + f" (median of {args.repeats}; {counts[0]} pieces moving {counts[1]} tensors)", flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        _, source, target = directions[0]
        lower_once(module, source, target, args.rank, replays, profiler)
        text = io.StringIO()
        for key in ("cumulative", "tottime"):
            pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(args.top)
        with open(args.profile, "w") as f:
            f.write(text.getvalue())
    summary = {"name": "lowering_cost", "moe": args.moe, "layers": args.layers, "shape": args.shape,
               "world": args.world, "rank": args.rank, "repeats": args.repeats, "replays": replays,
               "cases": result, "commit": _commit(),
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                           "load_average": os.getloadavg()}}
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(json.dumps(summary) + "\n")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
