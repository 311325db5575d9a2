"""Nereus `transition` beside DTensor `redistribute` on the same tensors, timed the same way.

    torchrun --nproc-per-node 2 benchmarks/multi_gpu/dtensor_compare.py                 # 2 H200s
    torchrun --nproc-per-node 2 benchmarks/multi_gpu/dtensor_compare.py --backend gloo --device cpu --quick

The bf16 generation weights of `--layers` Llama-3.1-8B-shaped layers (embedding and LM
head included), on all n GPUs of the host, in two layouts: TP n (column-parallel and
vocabulary tensors split on dim 0, row-parallel ones on dim 1, norms replicated) and DP n
(every tensor whole on every GPU). The changes DTensor can express between them:

- tp-dp: TP n -> DP n. DTensor: Shard(0)/Shard(1) -> Replicate() (an all-gather per
  tensor); Nereus: the compiled transition (point-to-point messages).
- dp-tp: DP n -> TP n. DTensor: Replicate() -> Shard(d) (a local slice per tensor, no
  communication; cloned, so the replicas can be freed); Nereus: the compiled transition
  (local copies, nothing sent). Both report the memory their results keep alive
  (`*_held_bytes`, all GPUs: every storage a result views, counted whole), which shows
  that both return standalone shards.

(TP <-> PP or a placement change onto other GPUs is not a DTensor redistribution: a
DTensor lives on one mesh.) The DTensor side splits each column tensor evenly on dim 0;
Nereus splits fused q/k/v and gate/up part-wise (each GPU holds its heads of q, k and v),
which is what a TP forward needs; the bytes each GPU must receive are the same.

Timing, identical for both: every call barrier to barrier with the devices synchronized,
the slowest rank (`Env.timed`); one warm-up; the median of `--repeats` calls. Cold:
DTensor's warm-up of each direction, timed (`dtensor_cold_s`: its first redistribution of
these tensors in the process, after Nereus's calls); Nereus's first
call after `prepare()` in a process that has not moved a byte yet ("prepared", TP -> DP)
and the first call of a Runtime without `prepare` ("cold", DP -> TP).
bound_s = the bytes each GPU receives (the busiest) / P2P bandwidth measured in this run.
Both results are checked byte for byte on every rank. Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from mg_common import SHAPES, Env, add_common_args, box_values, build_local, check_local, cluster_source, \
    free_memory, incoming_bytes, machine, link_bandwidth, model_source, plan_source, salt_of, same_bytes, \
    specs_bytes

TAG = "actor.generation"


def module_source(world: int, mem: int, shape: dict, layers: int) -> str:
    text = cluster_source(world, mem) + model_source(shape, layers)
    text += "workload rl {\n  batch 8  prompt 16  response 16  microbatch 1\n  generation: actor\n}\n"
    gpus = list(range(world))
    return text + plan_source("TP", {TAG: (1, world, 1, gpus)}) + plan_source("DP", {TAG: (world, 1, 1, gpus)})


def weight_specs(module) -> dict:
    """{name: (shape, dtype, split dim or None)}: dim 0 for column/vocab, 1 for row."""
    from nereus.models import tensor_table
    from nereus.models.tensors import COLUMN, ROW, VOCAB
    from nereus.runtime.executor import TORCH_DTYPES

    dims = {COLUMN: 0, VOCAB: 0, ROW: 1}
    return {f"actor/{s.name}": (s.shape, TORCH_DTYPES[s.dtype], dims.get(s.sharding))
            for s in tensor_table(module.model("actor"))}


def dtensor_locals(env: Env, specs: dict, seed: int, replicated: bool) -> dict:
    """DTensors of every weight: Shard(d) (this rank's even chunk of dim d) or Replicate()."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = env.mesh
    out = {}
    for name, (shape, dtype, dim) in specs.items():
        box = [(0, n) for n in shape]
        placement = Replicate()
        if dim is not None and not replicated:
            step = shape[dim] // env.world
            box[dim] = (env.rank * step, (env.rank + 1) * step)
            placement = Shard(dim)
        local = box_values(salt_of(seed, TAG, name), box, shape, dtype, env.device)
        out[name] = DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(shape),
                                       stride=torch.empty(shape, device="meta").stride())
    return out


def dtensor_check(env: Env, dts: dict, specs: dict, seed: int) -> bool:
    """Every DTensor's local tensor equals the reference slice of its placement."""
    bad = 0
    for name, dt in dts.items():
        shape, dtype, _ = specs[name]
        box = [(0, n) for n in shape]
        placement = dt.placements[0]
        if placement.is_shard():
            d = placement.dim
            step = shape[d] // env.world
            box[d] = (env.rank * step, (env.rank + 1) * step)
        bad += not same_bytes(dt.to_local().contiguous(), box_values(salt_of(seed, TAG, name), box, shape, dtype,
                                                                    env.device))
    return env.all_true(bad == 0)


def held_bytes(tensors: list) -> int:
    """Bytes of memory these tensors keep alive: each storage once, whole (a view holds all
    of the tensor it views)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run(env: Env, args, shape: dict, bw: dict) -> dict:
    import nereus.ir as ir
    from nereus.backends.json_program import plan_units_json
    from nereus.runtime import Runtime
    from mg_profile import profile_call
    from torch.distributed.tensor import Replicate, Shard

    module = ir.parse_source(module_source(env.world, env.gpu_mem_bytes(), shape, args.layers), "dtensor.nir")
    specs = weight_specs(module)
    plain = {n: (s, d) for n, (s, d, _) in specs.items()}
    tp = plan_units_json(module, "TP", TAG)
    dp = plan_units_json(module, "DP", TAG)

    def nereus_ok(rt, units) -> bool:
        return env.all_true(not check_local(rt.state(TAG), units, env.rank, plain, args.seed, TAG, env.device))

    # -- Nereus: prepared first call (this process has moved nothing yet), then warm
    rt = Runtime(module, "TP", device=env.device, timeout_s=args.timeout_s)
    rt.register(TAG, build_local(tp, env.rank, plain, args.seed, TAG, env.device))
    prep = rt.prepare("DP")
    if args.profile_prepared and args.profile_dir:  # the prepared call itself, under the profiler
        profile_call(env, lambda: rt.transition("DP"), os.path.join(args.profile_dir, "profile_prepared.txt"),
                     "nereus TP -> DP, first call after prepare", rt=rt, source="TP", target="DP")
        rt.transition("TP")
    report, prepared_s = env.timed(lambda: rt.transition("DP"))
    ok = nereus_ok(rt, dp)
    cold, cold_s = env.timed(lambda: rt.transition("TP"))  # DP -> TP not prepared: its cold call
    ok = nereus_ok(rt, tp) and ok
    cases = {}
    for case, (src, dst, dst_units) in {"tp-dp": ("TP", "DP", dp), "dp-tp": ("DP", "TP", tp)}.items():
        times, execs = [], []
        rt.transition(dst)  # warm-up
        rt.transition(src)
        for _ in range(args.repeats):
            rep, seconds = env.timed(lambda: rt.transition(dst))
            times.append(seconds)
            execs.append(rep.max_seconds)
            if len(times) == args.repeats:
                ok = nereus_ok(rt, dst_units) and ok
            rt.transition(src)
        if case == "dp-tp":  # what the TP shards hold once the replicas are gone (rt is back in DP now)
            rt.transition("TP")
            cases_held = env.total(held_bytes(list(rt.state(TAG).values())))
            rt.transition("DP")
        src_units, dst_units_ = (tp, dp) if case == "tp-dp" else (dp, tp)
        incoming = incoming_bytes(src_units, dst_units_, plain)
        busiest = max(incoming.values(), default=0)
        cases[case] = {"nereus_s": statistics.median(times), "nereus_times_s": times,
                       "nereus_exec_s": statistics.median(execs), "bytes_moved": int(env.total(rep.bytes_sent)),
                       "bytes_busiest_gpu_in": busiest,
                       "bound_s": busiest / (bw["p2p_GBps"] * 1e9) if bw.get("p2p_GBps") and busiest else None}
        if case == "dp-tp":
            cases[case]["nereus_held_bytes"] = cases_held
    if args.profile_dir:
        rt.transition("TP")  # the loop above ends in DP
        profile_call(env, lambda: rt.transition("DP"), os.path.join(args.profile_dir, "profile_dtensor.txt"),
                     "nereus TP -> DP", rt=rt, source="TP", target="DP")
        profile_call(env, lambda: rt.transition("TP"), os.path.join(args.profile_dir, "profile_dtensor_dp_tp.txt"),
                     "nereus DP -> TP", rt=rt, source="DP", target="TP")
        rt.transition("DP")
    out = {"nereus_prepared_s": prepared_s, "nereus_prepare_s": env.slowest(prep["seconds"]),
           "prepared_kernels": prep["kernels"], "nereus_cold_s": cold_s, "nereus_cold_compile_s": cold.compile_s,
           "verified_nereus": ok, "rollback": report.rollback}
    del rt
    free_memory(env)

    # -- DTensor, the same tensors and timing
    from torch.distributed.device_mesh import init_device_mesh

    env.mesh = init_device_mesh(env.device.type, (env.world,))
    sharded = dtensor_locals(env, specs, args.seed, replicated=False)
    replicated, gather_s, gather_times, gather_cold = env.timed_median(
        lambda: {n: dt.redistribute(env.mesh, [Replicate()]) for n, dt in sharded.items()}, args.repeats)
    ok_gather = dtensor_check(env, replicated, specs, args.seed)
    del sharded
    targets = {n: [Shard(d)] if d is not None else [Replicate()] for n, (_, _, d) in specs.items()}
    resharded, slice_s, slice_times, slice_cold = env.timed_median(
        lambda: {n: dt.redistribute(env.mesh, targets[n]) for n, dt in replicated.items()}, args.repeats)
    ok_slice = dtensor_check(env, resharded, specs, args.seed)
    dtensor_held = held_bytes([dt.to_local() for dt in resharded.values()])
    del replicated, resharded
    free_memory(env)
    cases["tp-dp"].update(dtensor="Shard(d) -> Replicate()", dtensor_s=gather_s, dtensor_times_s=gather_times,
                          dtensor_cold_s=gather_cold, verified_dtensor=ok_gather)
    cases["dp-tp"].update(dtensor="Replicate() -> Shard(d)", dtensor_s=slice_s, dtensor_times_s=slice_times,
                          dtensor_cold_s=slice_cold, verified_dtensor=ok_slice,
                          dtensor_held_bytes=env.total(dtensor_held))
    for name, c in cases.items():
        c["dtensor_over_nereus"] = c["dtensor_s"] / c["nereus_s"] if c["nereus_s"] else None
        if c["bound_s"]:
            c["nereus_over_bound"] = c["nereus_s"] / c["bound_s"]
            c["dtensor_over_bound"] = c["dtensor_s"] / c["bound_s"]
        if "dtensor_held_bytes" in c:
            env.log(f"{name}: memory the results keep alive, all GPUs: nereus {c['nereus_held_bytes'] / 1e9:.2f} GB, "
                    f"dtensor {c['dtensor_held_bytes'] / 1e9:.2f} GB")
        env.log(f"{name}: nereus {c['nereus_s'] * 1e3:.1f} ms (exec {c['nereus_exec_s'] * 1e3:.1f}), dtensor "
                f"{c['dtensor_s'] * 1e3:.1f} ms (cold {c['dtensor_cold_s'] * 1e3:.1f}), bound {(c['bound_s'] or 0) * 1e3:.1f} ms, "
                f"{c['bytes_moved'] / 1e9:.2f} GB moved")
    env.log(f"nereus prepared first call {prepared_s * 1e3:.1f} ms (prepare {out['nereus_prepare_s']:.2f} s), "
            f"cold DP -> TP {cold_s * 1e3:.1f} ms")
    out.update(cases=cases, weight_bytes=specs_bytes(plain),
               verified=bool(ok and ok_gather and ok_slice))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--layers", type=int, default=None, help="default 8 (8B shapes); tiny model on CPU: 4")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per method (default 7, quick 3)")
    parser.add_argument("--bandwidth-mib", type=int, default=None, help="default 1024 on GPU, 4 on CPU")
    parser.add_argument("--profile-dir", default=None, help="profile one warm Nereus TP -> DP and DP -> TP here")
    parser.add_argument("--profile-prepared", action="store_true",
                        help="with --profile-dir: profile the first call after prepare instead (its "
                             "figure is then no longer a first call)")
    args = parser.parse_args(argv)
    env = Env(args)
    shape = SHAPES["8b"] if env.cuda else SHAPES["tiny"]
    args.layers = args.layers or min(8, shape["layers"])
    args.repeats = args.repeats or (3 if args.quick else 7)
    bw = link_bandwidth(env, args.bandwidth_mib)
    result = run(env, args, shape, bw)
    env.finish({"name": "multi_gpu_dtensor", "gpus": env.world, "backend": env.backend, "device": env.device.type,
                "quick": args.quick, "shape": dict(shape, layers=args.layers), "bandwidth": bw, **result,
                "machine": machine()}, args.json_out)
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    sys.exit(main())
