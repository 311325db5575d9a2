"""Offload check: transitions into and out of an `offload` layout on 2 ranks, with the
PCIe part timed against the host<->device bandwidth measured in the same run.

Two model-stages: actor.generation (on the GPUs throughout, moving between layouts) and
ref.inference, which plan B and plan C flag `offload` (B: the same TP layout, so only
device<->host copies; C: another layout, so messages land in host memory on the other
rank). The chain A -> B -> A -> C -> A runs `--repeats` times. After every transition
each rank checks, byte for byte, its shards against reference values computed on its
device; that offloaded shards are CPU tensors, pinned (`is_pinned()`, skipped without
CUDA) and the others on its device; that the device bytes the runtime reports equal the
compiler's memory model (resident bytes per model-stage); and, with `--gather` (default
with --quick), that `gather_state_dict` returns the reference.

PCIe figures per transition (last repeat: programs compiled, links open): the bytes each
rank moved between host and device (`TransitionReport.offload_bytes`), the slowest
rank's seconds, and the lower bound bytes / bandwidth, with the bandwidth measured here:
one pinned host tensor of `--probe-mb` copied host->device and device->host (best of 5).

    torchrun --standalone --nproc-per-node 2 benchmarks/multi_gpu/offload_check.py            # 2 GPUs, NCCL
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/multi_gpu/offload_check.py --backend gloo --quick                          # CPU check

Last stdout line (rank 0): {"name": "offload_check", "passed", "gpus", "backend", "device",
"pinned_checked", "bandwidth_gbps": {"h2d", "d2h"}, "transitions": [...], "machine"}.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from mg_common import SHAPES, Env, add_common_args, cluster_source, machine, salt_of, same_bytes, shard_values, whole_program

STAGES = ("actor.generation", "ref.inference")
CHAIN = ("B", "A", "C", "A")


def source(shape: dict, layers: int, world: int, mem: int) -> str:
    s = dict(shape, layers=layers)
    gpus = list(range(world))
    rev = list(reversed(gpus))
    on = ", ".join(map(str, gpus))
    return (cluster_source(world, mem)
            + f"model actor = llama {{ layers {s['layers']} hidden {s['hidden']} heads {s['heads']} "
              f"kv_heads {s['kv_heads']} ffn {s['ffn']} vocab {s['vocab']} dtype bf16 }}\n"
            + "model ref = actor\n"
            + "workload w { batch 8  prompt 128  response 128  microbatch 1\n"
              "  generation: actor\n  inference: ref }\n"
            + f"plan A {{\n  actor.generation dp 1 tp {world} on {on}\n  ref.inference dp 1 tp {world} on {on}\n}}\n"
            + f"plan B {{\n  actor.generation dp {world} tp 1 on {on}\n"
              f"  ref.inference dp 1 tp {world} on {on} offload\n}}\n"
            + f"plan C {{\n  actor.generation dp 1 tp {world} on {', '.join(map(str, rev))}\n"
              f"  ref.inference dp {world} tp 1 on {', '.join(map(str, rev))} offload\n}}\n")


def bandwidth(env: Env, megabytes: int) -> dict:
    """Host->device and device->host GB/s of one pinned tensor (best of 5), this rank."""
    n = megabytes * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=env.cuda)
    dev = torch.empty(n, dtype=torch.uint8, device=env.device)
    out = {}
    for name, (dst, src) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        best = float("inf")
        for _ in range(5):
            env.sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=env.cuda)
            env.sync()
            best = min(best, time.perf_counter() - t0)
        out[name] = n / best / 1e9
    return out


def check(rt, env, module, seed: int, gather: bool) -> list:
    """What is wrong with this rank's state after a transition (empty when right)."""
    from nereus.passes.feasibility import resident_bytes_by_model_stage

    bad = []
    plan = module.plan(rt.plan)
    model = resident_bytes_by_model_stage(module, plan)
    for ms in STAGES:
        offloaded = next(p.offload for p in plan.placements if str(p.model_stage) == ms)
        specs = rt.tensor_specs(ms)
        state = rt.state(ms)
        places = rt.placement(ms)
        if set(places) != set(state):
            bad.append(f"{ms}: placement lists {len(places)} shards, the state holds {len(state)}")
        unit = next((u for u in rt.layout(ms) if env.rank in u["gpus"]), None)
        boxes = {} if unit is None else {s["tensor"]: s["boxes"] for s in unit["shards"] if s["gpu"] == env.rank}
        if set(boxes) != set(state):
            bad.append(f"{ms}: {len(state)} shards held, {len(boxes)} expected")
        for name, tensor in state.items():
            want = "host" if offloaded else "device"
            if places.get(name) != want:
                bad.append(f"{ms} {name}: placement {places.get(name)}, the plan says {want}")
            if offloaded and (tensor.device.type != "cpu" or (env.cuda and not tensor.is_pinned())):
                bad.append(f"{ms} {name}: offloaded but on {tensor.device} (pinned {tensor.is_pinned()})")
            if not offloaded and tensor.device != env.device:
                bad.append(f"{ms} {name}: on {tensor.device}, not on {env.device}")
            shape, dtype = specs[name]
            ref = shard_values(salt_of(seed, ms, name), boxes.get(name, ()), shape, dtype, env.device)
            if not same_bytes(tensor.to(env.device), ref):
                bad.append(f"{ms} {name}: bytes differ")
        if rt.device_bytes(ms) != model.get(ms, {}).get(env.rank, 0):
            bad.append(f"{ms}: device bytes {rt.device_bytes(ms)}, the memory model says "
                       f"{model.get(ms, {}).get(env.rank, 0)}")
        if gather:
            full = rt.gather_state_dict(ms)
            for name, (shape, dtype) in specs.items():
                ref = shard_values(salt_of(seed, ms, name), [[[0, d] for d in shape]], shape, dtype, "cpu")
                if not same_bytes(full[name], ref):
                    bad.append(f"{ms} {name}: gathered bytes differ")
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--layers", type=int, default=None, help="layers of the 8B-shaped model (default 4, quick 2)")
    parser.add_argument("--repeats", type=int, default=2, help="times the chain runs (the last is reported warm)")
    parser.add_argument("--probe-mb", type=int, default=None, help="bandwidth probe size (default 1024, quick 16)")
    parser.add_argument("--gather", action="store_true", help="also check gather_state_dict (default with --quick)")
    args = parser.parse_args(argv)
    env = Env(args)

    import nereus.ir as ir
    from nereus.passes.verify import verify_program
    from nereus.runtime import Runtime

    shape = SHAPES["8b"] if env.cuda and not args.quick else SHAPES["tiny"]
    layers = args.layers or (2 if args.quick else 4)
    module = ir.parse_source(source(shape, layers, env.world, env.gpu_mem_bytes()), "offload_check.nir")
    rt = Runtime(module, "A", device=env.device)
    for ms in STAGES:
        specs = rt.tensor_specs(ms)
        unit = next((u for u in rt.layout(ms) if env.rank in u["gpus"]), None)
        local = {} if unit is None else {
            s["tensor"]: shard_values(salt_of(args.seed, ms, s["tensor"]), s["boxes"], *specs[s["tensor"]], env.device)
            for s in unit["shards"] if s["gpu"] == env.rank}
        rt.register(ms, local)
        del local
    env.log(f"offload check: {shape}, layers {layers}, {env.world} ranks, {env.backend}")
    gather = args.gather or args.quick
    problems = check(rt, env, module, args.seed, gather)
    probe = bandwidth(env, args.probe_mb or (16 if args.quick else 1024))
    bw = {k: env.slowest(-v) * -1 for k, v in probe.items()}  # the slowest rank's link
    transitions = []
    for repeat in range(args.repeats):
        for target in CHAIN:
            source_plan = rt.plan
            program = whole_program(rt, target)
            replay = verify_program(program).peak_bytes.get(env.rank, 0)
            env.barrier()
            report = rt.transition(target)
            bad = check(rt, env, module, args.seed, gather)
            problems += [f"{source_plan}->{target}: {b}" for b in bad]
            moved = env.slowest(report.offload_bytes)
            into = any(p.offload for p in module.plan(target).placements)
            rate = bw["d2h"] if into else bw["h2d"]
            row = {"repeat": repeat, "from": source_plan, "to": target, "seconds": report.max_seconds,
                   "offload_bytes_max_rank": int(moved), "offload_bytes_total": int(env.total(report.offload_bytes)),
                   "pcie_bound_s": moved / (rate * 1e9), "direction": "d2h" if into else "h2d",
                   "peak_bytes": int(env.slowest(report.peak_bytes)), "replay_peak_bytes": int(env.slowest(replay)),
                   "rounds": len(report.rounds), "ok": env.all_true(not bad)}
            row["seconds_over_bound"] = row["seconds"] / row["pcie_bound_s"] if row["pcie_bound_s"] else None
            transitions.append(row)
            env.log(f"{source_plan} -> {target}: {row['seconds'] * 1e3:.1f} ms, {moved / 1e6:.1f} MB over PCIe "
                    f"(bound {row['pcie_bound_s'] * 1e3:.1f} ms at {rate:.1f} GB/s), ok={row['ok']}")
    passed = env.all_true(not problems)
    if problems and env.rank == 0:
        print("\n".join(problems[:20]), flush=True)
    env.log(f"offload check: {'PASSED' if passed else 'FAILED'}")
    env.finish({"name": "offload_check", "passed": passed, "gpus": env.world, "backend": env.backend,
                "device": env.device.type, "quick": args.quick, "layers": layers, "shape": shape,
                "pinned_checked": env.cuda, "gather_checked": gather, "bandwidth_gbps": bw,
                "transitions": transitions, "problems": problems[:20], "machine": machine()}, args.json_out)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
