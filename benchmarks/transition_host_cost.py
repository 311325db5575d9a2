"""The fixed host cost of a warm transition, on CPU: many pieces, tiny tensors, so host
work (round setup, agreements, the report) dominates and bytes cost next to nothing.

Two gloo processes run `Runtime.transition` back and forth between two plans of a small
llama actor (generation and training with Adam state; `--layers` sets how many pieces):
A = generation dp 2, training tp 2; B = generation tp 2, training dp 2 (the TP <-> DP
change of the GPU benchmarks, in miniature). After `--warmup` transitions, each of
`--repeats` transitions is timed on every rank from a barrier to the call's return (wall
clock, and the calling thread's CPU time, which the other processes of a shared machine
disturb less); a transition's time is its slowest rank's. Also counted per warm transition: the
collectives on the runtime's control group (by wrapping torch.distributed's functions)
and the pieces of the busiest rank's program (sent, received, copied, kept).

    python benchmarks/transition_host_cost.py [--layers 32] [--repeats 41] [--warmup 4]
        [--rollback device|auto] [--profile N]   # cProfile rank 0's warm transitions, print the top N functions

`--rollback auto` runs the CUDA default's host path (the parking plan of every call) on
CPU tensors: with the program's room nothing is parked.

Last stdout line: {"name": "transition_host_cost", "layers", "repeats", "rollback",
"control_collectives", "cases": [{"case", "pieces", "median_us", "p10_us", "p90_us",
"median_us_per_piece", "cpu_median_us", "cpu_us_per_piece"}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile

SOURCE = """
cluster cpu {{
  nodes 1
  gpus_per_node 2
  gpu {{ mem 8GB  flops 1TFLOPS  hbm 100GB/s }}
  intra 10GB/s
  inter 1GB/s
  host_mem 64GB
}}
model actor = llama {{ layers {layers} hidden 32 heads 4 kv_heads 2 ffn 64 vocab 64 }}
workload ppo {{
  batch 4  prompt 16  response 16  microbatch 1
  generation: actor
  training:   actor
}}
plan A {{
  actor.generation  dp 2       on 0, 1
  actor.training    dp 1 tp 2  on 0, 1
}}
plan B {{
  actor.generation  dp 1 tp 2  on 0, 1
  actor.training    dp 2       on 0, 1
}}
"""
STAGES = ("actor.generation", "actor.training")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list",
               "gather", "scatter", "reduce", "barrier", "all_to_all")


def _count_control(rt) -> dict:
    """Wrap torch.distributed's collectives: count the calls on the runtime's control group."""
    import torch.distributed as dist

    counts = {}
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            if kwargs.get("group") is rt._control:
                counts[_name] = counts.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(dist, name, wrapped)
    return counts


def _worker(rank: int, world: int, args, folder: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    import nereus.ir as ir
    from nereus.runtime import Runtime

    torch.set_num_threads(1)
    # the ranks meet through a file: a port picked in the parent could be taken before rank 0 binds it
    dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "store"), rank=rank, world_size=world)
    module = ir.parse_source(SOURCE.format(layers=args.layers), "host_cost.nir")
    park = ("cpu",) if args.rollback != "device" else ("cuda",)  # "auto"/"host": the GPU default's host path
    rt = Runtime(module, "A", rank=rank, world_size=world, verify_programs=False, rollback=args.rollback,
                 park_device_types=park)
    gen = torch.Generator().manual_seed(0)
    for ms in STAGES:
        full = {name: (torch.tensor(3, dtype=torch.int64) if name.endswith("#step")
                       else torch.randn(shape, generator=gen).to(dtype))
                for name, (shape, dtype) in rt.tensor_specs(ms).items()}
        rt.register(ms, rt.shard_state_dict(ms, full))
    order = ["B", "A"]
    for k in range(args.warmup):  # compiles and lowers both directions
        rt.transition(order[k % 2])
    counts = _count_control(rt)
    profiler = None
    if args.profile and rank == 0:
        import cProfile

        profiler = cProfile.Profile()
    times = {"A->B": [], "B->A": []}
    for k in range(args.repeats * 2):
        target = order[(args.warmup + k) % 2]
        source = rt.plan
        dist.barrier()
        counts_before = sum(counts.values())
        if profiler is not None:
            profiler.enable()
        started, cpu = time.perf_counter(), time.thread_time()
        rt.transition(target)
        elapsed, cpu = time.perf_counter() - started, time.thread_time() - cpu
        if profiler is not None:
            profiler.disable()
        control = sum(counts.values()) - counts_before
        times[f"{source}->{target}"].append((elapsed, control, cpu))
    # both directions are lowered by now, also with --warmup 0 or 1
    pieces = {}
    for key, prog in rt._lowered.items():
        # a piece of several tensors (a v2 range) counts once per tensor, as before ranges
        pieces[f"{key[0]}->{key[1]}"] = sum(p.count for w in prog.rounds for m in w.sends + w.recvs for p in m.pieces) \
            + sum(p.count for w in prog.rounds for p in w.copies) \
            + sum(len(a.tensors) for w in prog.rounds for a in w.aliases)
    if profiler is not None:
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.profile)
        print(text.getvalue(), file=sys.stderr)
    dist.destroy_process_group()
    with open(os.path.join(folder, f"{rank}.pkl"), "wb") as f:
        pickle.dump({"times": times, "pieces": pieces}, f)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=41, help="timed transitions per direction")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rollback", default="device", choices=("device", "auto"),
                        help="auto: the CUDA default's host path (parking plan), run on CPU tensors")
    parser.add_argument("--profile", type=int, default=0, help="print rank 0's top N functions (cProfile)")
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp

    world = 2
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_worker, args=(world, args, folder), nprocs=world, start_method="spawn", join=True)
        ranks = [pickle.load(open(os.path.join(folder, f"{r}.pkl"), "rb")) for r in range(world)]
    cases = []
    for case in ("A->B", "B->A"):
        per_call = [max(rank["times"][case][k][0] for rank in ranks) for k in range(args.repeats)]
        pieces = max(rank["pieces"][case] for rank in ranks)
        deciles = statistics.quantiles(per_call, n=10)
        median = statistics.median(per_call)
        cpu = statistics.median(max(rank["times"][case][k][2] for rank in ranks) for k in range(args.repeats))
        cases.append({"case": case, "pieces": pieces, "median_us": round(median * 1e6, 1),
                      "p10_us": round(deciles[0] * 1e6, 1), "p90_us": round(deciles[-1] * 1e6, 1),
                      "median_us_per_piece": round(median * 1e6 / pieces, 2), "cpu_median_us": round(cpu * 1e6, 1),
                      "cpu_us_per_piece": round(cpu * 1e6 / pieces, 2)})
    control = sorted({c for rank in ranks for times in rank["times"].values() for _, c, _ in times})
    out = {"name": "transition_host_cost", "layers": args.layers, "repeats": args.repeats, "rollback": args.rollback,
           "control_collectives": control, "cases": cases}
    for c in cases:
        print(f"{c['case']}: {c['pieces']} pieces (busiest rank), median {c['median_us']:.0f} us "
              f"(p10 {c['p10_us']:.0f}, p90 {c['p90_us']:.0f}), {c['median_us_per_piece']:.2f} us per piece; "
              f"calling thread's CPU {c['cpu_median_us']:.0f} us ({c['cpu_us_per_piece']:.2f} per piece)")
    print(f"control-group collectives per warm transition: {control}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
