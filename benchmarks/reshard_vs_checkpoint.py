"""Nereus resharding against checkpoint/restart and gather-then-scatter, on gloo ranks.

    PYTHONPATH=. python benchmarks/reshard_vs_checkpoint.py            # >= 1 GiB of state
    PYTHONPATH=. python benchmarks/reshard_vs_checkpoint.py --small    # a quick smoke run

One llama-shaped actor.training model-stage (bf16 weights + fp32 master, exp_avg,
exp_avg_sq + step) on `--ranks` gloo processes, starting in plan tp2 (dp1 tp2 on ranks
0, 1), for three changes: tp2-tp4 (TP 2→4), pp1-pp2 (PP 1→2, tp 2) and gpus2-gpus4
(2→4 ranks holding state: dp 1→2). Per case:

Every method is timed the same way (`_timed`): a barrier before and after each run, the
slowest rank's wall time; the first run in the process group is cold (`*_cold_s`), then
`--repeats` more runs whose median is warm (`*_s`, the ratios use these; `ratio_*_cold`
compare cold with cold).

- nereus_s: `Runtime.transition` (compile and the program's proof excluded: done once per
  (from, to) before the first run, reported as nereus_compile_s and
  nereus_verify_program_s); between runs a transition back to the old layout, untimed;
- dcp_s: torch.distributed.checkpoint save in the old sharding + load in the new one
  (ShardedTensors whose shards are the layout's boxes, so DCP reshards on load); between
  runs the checkpoint folder is removed, untimed;
- dcp_restart_s: the save, then new processes and process group, state rebuilt in the
  new layout, and the load (measured from the launch to the last rank's load end): cold
  by nature, once;
- gather_scatter_s: every tensor gathered whole on rank 0 and scattered in the new layout.

Bytes: bytes_moved = bytes Nereus sent between ranks; bytes_lower_bound = bytes of every
new shard that its rank did not hold before. verified: every rank's new shards equal the
reference values element for element, for Nereus, DCP and gather-scatter alike. The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STAGE = "actor.training"
CASES = {"tp2-tp4": ("tp2", "tp4"), "pp1-pp2": ("tp2", "pp2"), "gpus2-gpus4": ("tp2", "dp2")}
NIR = """
cluster cpu {{
  nodes 1
  gpus_per_node {ranks}
  gpu {{ mem 64GB  flops 1TFLOPS  hbm 100GB/s }}
  intra 10GB/s
  inter 1GB/s
  host_mem 24GB
}}
model actor = llama {{ layers {layers} hidden {hidden} heads {heads} kv_heads {kv_heads} ffn {ffn} vocab {vocab} }}
workload sft {{
  batch 4  prompt 16  response 16  microbatch 1
  training: actor
}}
plan tp2 {{ actor.training dp 1 tp 2 on 0, 1 }}
plan tp4 {{ actor.training dp 1 tp 4 on 0..3 }}
plan pp2 {{ actor.training dp 1 tp 2 pp 2 on 0..3 }}
plan dp2 {{ actor.training dp 2 tp 2 on 0..3 }}
"""
SIZES = {"full": dict(layers=6, hidden=1024, heads=8, kv_heads=4, ffn=2816, vocab=16000),
         "small": dict(layers=2, hidden=256, heads=8, kv_heads=4, ffn=512, vocab=1024)}


# -- reference values, generated per box (no rank ever holds the whole model) -----------

def box_values(name: str, box, shape, dtype) -> torch.Tensor:
    """Deterministic values of a global box: a hash of the element's global index."""
    salt = sum(ord(c) * (i + 1) for i, c in enumerate(name)) % 9973
    if not shape:
        return torch.tensor(7, dtype=dtype)
    index = torch.zeros([hi - lo for lo, hi in box], dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(shape))):
        lo, hi = box[d]
        view = [1] * len(shape)
        view[d] = hi - lo
        index += torch.arange(lo, hi, dtype=torch.int64).view(view) * stride
        stride *= shape[d]
    return (((index * 40503 + salt) % 2039).to(torch.float32) / 256 - 4).to(dtype)


def shard_values(name, boxes, shape, dtype) -> torch.Tensor:
    parts = [box_values(name, b, shape, dtype) for b in boxes]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def local_state(units, rank, specs) -> dict:
    unit = next((u for u in units if rank in u["gpus"]), None)
    if unit is None:
        return {}
    out = {s["tensor"]: shard_values(s["tensor"], s["boxes"], *specs[s["tensor"]])
           for s in unit["shards"] if s["gpu"] == rank}
    out["actor/#step"] = torch.tensor(7, dtype=torch.int64)
    return out


def check(local: dict, units, rank, specs) -> bool:
    unit = next((u for u in units if rank in u["gpus"]), None)
    expected = {} if unit is None else {s["tensor"]: s["boxes"] for s in unit["shards"] if s["gpu"] == rank}
    if set(local) - {"actor/#step"} != set(expected):
        return False
    return all(torch.equal(local[n], shard_values(n, b, *specs[n])) for n, b in expected.items())


def lower_bound(before, after, specs) -> int:
    """Bytes of every new shard that its rank did not hold before (owner changes)."""
    from nereus.runtime.boxes import as_box, box_numel, intersect

    held = {}
    for unit in before:
        for s in unit["shards"]:
            held.setdefault((s["gpu"], s["tensor"]), []).extend(as_box(b) for b in s["boxes"])
    total = 0
    for unit in after:
        for s in unit["shards"]:
            itemsize = torch.empty((), dtype=specs[s["tensor"]][1]).element_size()
            for raw in s["boxes"]:
                box = as_box(raw)
                have = sum(box_numel(x) for h in held.get((s["gpu"], s["tensor"]), ()) if (x := intersect(box, h)))
                total += (box_numel(box) - have) * itemsize
    return total


def all_true(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# -- DCP: the layout's boxes as ShardedTensor shards -------------------------------------

def sharded(units, rank, local, specs, groups=None) -> dict:
    """A DCP state dict of `local` in the layout `units`. Save form (groups None): every
    distinct box once, on its first holder, over the default group. Load form: one
    ShardedTensor per replica over that replica's group; whole-tensor shards as plain tensors."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    from nereus.runtime.state import writers

    def make(pieces, shape, group):
        shards = [Shard(t, ShardMetadata([lo for lo, _ in box], [hi - lo for lo, hi in box], f"rank:{rank}/cpu"))
                  for box, t in pieces]
        return ShardedTensor._init_from_local_shards(shards, list(shape), process_group=group)

    def rows(name, boxes, index):
        off = sum(b[0][1] - b[0][0] for b in boxes[:index])
        return local[name][off: off + boxes[index][0][1] - boxes[index][0][0]]

    mine = {}
    unit = next((u for u in units if rank in u["gpus"]), None)
    if unit is not None:
        mine = {s["tensor"]: [tuple(map(tuple, b)) for b in s["boxes"]] for s in unit["shards"] if s["gpu"] == rank}
    out = {}
    names = sorted(n for n in specs if not n.endswith("#step"))
    if groups is None:
        write = writers(units)
        for name in names:
            pieces = [(box, rows(name, mine[name], i)) for g, i, box in write.get(name, ()) if g == rank]
            out[name] = make(pieces, specs[name][0], None)
        return out
    for u in units:
        if rank not in u["gpus"]:
            continue
        for name in names:
            shape = specs[name][0]
            whole = tuple((0, n) for n in shape)
            partial = any(s["tensor"] == name and any(tuple(map(tuple, b)) != whole for b in s["boxes"])
                          for s in u["shards"])
            boxes = mine.get(name, [])
            if not partial:
                if boxes:
                    out[name] = local[name]  # a whole tensor: DCP loads it as a plain tensor
                continue
            out[name] = make([(b, rows(name, boxes, i)) for i, b in enumerate(boxes)], shape, groups[u["id"]])
    return out


def gather_scatter(units_a, units_b, rank, local, specs) -> dict:
    """Every tensor gathered whole on rank 0, then each new shard sent to its holder."""
    from nereus.runtime.state import gather_to_root, shard_of, writers

    write = writers(units_a)
    mine_a = {}
    unit = next((u for u in units_a if rank in u["gpus"]), None)
    if unit is not None:
        mine_a = {s["tensor"]: s["boxes"] for s in unit["shards"] if s["gpu"] == rank}
    new = {}
    holders = [(u, s) for u in units_b for s in u["shards"]]
    for name in sorted(n for n in specs if not n.endswith("#step")):
        shape, dtype = specs[name]
        full = torch.empty(shape, dtype=dtype) if rank == 0 else None
        gather_to_root(full, write[name], local.get(name), mine_a.get(name, []), rank)
        ops = []
        for u, s in holders:
            if s["tensor"] != name:
                continue
            if rank == 0:
                piece = shard_of(full, s["boxes"])
                if s["gpu"] == 0:
                    new[name] = piece
                else:
                    ops.append(dist.P2POp(dist.isend, piece, s["gpu"]))
            elif s["gpu"] == rank:
                from nereus.runtime.boxes import as_box, shard_shape

                new[name] = torch.empty(shard_shape([as_box(b) for b in s["boxes"]]), dtype=dtype)
                ops.append(dist.P2POp(dist.irecv, new[name], 0))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
    return new


# -- workers -------------------------------------------------------------------------------

def _setup(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=900))


def _timed(run, repeats: int, prepare=None) -> tuple[float, float]:
    """(cold, warm) seconds of `run(i)` on the slowest rank, as Nereus is timed: a barrier
    before and after each run; run 0 is cold (first in the process group), runs 1..repeats
    follow it and their median is warm. `prepare(i)` runs before run i >= 1, untimed."""
    times = []
    for i in range(repeats + 1):
        if prepare is not None and i:
            prepare(i)
        dist.barrier()
        t0 = time.perf_counter()
        run(i)
        dist.barrier()
        times.append(slowest(time.perf_counter() - t0))
    return times[0], statistics.median(times[1:])


def _replica_groups(units):
    return {u["id"]: dist.new_group(u["gpus"]) for u in units}  # collective: every rank, same order


def _phase_one(rank, world, port, source, cases, folder, repeats):
    """Nereus, DCP save+load and gather-then-scatter for every case, in one process group."""
    _setup(rank, world, port)
    import nereus.ir as ir
    import torch.distributed.checkpoint as dcp
    from nereus.runtime import Runtime

    module = ir.parse_source(source, "bench.nir")
    out = {}
    for case in cases:
        a, b = CASES[case]
        rt = Runtime(module, a, timeout_s=900)
        specs = rt.tensor_specs(STAGE)
        units_a, units_b = rt.layout(STAGE, a), rt.layout(STAGE, b)
        rt.register(STAGE, local_state(units_a, rank, specs))
        _, compile_s = rt.compile(b)
        reports = []
        # between runs, back to the old layout (not timed), so every run moves the same bytes
        nereus_cold, nereus_warm = _timed(lambda i: reports.append(rt.transition(b)), repeats,
                                          prepare=lambda i: rt.transition(a))
        report = reports[-1]
        verify_program_s = reports[0].verify_program_s
        nereus_ok = all_true(check(rt.state(STAGE), units_b, rank, specs))
        rounds = report.rounds
        rt = reports = None  # free the state before the next method runs
        gc.collect()

        local_a = local_state(units_a, rank, specs)
        save_sd = sharded(units_a, rank, local_a, specs)
        target = {k: torch.empty_like(v) for k, v in local_state(units_b, rank, specs).items()}
        load_sd = sharded(units_b, rank, target, specs, _replica_groups(units_b))
        saves, loads = [], []

        ckpt = os.path.join(folder, case)  # the last one stays for the restart phase

        def save_and_load(i):
            t0 = time.perf_counter()
            dcp.save(save_sd, checkpoint_id=ckpt)
            dist.barrier()
            saves.append(slowest(time.perf_counter() - t0))
            t0 = time.perf_counter()
            dcp.load(load_sd, checkpoint_id=ckpt)
            dist.barrier()
            loads.append(slowest(time.perf_counter() - t0))

        def fresh_checkpoint(i):
            if rank == 0:
                shutil.rmtree(ckpt, ignore_errors=True)

        dcp_cold, dcp_warm = _timed(save_and_load, repeats, prepare=fresh_checkpoint)
        target["actor/#step"] = torch.tensor(7, dtype=torch.int64) if target else None
        target = {k: v for k, v in target.items() if v is not None}
        dcp_ok = all_true(check(target, units_b, rank, specs))
        save_sd = load_sd = target = None
        gc.collect()

        results = [None]  # only the latest run's shards stay alive (memory as for the other methods)

        def gather_then_scatter(i):
            results[0] = None
            results[0] = gather_scatter(units_a, units_b, rank, local_a, specs)

        gs_cold, gs_warm = _timed(gather_then_scatter, repeats)
        moved = results[0]
        if moved:
            moved["actor/#step"] = torch.tensor(7, dtype=torch.int64)
        gs_ok = all_true(check(moved, units_b, rank, specs))
        moved = results = local_a = None
        gc.collect()
        out[case] = {
            "nereus_s": nereus_warm, "nereus_cold_s": nereus_cold, "nereus_compile_s": compile_s,
            "nereus_executor_s": report.max_seconds, "nereus_verify_program_s": verify_program_s,
            "dcp_s": dcp_warm, "dcp_cold_s": dcp_cold,
            "dcp_save_s": statistics.median(saves[1:]), "dcp_load_s": statistics.median(loads[1:]),
            "dcp_save_cold_s": saves[0],
            "gather_scatter_s": gs_warm, "gather_scatter_cold_s": gs_cold, "repeats": repeats,
            "bytes_moved": report.total_bytes_sent, "bytes_lower_bound": lower_bound(units_a, units_b, specs),
            "state_bytes": sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
                               for shape, dt in specs.values()),
            "verified": nereus_ok and dcp_ok and gs_ok, "verified_nereus": nereus_ok, "verified_dcp": dcp_ok,
            "verified_gather_scatter": gs_ok, "rounds": len(rounds),
            "nereus_exchange_s": max(r["exchange_s"] for r in rounds) if rounds else 0.0,
        }
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(os.path.join(folder, "phase_one.pkl"), "wb") as f:
            pickle.dump(out, f)


def _restart(rank, world, port, source, case, folder):
    """A restarted job: new process group, state rebuilt in the new layout, DCP load."""
    _setup(rank, world, port)
    import nereus.ir as ir
    import torch.distributed.checkpoint as dcp
    from nereus.backends.json_program import plan_units_json
    from nereus.runtime.runtime import tensor_specs

    module = ir.parse_source(source, "bench.nir")
    b = CASES[case][1]
    units_b = plan_units_json(module, b, STAGE)
    specs = tensor_specs(module, STAGE)
    target = {}
    unit = next((u for u in units_b if rank in u["gpus"]), None)
    if unit is not None:
        from nereus.runtime.boxes import as_box, shard_shape

        target = {s["tensor"]: torch.empty(shard_shape([as_box(x) for x in s["boxes"]]), dtype=specs[s["tensor"]][1])
                  for s in unit["shards"] if s["gpu"] == rank}
    load_sd = sharded(units_b, rank, target, specs, _replica_groups(units_b))
    dcp.load(load_sd, checkpoint_id=os.path.join(folder, case))
    dist.barrier()
    end = time.time()
    if target:
        target["actor/#step"] = torch.tensor(7, dtype=torch.int64)
    ok = all_true(check(target, units_b, rank, specs))
    dist.destroy_process_group()
    with open(os.path.join(folder, f"restart-{rank}.pkl"), "wb") as f:
        pickle.dump((end, ok), f)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model (smoke run)")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--repeats", type=int, default=3, help="warm runs after the cold one (median reported)")
    parser.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary one under /tmp)")
    args = parser.parse_args(argv)
    if args.ranks != 4:
        parser.error("the plans of this benchmark use exactly 4 ranks")
    size = SIZES["small" if args.small else "full"]
    source = NIR.format(ranks=args.ranks, **size)
    cases = [c for c in args.cases.split(",") if c]
    folder = args.dir or tempfile.mkdtemp(prefix="nereus-bench-", dir="/tmp")
    os.makedirs(folder, exist_ok=True)
    try:
        mp.start_processes(_phase_one, args=(args.ranks, _port(), source, cases, folder, args.repeats), nprocs=args.ranks,
                           start_method="spawn")
        with open(os.path.join(folder, "phase_one.pkl"), "rb") as f:
            results = pickle.load(f)
        out = []
        for case in cases:
            started = time.time()
            mp.start_processes(_restart, args=(args.ranks, _port(), source, case, folder), nprocs=args.ranks,
                               start_method="spawn")
            ends = [pickle.load(open(os.path.join(folder, f"restart-{r}.pkl"), "rb")) for r in range(args.ranks)]
            r = results[case]
            restart_ok = all(ok for _, ok in ends)
            r["dcp_restart_s"] = r["dcp_save_s"] + max(end for end, _ in ends) - started
            r["verified"] = r["verified"] and restart_ok
            r["ratio_dcp_restart"] = r["dcp_restart_s"] / r["nereus_s"]
            r["ratio_dcp"] = r["dcp_s"] / r["nereus_s"]
            r["ratio_gather_scatter"] = r["gather_scatter_s"] / r["nereus_s"]
            r["ratio_dcp_cold"] = r["dcp_cold_s"] / r["nereus_cold_s"]
            r["ratio_gather_scatter_cold"] = r["gather_scatter_cold_s"] / r["nereus_cold_s"]
            shutil.rmtree(os.path.join(folder, case), ignore_errors=True)
            print(f"{case}: warm (cold) nereus {r['nereus_s']:.3f} ({r['nereus_cold_s']:.3f}) s, dcp {r['dcp_s']:.3f}"
                  f" ({r['dcp_cold_s']:.3f}) s, gather-scatter {r['gather_scatter_s']:.3f} ({r['gather_scatter_cold_s']:.3f})"
                  f" s, dcp restart {r['dcp_restart_s']:.2f} s; "
                  f"moved {r['bytes_moved']} B, lower bound {r['bytes_lower_bound']} B, verified {r['verified']}",
                  flush=True)
            out.append({"case": case, **r})
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    result = {"name": "reshard_vs_checkpoint", "ranks": args.ranks, "model": size, "cases": out}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
