"""Where the time of a transition goes on 2+ GPUs: point-to-point patterns and profiles.

    torchrun --nproc-per-node 2 benchmarks/multi_gpu/diagnose.py --out-dir DIR
    torchrun --nproc-per-node 2 benchmarks/multi_gpu/diagnose.py --backend gloo --device cpu --quick --out-dir DIR

1. Raw NCCL point-to-point patterns between ranks 0 and 1 moving the same bytes: one
   op or many per direction, one direction or both, sends before receives or
   interleaved, one batch or blocks of ops; and the all-gather DTensor uses.
2. Nereus transitions (the DTensor comparison's TP -> DP of bf16 weights, the weight
   sync's training -> generation layout, a TP 1 -> 2 reshard with Adam state) under each
   way of posting a round's ops (`posting.P2P_BATCH`, `posting.P2P_INTERLEAVE`),
   medians of `--repeats` calls timed barrier to barrier.
3. One profiled call of each (PyTorch profiler): the GPU timeline per stream (kernels
   merged into busy intervals) and the host time before the first kernel, in DIR.
Every time is barrier to barrier with the devices synchronized. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from mg_common import SHAPES, Env, add_common_args, build_local, machine, measure_bandwidth
from mg_profile import timeline

# (ops per batch block, interleave, data communicators)
VARIANTS = [(0, False, 1), (0, False, 2), (0, False, 4), (0, True, 4), (0, False, 8), (16, True, 4)]


def median_time(env: Env, fn, repeats: int) -> float:
    fn()
    return statistics.median(env.timed(fn)[1] for _ in range(repeats))


def p2p_patterns(env: Env, total: int, repeats: int, groups: list) -> dict:
    out = {}
    if env.world < 2 or env.rank > 1:
        for _ in range(12 * (repeats + 1)):
            env.barrier()
        return out
    peer = 1 - env.rank
    buf = torch.empty(total, dtype=torch.uint8, device=env.device)
    inbox = torch.empty(total, dtype=torch.uint8, device=env.device)

    def run(n: int, both: bool, interleave: bool, block: int = 0, ngroups: int = 1):
        size = total // n
        gs = groups[:ngroups]
        sends = [(i % ngroups, dist.P2POp(dist.isend, buf[i * size:(i + 1) * size], peer, gs[i % ngroups], i))
                 for i in range(n)]
        recvs = [(i % ngroups, dist.P2POp(dist.irecv, inbox[i * size:(i + 1) * size], peer, gs[i % ngroups], i))
                 for i in range(n)]
        if not both:
            sends, recvs = (sends, []) if env.rank == 0 else ([], recvs)
        ops = [x for p in zip(sends, recvs) for x in p] if interleave and both else sends + recvs
        chunks = [ops] if block <= 0 else [ops[i:i + 2 * block] for i in range(0, len(ops), 2 * block)]
        reqs = []
        for c in chunks:
            for k in range(ngroups):
                part = [op for j, op in c if j == k]
                if part:
                    reqs += dist.batch_isend_irecv(part)
        for r in reqs:
            r.wait()

    cases = {"uni_1": (1, False, False), "bi_1": (1, True, False), "uni_64": (64, False, False),
             "bi_64_grouped": (64, True, False), "bi_64_interleaved": (64, True, True),
             "bi_512_grouped": (512, True, False), "bi_512_interleaved": (512, True, True),
             "bi_512_blocks32": (512, True, True, 32), "uni_64_g4": (64, False, False, 0, 4),
             "bi_64_g4": (64, True, False, 0, 4), "bi_512_g4": (512, True, False, 0, 4),
             "bi_512_g8": (512, True, False, 0, 8)}
    for name, args in cases.items():
        seconds = median_time(env, lambda: run(*args), repeats)
        out[name] = {"seconds": seconds, "GBps_per_direction": total / seconds / 1e9}
    return out


def allgather(env: Env, total: int, repeats: int) -> dict:
    part = torch.empty(total // env.world, dtype=torch.uint8, device=env.device)
    full = torch.empty(total // env.world * env.world, dtype=torch.uint8, device=env.device)
    seconds = median_time(env, lambda: dist.all_gather_into_tensor(full, part), repeats)
    return {"seconds": seconds, "GBps_in_per_gpu": (env.world - 1) * part.numel() / seconds / 1e9}


def profiled(env: Env, fn, path: str, label: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.cuda else [])
    env.barrier()
    with profile(activities=activities) as prof:
        fn()
        env.sync()
    return timeline(prof, f"{path}.rank{env.rank}.txt", label)


def workloads(env: Env, args) -> dict:
    """{name: (runtime-like object with forth/back callables)}."""
    import nereus.ir as ir
    from nereus.backends.json_program import plan_units_json
    from nereus.runtime import Runtime

    import dtensor_compare
    import reshard
    import weight_sync

    shape = SHAPES["8b"] if env.cuda else SHAPES["tiny"]
    out = {}
    mem = env.gpu_mem_bytes()
    module = ir.parse_source(dtensor_compare.module_source(env.world, mem, shape, args.layers), "d.nir")
    specs = {n: (s, d) for n, (s, d, _) in dtensor_compare.weight_specs(module).items()}
    rt = Runtime(module, "TP", device=env.device)
    rt.register("actor.generation", build_local(plan_units_json(module, "TP", "actor.generation"), env.rank, specs,
                                                0, "actor.generation", env.device))
    out["tp-dp weights"] = (lambda rt=rt: rt.transition("DP"), lambda rt=rt: rt.transition("TP"), rt)

    g = 1 if env.world == 2 else 2
    wmod = ir.parse_source(weight_sync.module_source(env.world, mem, shape, args.layers, g), "w.nir")
    wspecs = weight_sync.weight_specs(wmod)
    train = plan_units_json(wmod, "P", "actor.training")
    local = build_local(train, env.rank, wspecs, 0, "actor.training", env.device, names=lambda n: n in wspecs)
    from nereus.runtime.vllm_sync import WeightSync

    sync = WeightSync(wmod, device=env.device, control=env.ctrl)
    out["weight sync"] = (lambda: sync.run("P", local), lambda: None, sync)

    a, b = reshard.case_plans("tp1-tp2" if env.world == 2 else f"tp{env.world // 2}-tp{env.world}", env.world)
    rmod = ir.parse_source(reshard.module_source(env.world, mem, shape, max(1, args.layers // 2), ("actor", "critic"),
                                                 a, b), "r.nir")
    rrt = Runtime(rmod, "A", device=env.device)
    for m in ("actor", "critic"):
        ms = f"{m}.training"
        rrt.register(ms, build_local(plan_units_json(rmod, "A", ms), env.rank, reshard.full_specs(rmod, ms), 0, ms,
                                     env.device, step=7))
    out["tp reshard"] = (lambda: rrt.transition("B"), lambda: rrt.transition("A"), rrt)
    return out


def set_groups(loads: dict, groups: list) -> None:
    """Make every workload post its data ops over `groups` (one group: the default)."""
    data = None if len(groups) == 1 else list(groups)
    for _, _, owner in loads.values():
        if owner is not None:
            if hasattr(owner, "data_group"):
                owner.data_group = data
            else:
                owner._data = data


def cold_parts(env: Env, rt) -> dict:
    """The parts of a first transition in a process that has sent nothing yet, each timed
    alone (slowest rank): compile, lowering, pack-kernel compilation, links; then the
    transition itself (now warm in all of those) and a second one."""
    import time

    from nereus.runtime.executor import TORCH_DTYPES
    from nereus.runtime.prepare import warm_kernels, warm_links

    out = {}
    out["compile_s"] = env.timed(lambda: rt.compile("DP"))[1]
    box = {}
    out["lower_s"] = env.timed(lambda: box.update(x=rt._lower("DP")))[1]
    prog = box["x"][2]
    t = time.perf_counter()
    out["kernels"] = warm_kernels(prog, env.device, TORCH_DTYPES)
    out["kernels_s"] = env.slowest(time.perf_counter() - t)
    out["links_s"] = env.timed(lambda: warm_links(prog, rt._data, env.device))[1]
    out["first_transition_s"] = env.timed(lambda: rt.transition("DP"))[1]
    rt.transition("TP")
    out["second_transition_s"] = env.timed(lambda: rt.transition("DP"))[1]
    rt.transition("TP")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", default="diagnose")
    parser.add_argument("--p2p-mib", type=int, default=None, help="bytes per direction (default 2048 MiB; CPU 8)")
    args = parser.parse_args(argv)
    env = Env(args)
    from nereus.runtime import posting

    os.makedirs(args.out_dir, exist_ok=True)
    total = (args.p2p_mib or (2048 if env.cuda else 8)) << 20
    loads = workloads(env, args)
    result = {"cold": cold_parts(env, loads["tp-dp weights"][2])}
    env.log(f"cold parts (first use in this process): {json.dumps(result['cold'])}")
    result["bandwidth"] = measure_bandwidth(env, 1 << 30 if env.cuda else 4 << 20)
    groups = [None] + [dist.new_group() for _ in range(7)]
    for g in groups[1:]:  # create the communicators outside the timings
        dist.all_reduce(torch.ones(1, device=env.device), group=g)
    result["p2p"] = p2p_patterns(env, total, args.repeats, groups)
    result["allgather"] = allgather(env, total, args.repeats)
    env.log(f"p2p: {json.dumps(result['p2p'])}; allgather {json.dumps(result['allgather'])}")
    result["variants"] = {}
    for batch, interleave, ngroups in VARIANTS:
        posting.P2P_BATCH, posting.P2P_INTERLEAVE = batch, interleave
        set_groups(loads, groups[:ngroups])
        key = f"batch{batch}{'-interleave' if interleave else ''}-g{ngroups}"
        row = {}
        for name, (forth, back, owner) in loads.items():
            forth(), back()
            times = []
            for _ in range(args.repeats):
                times.append(env.timed(forth)[1])
                back()
            row[name] = statistics.median(times)
            if owner is not None and hasattr(owner, "transition"):  # host-side parts of one more call
                report = forth()
                row[name + " rounds (rank 0)"] = report.rounds if env.rank == 0 else None
                back()
        result["variants"][key] = row
        env.log(f"{key}: " + ", ".join(f"{n} {v * 1e3:.1f} ms" for n, v in row.items() if "rounds" not in n))
    best = min(result["variants"], key=lambda k: sum(v for n, v in result["variants"][k].items() if "rounds" not in n))
    result["profiles"] = {}
    for key in dict.fromkeys(["batch0-g1", best]):
        batch = int(key[5:].split("-")[0])
        posting.P2P_BATCH, posting.P2P_INTERLEAVE = batch, "-interleave" in key
        set_groups(loads, groups[:int(key.split("-g")[-1])])
        for name, (forth, back, _) in loads.items():
            label = f"{name} ({key})"
            result["profiles"][label] = profiled(env, forth, os.path.join(args.out_dir, "timeline"), label)
            back()
    posting.P2P_BATCH, posting.P2P_INTERLEAVE = 0, False
    set_groups(loads, [None])
    env.finish({"name": "multi_gpu_diagnose", "gpus": env.world, "device": env.device.type, "best": best,
                "layers": args.layers, **result, "machine": machine()}, args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
