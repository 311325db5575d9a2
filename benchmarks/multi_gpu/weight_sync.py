"""Per-step weight sync of an 8B actor, training layout -> generation layout, over NCCL.

    torchrun --nproc-per-node 8 benchmarks/multi_gpu/weight_sync.py
    torchrun --nproc-per-node 4 benchmarks/multi_gpu/weight_sync.py --backend gloo --device cpu --quick

Every RL step the trained bf16 weights of the actor must reach the generation stage in
its own layout. Training and generation are colocated on all n GPUs: training runs
dp 1, tp n/2, pp 2; generation runs tp g, dp n/g for g in {2, n/2} (n = 2: g in {1, 2}).
Weights only (the optimizer state stays with training).

Every method is timed the same way: a call barrier to barrier with the devices
synchronized (the slowest rank), first the cold call (the method's first of the case:
Nereus's is a fresh WeightSync's, its compile and lowering included; a baseline's first
call of the first case is also the process's first of it, after the bandwidth probe and
Nereus's calls, but in later cases the process is warm), then the median of `--repeats`
warm calls.

- nereus: `nereus.runtime.vllm_sync.WeightSync` (the sync compiled as a transition of
  the weights and run by the same executor); nereus_s = the warm median, nereus_cold_s =
  the first call (its compile and lowering included; nereus_compile_s says how much was
  compile), nereus_exec_s = the median of the slowest rank's executor time alone,
  nereus_prepared_s = the first run of another fresh WeightSync after its `prepare`
  (untimed: nereus_prepare_s) in this warm process.
  (Before 2026-12-02, nereus_s was the executor's time and nereus_wall_s the call's.)
- gather_push: OpenRLHF-style, each tensor gathered whole on rank 0 then broadcast to
  every generation rank, which slices its shard.
- bucketed: as verl / NeMo-RL write it, the tensors in name order are packed into flat
  buckets of `--bucket-mib` (default 1024): each bucket's training shards are gathered
  into one flat buffer on rank 0 (one batch of p2p ops per bucket), the bucket is
  broadcast to every rank in one collective, and each rank copies its generation shards
  out of it.
- bound_s = bytes that change owner / measured P2P bandwidth; bound_parallel_s = the
  busiest GPU's incoming bytes / per-GPU ring rate (see mg_common.bounds).
Both results are checked byte for byte against the reference slices on every rank.
Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

from mg_common import SHAPES, Env, add_common_args, bounds, build_local, check_local, cluster_source, \
    free_memory, incoming_bytes, machine, link_bandwidth, model_source, my_shards, plan_source, specs_bytes

TAG = "actor.training"  # generation shards carry the training weights' values


def gen_tps(world: int) -> list:
    return sorted({min(2, world), max(1, world // 2)})


def module_source(world: int, mem: int, shape: dict, layers: int, g: int) -> str:
    train = (1, max(1, world // 2), 2 if world >= 2 else 1, list(range(world)))
    gen = (world // g, g, 1, list(range(world)))
    text = cluster_source(world, mem) + model_source(shape, layers)
    text += "workload rl {\n  batch 8  prompt 16  response 16  microbatch 1\n  generation: actor\n  training: actor\n}\n"
    return text + plan_source("P", {"actor.generation": gen, "actor.training": train})


def weight_specs(module) -> dict:
    from nereus.models import tensor_table
    from nereus.runtime.executor import TORCH_DTYPES

    return {f"actor/{s.name}": (s.shape, TORCH_DTYPES[s.dtype]) for s in tensor_table(module.model("actor"))}


def gather_push(env: Env, train_units: list, gen_units: list, local: dict, specs: dict) -> dict:
    """Collective. Each tensor gathered whole on rank 0 (p2p from its first holders),
    broadcast from rank 0 to every rank, sliced into this rank's generation shard."""
    from nereus.runtime.state import gather_to_root, shard_of, writers

    write = writers(train_units)
    mine_train, mine_gen = my_shards(train_units, env.rank), my_shards(gen_units, env.rank)
    out = {}
    for name in sorted(specs):
        shape, dtype = specs[name]
        full = torch.empty(shape, dtype=dtype, device=env.device)
        gather_to_root(full if env.rank == 0 else None, write[name], local.get(name), mine_train.get(name, []),
                       env.rank)
        dist.broadcast(full, src=0)
        if name in mine_gen:
            out[name] = shard_of(full, mine_gen[name])
        del full
    return out


def buckets(specs: dict, bucket_bytes: int) -> list:
    """[[name]]: the tensors in name order, grouped into buckets of at most `bucket_bytes`
    (a tensor larger than a bucket fills one alone)."""
    out, current, used = [], [], 0
    for name in sorted(specs):
        shape, dtype = specs[name]
        nbytes = _numel(shape) * dtype.itemsize
        if current and used + nbytes > bucket_bytes:
            out.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    return out + ([current] if current else [])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def bucketed_gather_broadcast(env: Env, train_units: list, gen_units: list, local: dict, specs: dict,
                              bucket_bytes: int) -> dict:
    """Collective. Per bucket: gather every box of its tensors into one flat buffer on
    rank 0 (one batch of p2p ops), broadcast the buffer from rank 0, copy this rank's
    generation shards out of it."""
    from nereus.runtime.state import box_piece, box_view, shard_of, writers

    write = writers(train_units)
    mine_train, mine_gen = my_shards(train_units, env.rank), my_shards(gen_units, env.rank)
    out = {}
    for names in buckets(specs, bucket_bytes):
        sizes = [_numel(specs[n][0]) * specs[n][1].itemsize for n in names]
        starts = [sum((n + 15) // 16 * 16 for n in sizes[:i]) for i in range(len(sizes))]  # 16-byte aligned
        flat = torch.empty(starts[-1] + sizes[-1], dtype=torch.uint8, device=env.device)
        full = {}
        for name, size, at in zip(names, sizes, starts):
            shape, dtype = specs[name]
            full[name] = flat[at:at + size].view(dtype).view(shape)
        ops, pending = [], []
        for name in names:
            for holder, index, box in write[name]:
                if holder == env.rank:
                    part = box_piece(local[name], mine_train[name], index)
                    if env.rank == 0:
                        box_view(full[name], box).copy_(part)
                    else:
                        ops.append(dist.P2POp(dist.isend, part.contiguous(), 0))
                elif env.rank == 0:
                    target = box_view(full[name], box)
                    buf = target if target.is_contiguous() else torch.empty_like(target)
                    ops.append(dist.P2POp(dist.irecv, buf, holder))
                    if buf is not target:
                        pending.append((target, buf))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for target, buf in pending:
            target.copy_(buf)
        dist.broadcast(flat, src=0)
        for name in names:
            if name in mine_gen:
                out[name] = shard_of(full[name], mine_gen[name])
        del full, flat
    return out


def run_case(env: Env, g: int, args, shape: dict, bw: dict) -> dict:
    import nereus.ir as ir
    from nereus.backends.json_program import plan_units_json
    from nereus.runtime.vllm_sync import WeightSync

    module = ir.parse_source(module_source(env.world, env.gpu_mem_bytes(), shape, args.layers, g), "sync.nir")
    specs = weight_specs(module)
    train = plan_units_json(module, "P", "actor.training")
    gen = plan_units_json(module, "P", "actor.generation")
    case = f"train-tp{max(1, env.world // 2)}pp2-gen-tp{g}dp{env.world // g}"
    local = build_local(train, env.rank, specs, args.seed, TAG, env.device, names=lambda n: n in specs)
    sync = WeightSync(module, device=env.device, control=env.ctrl)

    def check(weights) -> bool:
        return env.all_true(not check_local(weights, gen, env.rank, specs, args.seed, TAG, env.device))

    first, cold = env.timed(lambda: sync.run("P", local))  # compiles and lowers the sync first
    compile_s = env.slowest(first.compile_s)
    ok = check(first.weights)
    del first
    walls, execs, result = [], [], None
    for _ in range(args.repeats):
        result, wall = env.timed(lambda: sync.run("P", local))
        walls.append(wall)
        execs.append(env.slowest(result.seconds))
    ok = check(result.weights) and ok
    fresh = WeightSync(module, device=env.device, control=env.ctrl)
    prep = fresh.prepare("P")
    done, prepared_s = env.timed(lambda: fresh.run("P", local))
    ok = check(done.weights) and ok
    del done, fresh
    if args.profile_dir:
        from mg_profile import profile_call

        profile_call(env, lambda: sync.run("P", local), os.path.join(args.profile_dir, "profile_weight_sync.txt"),
                     f"weight sync {case}", progs=list(sync._rank_programs.values()))
    sent = int(env.total(result.bytes_sent))
    rounds = result.rounds
    del result
    free_memory(env)
    # the cold call: communicators, allocator
    gp, gp_s, gp_times, gp_cold = env.timed_median(lambda: gather_push(env, train, gen, local, specs), args.repeats)
    ok_gp = check(gp)
    del gp
    free_memory(env)
    bucket_bytes = args.bucket_mib << 20
    bk, bk_s, bk_times, bk_cold = env.timed_median(
        lambda: bucketed_gather_broadcast(env, train, gen, local, specs, bucket_bytes), args.repeats)
    ok_bk = check(bk)
    del bk
    free_memory(env)
    out = {"case": case, "gen_tp": g, "layers": args.layers, "weight_bytes": specs_bytes(specs),
           "nereus_s": statistics.median(walls), "nereus_times_s": walls, "nereus_cold_s": cold,
           "nereus_exec_s": statistics.median(execs), "nereus_exec_times_s": execs, "nereus_compile_s": compile_s,
           "nereus_prepared_s": prepared_s, "nereus_prepare_s": env.slowest(prep["seconds"]),
           "rounds": rounds, "bytes_moved": sent,
           **bounds(incoming_bytes(train, gen, specs), bw),
           "gather_push_s": gp_s, "gather_push_times_s": gp_times, "gather_push_cold_s": gp_cold,
           "bucketed_s": bk_s, "bucketed_times_s": bk_times, "bucketed_cold_s": bk_cold,
           "bucket_bytes": bucket_bytes,
           "verified_nereus": ok, "verified_gather_push": ok_gp, "verified_bucketed": ok_bk}
    out["gather_push_over_nereus"] = out["gather_push_s"] / out["nereus_s"] if out["nereus_s"] else None
    out["bucketed_over_nereus"] = out["bucketed_s"] / out["nereus_s"] if out["nereus_s"] else None
    out["bytes_moved_at_lower_bound"] = out["bytes_moved"] == out["bytes_owner_change"]
    if out["bound_s"]:
        out["nereus_over_bound"] = out["nereus_s"] / out["bound_s"]
    if out["bound_parallel_s"]:
        out["nereus_over_bound_parallel"] = out["nereus_s"] / out["bound_parallel_s"]
    out["verified"] = ok and ok_gp and ok_bk
    env.log(f"{case}: warm (cold, prepared) nereus {_ms(out['nereus_s'])} ({_ms(cold)}, {_ms(prepared_s)}; "
            f"exec {_ms(out['nereus_exec_s'])}), "
            f"gather-push {_ms(out['gather_push_s'])} ({_ms(gp_cold)}), bucketed {_ms(out['bucketed_s'])} "
            f"({_ms(bk_cold)}), bound {_ms(out['bound_s'])} / parallel {_ms(out['bound_parallel_s'])}, "
            f"{sent / 1e9:.2f} GB moved, verified {out['verified']}")
    return out


def _ms(seconds) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--layers", type=int, default=None, help="default 32 (8B); tiny model on CPU: 4")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per method (default 5, quick 3)")
    parser.add_argument("--bucket-mib", type=int, default=1024, help="bucket of the bucketed baseline (MiB)")
    parser.add_argument("--bandwidth-mib", type=int, default=None, help="default 1024 on GPU, 4 on CPU")
    parser.add_argument("--profile-dir", default=None, help="profile one warm Nereus sync per case here")
    args = parser.parse_args(argv)
    env = Env(args)
    if env.world < 2 or env.world % 2:
        raise SystemExit("weight_sync.py needs an even number of ranks >= 2")
    shape = SHAPES["8b"] if env.cuda else SHAPES["tiny"]
    args.layers = args.layers or shape["layers"]
    args.repeats = args.repeats or (3 if args.quick else 5)
    bw = link_bandwidth(env, args.bandwidth_mib)
    cases = [run_case(env, g, args, shape, bw) for g in gen_tps(env.world)]
    verified = all(c["verified"] for c in cases)
    env.finish({"name": "multi_gpu_weight_sync", "gpus": env.world, "backend": env.backend,
                "device": env.device.type, "quick": args.quick, "shape": dict(shape, layers=args.layers),
                "bandwidth": bw, "verified": verified, "cases": cases, "machine": machine()}, args.json_out)
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
