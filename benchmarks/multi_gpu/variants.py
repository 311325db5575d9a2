"""Issue 20's two missed figures under executor variants, interleaved in one process.

    torchrun --nproc-per-node 2 benchmarks/multi_gpu/variants.py [--repeats 9] [--json-out F]
    torchrun --nproc-per-node 2 benchmarks/multi_gpu/variants.py --backend gloo --device cpu --quick

Workloads (8B shapes on CUDA, tiny on CPU): the DTensor comparison's TP n -> DP n of the bf16
generation weights (`--dt-layers`, default 8), beside DTensor `redistribute(Shard -> Replicate)`
of the same tensors; and the weight sync training (tp n/2 pp 2) -> generation (tp g, dp n/g)
for g in {1, 2} (`--ws-layers`, default 32). Variants (module switches, set alike on every
rank, see VARIANTS): `default`; `packed` (every streamed piece through a ring slot, the
previous default); `alone-4m` / `alone-64m` (streams.ALONE_BYTES: the size from which a piece
travels in chunks of its own, in place where contiguous); `copies-after` (rounds.COPIES_AFTER:
the same-GPU copies run after the exchange, not beside it); `no-defer` / `defer`
(rounds.DEFER_DESTINATIONS off, the default since session 8: every destination allocated
before the agreement; on: allocated when first written); `gc-on`
(gc_pause.PAUSE_GC off: Python's cyclic GC left on during transitions); `chunk-256m` / `chunk-512m`
(streams.CHUNK_BYTES; the default is 128 MiB) and `chunk-256m-depth4` (with streams.DEPTH 4).
Each repeat runs every variant once in turn (and DTensor once), so drift hits all alike;
every call is timed barrier to barrier with the devices synchronized (`Env.timed`), medians
reported. Each variant's result is checked byte for byte once. The first timed call of each
variant also keeps its per-round host/device split (posted_at_s, device_s). Last stdout
line: one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import sys


from mg_common import SHAPES, Env, add_common_args, bounds, build_local, check_local, free_memory, \
    incoming_bytes, link_bandwidth, machine

# module switches per variant, set alike on every rank ({(module, attribute): value}); every
# switch not named keeps the value the module had at import (the defaults a user gets)
VARIANTS = {
    "default": {},
    # the previous default: every streamed piece packed into a ring slot and unpacked
    "packed": {("streams", "IN_PLACE"): False, ("streams", "ALONE_BYTES"): 0},
    "alone-4m": {("streams", "ALONE_BYTES"): 4 << 20},
    "alone-64m": {("streams", "ALONE_BYTES"): 64 << 20},
    "copies-after": {("rounds", "COPIES_AFTER"): True},
    # every destination allocated before the round's agreement (the default again since
    # session 8); `defer`: those only copies and slot chunks write allocated when first written
    "no-defer": {("rounds", "DEFER_DESTINATIONS"): False},
    "defer": {("rounds", "DEFER_DESTINATIONS"): True},
    # the cyclic garbage collector left on during transitions (NEREUS_PAUSE_GC=0)
    "gc-on": {("gc_pause", "PAUSE_GC"): False},
    # the stream's chunk size (fewer, larger batches) and ring depth
    "chunk-256m": {("streams", "CHUNK_BYTES"): 256 << 20},
    "chunk-512m": {("streams", "CHUNK_BYTES"): 512 << 20},
    "chunk-256m-depth4": {("streams", "CHUNK_BYTES"): 256 << 20, ("streams", "DEPTH"): 4},
}
_DEFAULTS: dict = {}


def set_variant(name: str) -> None:
    from nereus.runtime import gc_pause, rounds, streams

    modules = {"gc_pause": gc_pause, "rounds": rounds, "streams": streams}
    for key in {k for v in VARIANTS.values() for k in v}:
        _DEFAULTS.setdefault(key, getattr(modules[key[0]], key[1]))
        setattr(modules[key[0]], key[1], VARIANTS[name].get(key, _DEFAULTS[key]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--dt-layers", type=int, default=None)
    parser.add_argument("--ws-layers", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None, help="default 9, quick 3")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args(argv)
    env = Env(args)
    import nereus.ir as ir
    from nereus.backends.json_program import plan_units_json
    from nereus.runtime import Runtime
    from nereus.runtime.vllm_sync import WeightSync
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    import dtensor_compare as dc
    import weight_sync as ws

    shape = SHAPES["8b"] if env.cuda else SHAPES["tiny"]
    dt_layers = args.dt_layers or (8 if env.cuda else 4)
    ws_layers = args.ws_layers or (32 if env.cuda else 4)
    repeats = args.repeats or (3 if args.quick else 9)
    names = args.variants.split(",")
    bw = link_bandwidth(env, None)
    mem = env.gpu_mem_bytes()

    # the DTensor case: Nereus TP -> DP and DTensor Shard -> Replicate on the same tensors
    module = ir.parse_source(dc.module_source(env.world, mem, shape, dt_layers), "dt.nir")
    specs = dc.weight_specs(module)
    plain = {n: (s, d) for n, (s, d, _) in specs.items()}
    tp, dp = plan_units_json(module, "TP", dc.TAG), plan_units_json(module, "DP", dc.TAG)
    rt = Runtime(module, "TP", device=env.device, timeout_s=args.timeout_s)
    rt.register(dc.TAG, build_local(tp, env.rank, plain, args.seed, dc.TAG, env.device))
    env.mesh = init_device_mesh(env.device.type, (env.world,))
    sharded = dc.dtensor_locals(env, specs, args.seed, replicated=False)
    dt_bound = max(incoming_bytes(tp, dp, plain).values()) / (bw["p2p_GBps"] * 1e9)

    # the weight syncs, g = 1 and 2
    syncs = {}
    for g in (1, 2):
        wmod = ir.parse_source(ws.module_source(env.world, mem, shape, ws_layers, g), f"ws{g}.nir")
        wspecs = ws.weight_specs(wmod)
        train, gen = plan_units_json(wmod, "P", "actor.training"), plan_units_json(wmod, "P", "actor.generation")
        local = build_local(train, env.rank, wspecs, args.seed, ws.TAG, env.device, names=lambda n: n in wspecs)
        sync = WeightSync(wmod, device=env.device, control=env.ctrl)
        syncs[f"ws-tp{g}dp{env.world // g}"] = (sync, local, gen, wspecs, bounds(incoming_bytes(train, gen, wspecs), bw))

    def tp_dp():
        return rt.transition("DP")

    def check_all() -> dict:
        ok = {"tp-dp": env.all_true(not check_local(rt.state(dc.TAG), dp, env.rank, plain, args.seed, dc.TAG,
                                                     env.device))}
        rt.transition("TP")
        for key, (sync, local, gen, wspecs, _) in syncs.items():
            got = sync.run("P", local).weights
            ok[key] = env.all_true(not check_local(got, gen, env.rank, wspecs, args.seed, ws.TAG, env.device))
            del got
        return ok

    verified, splits = {}, {}
    for name in names:  # warm-up and check of each variant
        set_variant(name)
        tp_dp(), rt.transition("TP")
        tp_dp()
        verified[name] = check_all()
    {n: dt.redistribute(env.mesh, [Replicate()]) for n, dt in sharded.items()}  # DTensor warm-up
    times: dict = {name: {"tp-dp": [], **{k: [] for k in syncs}} for name in names}
    times["dtensor"] = {"tp-dp": []}
    for rep in range(repeats):
        for name in names:
            set_variant(name)
            report, seconds = env.timed(tp_dp)
            times[name]["tp-dp"].append(seconds)
            rt.transition("TP")
            split = {"tp-dp": {"wall_s": seconds, "seconds": report.seconds, "rounds": report.rounds}}
            for key, (sync, local, *_rest) in syncs.items():
                result, seconds = env.timed(lambda: sync.run("P", local))
                times[name][key].append(seconds)
                split[key] = {"wall_s": seconds, "seconds": result.seconds, "rounds": result.extra.get("round_timings")}
                del result
            if rep == 0:
                splits[name] = split
        out, seconds = env.timed(lambda: {n: dt.redistribute(env.mesh, [Replicate()]) for n, dt in sharded.items()})
        times["dtensor"]["tp-dp"].append(seconds)
        del out
    set_variant("default")
    bound = {"tp-dp": dt_bound, **{k: v[4]["bound_parallel_s"] for k, v in syncs.items()}}
    medians = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in times.items()}
    for name, row in medians.items():
        env.log(f"{name:13s} " + ", ".join(f"{k} {v * 1e3:.1f} ms ({v / bound[k]:.2f}x)" for k, v in row.items()))
    env.log("bounds: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in bound.items()) + f"; verified {verified}")
    del rt, sharded
    free_memory(env)
    ok = all(all(v.values()) for v in verified.values())
    env.finish({"name": "multi_gpu_variants", "gpus": env.world, "backend": env.backend, "repeats": repeats,
                "dt_layers": dt_layers, "ws_layers": ws_layers, "bandwidth": bw, "bounds_s": bound,
                "medians_s": medians, "times_s": times, "over_bound": {n: {k: v / bound[k] for k, v in row.items()}
                                                                      for n, row in medians.items()},
                "splits_first_call": splits, "verified": verified, "machine": machine()}, args.json_out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
