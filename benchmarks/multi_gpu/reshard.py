"""Resharding on real sizes over NCCL: Nereus against DCP, gather-then-scatter and the bound.

    torchrun --nproc-per-node 8 benchmarks/multi_gpu/reshard.py                 # 8 H200s
    torchrun --nproc-per-node 4 benchmarks/multi_gpu/reshard.py --backend gloo --device cpu --quick

Llama-3.1-8B actor.training and critic.training, colocated, with Adam state (bf16
weights + fp32 master, exp_avg, exp_avg_sq + step), on a world of n GPUs (h = n/2),
starting from plan A = dp 1 tp h on GPUs 0..h-1:

- gpus{h}-gpus{n}: GPU-count doubling, B = dp 2 tp h on 0..n-1 (Extend: the paper's
  Table 4 case for n = 8, 4 -> 8 GPUs, 2.45 s there);
- tp{h}-tp{n}: TP doubling onto n GPUs, B = dp 1 tp n;
- pp1-pp2: PP change onto n GPUs, B = dp 1 tp h pp 2;
- mixed: the actor doubles TP (dp 1 tp n) while the critic goes to PP 2 (dp 1 tp h pp 2).

When a case's peak (old state + new shards on one GPU) would not fit in 88% of GPU
memory less 8 GB of headroom, the critic is dropped, then layers are halved; each case
reports the models and layers it ran with (at n = 8 every case runs the full 8B pair).

Per case, all measured in the same process group; every time is barrier to barrier with
the devices synchronized (`Env.timed`), the slowest rank:
- nereus_cold_s: the first `transition` of a fresh Runtime (compile and lowering
  included; `process_cold` marks the first case, which also pays the process's first
  pack kernels; runtime_init_s: constructing its Runtime, which creates and connects
  the data communicators); nereus_s: median of `--repeats` warm A -> B calls (the
  way back in between, nereus_reverse_s) with the default rollback; `modes`: the same for
  each of `--modes`; nereus_prepared_s: a fresh Runtime on the same tensors, `prepare("B")`
  untimed (nereus_prepare_s), then the timed call; nereus_exec_s: the executor's own
  figure (TransitionReport.max_seconds: until the slowest rank was ready to commit, its
  device synchronized; the commit's one small collective follows).
- gather_scatter_s: every tensor gathered whole on rank 0 and scattered in layout B
  (one warm-up, timed as gather_scatter_cold_s, then the median of as many runs as Nereus).
- dcp: torch.distributed.checkpoint save in layout A + load in layout B on local disk
  (`--ckpt-dir`), for the tensors of the first `--dcp-layers` layers only (the whole
  state would not fit on the disk); dcp_s is that subset (one run), dcp_s_extrapolated
  scales it by bytes to the whole state (an estimate, marked as such).
- bound_link_s = the busiest rank's max(bytes sent, bytes received) / measured P2P
  bandwidth (one 1 GiB send GPU 0 -> 1 in this run); bound_s = bytes that change owner /
  the same bandwidth; bound_parallel_s = busiest GPU's incoming bytes / per-GPU ring rate.
Every result (Nereus, gather-scatter, DCP) is checked byte for byte against the
reference slices on every rank. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

from mg_baselines import dcp_save_load, gather_scatter
from mg_common import PAPER_4_TO_8_S, SHAPES, Env, add_common_args, bounds, build_local, check_local, \
    cluster_source, free_memory, incoming_bytes, layout_bytes, machine, link_bandwidth, selected_cases, model_source, \
    plan_source, specs_bytes

STEP = 7


def case_plans(case: str, world: int) -> tuple:
    """(A, B) as {model: (dp, tp, pp, gpus)}; "mixed" changes each model differently
    (actor: TP doubling; critic: PP 1 -> 2), the others change both models alike."""
    h = world // 2
    a = (1, h, 1, list(range(h)))
    if case == "mixed":
        return {"actor": a, "critic": a}, {"actor": (1, world, 1, list(range(world))),
                                           "critic": (1, h, 2, list(range(world)))}
    b = {f"gpus{h}-gpus{world}": (2, h, 1, list(range(world))),
         f"tp{h}-tp{world}": (1, world, 1, list(range(world))),
         "pp1-pp2": (1, h, 2, list(range(world)))}[case]
    return {"actor": a, "critic": a}, {"actor": b, "critic": b}


def case_names(world: int) -> list:
    h = world // 2
    return [f"gpus{h}-gpus{world}", f"tp{h}-tp{world}", "pp1-pp2", "mixed"]


def module_source(world: int, mem: int, shape: dict, layers: int, models: tuple, a: dict, b: dict) -> str:
    stages = ", ".join(models)
    text = cluster_source(world, mem) + model_source(shape, layers)
    text += f"workload ppo {{\n  batch 8  prompt 16  response 16  microbatch 1\n  training: {stages}\n}}\n"
    text += plan_source("A", {f"{m}.training": a[m] for m in models})
    text += plan_source("B", {f"{m}.training": b[m] for m in models})
    return text


def full_specs(module, model_stage: str) -> dict:
    """{name: (shape, torch dtype)} as Runtime.tensor_specs gives them, without the step."""
    from nereus.models import OPTIMIZER_DTYPE, OPTIMIZER_STATES, optimizer_name, tensor_table
    from nereus.runtime.executor import TORCH_DTYPES

    model = module.model(model_stage.split(".")[0])
    specs = {}
    for spec in tensor_table(model):
        name = f"{model.name}/{spec.name}"
        specs[name] = (spec.shape, TORCH_DTYPES[spec.dtype])
        for s in OPTIMIZER_STATES:
            specs[optimizer_name(name, s)] = (spec.shape, TORCH_DTYPES[OPTIMIZER_DTYPE])
    return specs


def peak_bytes(module, stages: list) -> int:
    """Largest per-GPU bytes while both layouts live: old shards + new shards that are
    not kept in place (a new shard with exactly the old boxes aliases the old tensor)."""
    from nereus.backends.json_program import plan_units_json

    peak: dict = {}
    for ms in stages:
        specs = full_specs(module, ms)
        before, after = plan_units_json(module, "A", ms), plan_units_json(module, "B", ms)
        old = {(s["gpu"], s["tensor"]): s["boxes"] for u in before for s in u["shards"]}
        for g, n in layout_bytes(before, specs).items():
            peak[g] = peak.get(g, 0) + n
        moved = [dict(u, shards=[s for s in u["shards"] if old.get((s["gpu"], s["tensor"])) != s["boxes"]])
                 for u in after]
        for g, n in layout_bytes(moved, specs).items():
            peak[g] = peak.get(g, 0) + n
    return max(peak.values())


def fit_case(case: str, world: int, mem: int, shape: dict, layers: int, budget: int):
    """The largest configuration of `case` whose peak fits `budget`: both models at
    `layers`, else the actor alone, else the actor with halved layers."""
    import nereus.ir as ir

    a, b = case_plans(case, world)
    options = [(("actor", "critic"), layers), (("actor",), layers)]
    n = layers // 2
    while n >= 1:
        options.append((("actor",), n))
        n //= 2
    for models, n_layers in options:
        module = ir.parse_source(module_source(world, mem, shape, n_layers, models, a, b), f"{case}.nir")
        peak = peak_bytes(module, [f"{m}.training" for m in models])
        if peak <= budget:
            return module, models, n_layers, peak
    raise SystemExit(f"{case}: even one layer of the actor does not fit {budget} bytes per GPU")


def in_first_layers(k: int):
    pattern = re.compile(r"^\w+/layers\.(\d+)\.")

    def keep(name: str) -> bool:
        match = pattern.match(name)
        return bool(match) and int(match.group(1)) < k
    return keep


def warm_cycle(env: Env, rt, repeats: int) -> dict:
    """A -> B and back `repeats` times (after the cold call), each timed barrier to
    barrier with the devices synchronized; medians, and the last A -> B report."""
    import statistics

    walls, execs, back = [], [], []
    report = None
    for _ in range(repeats):
        report, wall = env.timed(lambda: rt.transition("B"))
        walls.append(wall)
        execs.append(report.max_seconds)
        back.append(env.timed(lambda: rt.transition("A"))[1])
    return {"wall_s": statistics.median(walls), "walls": walls, "exec_s": statistics.median(execs),
            "reverse_s": statistics.median(back), "parked_bytes": int(env.total(report.parked_bytes)),
            "held_bytes": int(env.total(report.held_bytes)), "report": report}


def profile(env: Env, fn, path: str, label: str, **program) -> None:
    """One call under the PyTorch profiler (CPU + CUDA); rank 0 writes its summary (mg_profile)."""
    from mg_profile import profile_call

    profile_call(env, fn, path, label, **program)


def run_case(env: Env, case: str, args, shape: dict, bw: dict, progress=lambda out: None,
             first_case: bool = False) -> dict:
    from nereus.backends.json_program import plan_units_json
    from nereus.runtime import Runtime

    mem = env.gpu_mem_bytes()
    budget = int(0.88 * mem) - (8 << 30 if env.cuda else 0)
    module, models, layers, peak = fit_case(case, env.world, mem, shape, args.layers, budget)
    stages = [f"{m}.training" for m in models]
    env.log(f"{case}: {'+'.join(models)}, {layers} layers, estimated peak {peak / 1e9:.1f} GB per GPU")
    # constructing the Runtime creates and connects its data communicators (NCCL)
    rt, init_s = env.timed(lambda: Runtime(module, "A", device=env.device, timeout_s=args.timeout_s))
    units = {ms: (plan_units_json(module, "A", ms), plan_units_json(module, "B", ms)) for ms in stages}
    specs = {ms: full_specs(module, ms) for ms in stages}
    for ms in stages:
        rt.register(ms, build_local(units[ms][0], env.rank, specs[ms], args.seed, ms, env.device, step=STEP))

    def verified(layout: int, state=None) -> bool:
        bad = []
        for ms in stages:
            local = rt.state(ms) if state is None else state[ms]
            bad += check_local(local, units[ms][layout], env.rank, specs[ms], args.seed, ms, env.device,
                               step=STEP if state is None else None)
        return env.all_true(not bad)

    # cold: the first call of a fresh Runtime (compile + lowering included; in the first
    # case of the run also the process's first pack kernels and NCCL links)
    cold, cold_wall = env.timed(lambda: rt.transition("B"))
    ok = verified(1)
    rt.transition("A")
    ok = verified(0) and ok
    modes = {}
    for mode in [rt.rollback] + [m for m in args.modes.split(",") if m and m != rt.rollback]:
        rt.rollback = mode
        modes[mode] = warm_cycle(env, rt, args.repeats)
        ok = verified(0) and ok
    default = modes[next(iter(modes))]
    rt.rollback = next(iter(modes))
    if args.profile_dir and not os.path.exists(os.path.join(args.profile_dir, "profile_reshard.txt")):
        profile(env, lambda: rt.transition("B"), os.path.join(args.profile_dir, "profile_reshard.txt"), case,
                rt=rt, source="A", target="B")
        rt.transition("A")
    # prepared: a fresh Runtime on the same live tensors, prepare() untimed, then timed
    state = {ms: rt.state(ms) for ms in stages}
    del rt
    rt = Runtime(module, "A", device=env.device, timeout_s=args.timeout_s)
    for ms in stages:
        rt.register(ms, state[ms])
    del state
    prep = rt.prepare("B")
    prepared, prepared_wall = env.timed(lambda: rt.transition("B"))
    ok_prepared = verified(1)
    rt.transition("A")
    warm = default["report"]
    link = env.slowest(float(max(warm.bytes_sent, warm.bytes_received)))
    env.log(f"{case}: nereus warm {default['wall_s']:.3f} s (exec {default['exec_s']:.3f}), cold "
            f"{cold_wall:.3f}, prepared {prepared_wall:.3f} (prepare {env.slowest(prep['seconds']):.3f}), "
            f"{warm.total_bytes_sent / 1e9:.2f} GB sent, modes "
            + ", ".join(f"{m} {v['wall_s']:.3f}" for m, v in modes.items()) + f", verified {ok and ok_prepared}")
    incoming = {}
    for ms in stages:
        for g, n in incoming_bytes(units[ms][0], units[ms][1], specs[ms]).items():
            incoming[g] = incoming.get(g, 0) + n
    state_bytes = sum(specs_bytes(specs[ms]) for ms in stages)
    out = {"case": case, "models": list(models), "layers": layers, "state_bytes": state_bytes,
           "peak_estimate_bytes": peak, "rollback": warm.rollback,
           "nereus_s": default["wall_s"], "nereus_times_s": default["walls"], "nereus_exec_s": default["exec_s"],
           "nereus_reverse_s": default["reverse_s"],
           "nereus_cold_s": cold_wall, "nereus_cold_exec_s": cold.max_seconds, "nereus_cold_compile_s": cold.compile_s,
           "process_cold": first_case, "runtime_init_s": init_s, "nereus_prepared_s": prepared_wall, "nereus_prepared_exec_s": prepared.max_seconds,
           "nereus_prepare_s": env.slowest(prep["seconds"]), "prepared_kernels": prep["kernels"],
           "modes": {m: {k: v for k, v in d.items() if k != "report"} for m, d in modes.items()},
           "rounds": len(warm.rounds), "bytes_moved": warm.total_bytes_sent,
           "bytes_busiest_link": int(link), "bound_link_s": link / (bw["p2p_GBps"] * 1e9) if bw.get("p2p_GBps") else None,
           **bounds(incoming, bw), "verified_nereus": bool(ok and ok_prepared)}
    out["cold_over_warm"] = out["nereus_cold_s"] / out["nereus_s"]
    out["cold_target_s"] = 2 * out["nereus_s"] + 0.3
    out["prepared_over_warm"] = out["nereus_prepared_s"] / out["nereus_s"]
    if out["bound_link_s"]:
        out["nereus_over_bound_link"] = out["nereus_s"] / out["bound_link_s"]
    out["bytes_moved_at_lower_bound"] = out["bytes_moved"] == out["bytes_owner_change"]
    if out["bound_s"]:
        out["nereus_over_bound"] = out["nereus_s"] / out["bound_s"]
    if out["bound_parallel_s"]:
        out["nereus_over_bound_parallel"] = out["nereus_s"] / out["bound_parallel_s"]
    if case == "gpus4-gpus8" and tuple(models) == ("actor", "critic") and layers == 32 and shape == SHAPES["8b"]:
        out["paper_s"] = PAPER_4_TO_8_S
        out["paper_over_nereus"] = PAPER_4_TO_8_S / out["nereus_s"]

    state_a = {ms: rt.state(ms) for ms in stages}
    progress(out)
    if not args.skip_gather_scatter:
        guarded(env, out, "gather_scatter", lambda: _gather_scatter(env, out, stages, units, specs, state_a, verified))
    if args.dcp_layers > 0:
        guarded(env, out, "dcp", lambda: _dcp(env, out, case, args, stages, units, specs, state_a, layers, state_bytes))
    del rt, state_a
    free_memory(env)
    if env.cuda:
        out["max_allocated_bytes"] = int(env.slowest(float(torch.cuda.max_memory_allocated(env.device))))
        torch.cuda.reset_peak_memory_stats(env.device)
    out["verified"] = all(v for k, v in out.items() if k.startswith("verified_"))
    return out


def guarded(env: Env, out: dict, what: str, fn) -> None:
    """Run a baseline; an exception (the same on every rank, e.g. an API a torch version
    lacks) is recorded in `out` instead of ending the benchmark."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001 - recorded, and the other figures still count
        out[f"{what}_error"] = f"{type(error).__name__}: {error}"[:500]
        env.log(f"{what} failed: {out[f'{what}_error']}")
    free_memory(env)


def _gather_scatter(env, out, stages, units, specs, state_a, verified) -> None:
    """Timed like Nereus: a warm-up run (timed: gather_scatter_cold_s), then `--repeats`
    runs barrier to barrier (devices synchronized), median."""
    run = lambda: {ms: gather_scatter(env, *units[ms], state_a[ms], specs[ms]) for ms in stages}  # noqa: E731
    new, gs_s, times, out["gather_scatter_cold_s"] = env.timed_median(run, len(out["nereus_times_s"]))
    out["gather_scatter_s"] = gs_s
    out["gather_scatter_times_s"] = times
    out["verified_gather_scatter"] = verified(1, new)
    out["gather_scatter_over_nereus"] = gs_s / out["nereus_s"]
    del new
    env.log(f"{out['case']}: gather-scatter {gs_s:.3f} s ({out['gather_scatter_over_nereus']:.1f}x nereus)")


def _dcp(env, out, case, args, stages, units, specs, state_a, layers, state_bytes) -> None:
    keep = in_first_layers(min(args.dcp_layers, layers))
    save_s = load_s = 0.0
    subset = 0
    loaded = {}
    for ms in stages:
        names = sorted(n for n in specs[ms] if keep(n))
        subset += specs_bytes({n: specs[ms][n] for n in names})
        folder = os.path.join(args.ckpt_dir, f"{case}-{ms}")
        s, l, loaded[ms] = dcp_save_load(env, *units[ms], state_a[ms], specs[ms], names, folder)
        save_s, load_s = save_s + s, load_s + l
    ok_dcp = env.all_true(all(not check_local(loaded[ms], units[ms][1], env.rank, specs[ms], args.seed, ms,
                                              env.device, names=keep) for ms in stages))
    del loaded
    dcp_s = save_s + load_s
    out.update(dcp_subset_layers=min(args.dcp_layers, layers), dcp_subset_bytes=subset, dcp_save_s=save_s,
               dcp_load_s=load_s, dcp_s=dcp_s, dcp_s_extrapolated=dcp_s * state_bytes / subset, verified_dcp=ok_dcp)
    out["dcp_extrapolated_over_nereus"] = out["dcp_s_extrapolated"] / out["nereus_s"]
    env.log(f"{case}: dcp {dcp_s:.2f} s on {subset / 1e9:.2f} GB, extrapolated "
            f"{out['dcp_s_extrapolated']:.1f} s for {state_bytes / 1e9:.1f} GB")


def save_partial(env: Env, args, bw: dict, cases: list) -> None:
    """What has finished so far, in `--json-out`.partial: it survives a timeout."""
    if env.rank == 0 and args.json_out:
        with open(args.json_out + ".partial", "w") as f:
            json.dump({"name": "multi_gpu_reshard", "gpus": env.world, "bandwidth": bw, "partial": True,
                       "cases": cases}, f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--cases", default=None, help="comma-separated (default: all three for this world)")
    parser.add_argument("--layers", type=int, default=None, help="default 32 (8B), quick 8; tiny model on CPU: 4")
    parser.add_argument("--dcp-layers", type=int, default=None, help="layers in the DCP subset (default 2, quick 1)")
    parser.add_argument("--ckpt-dir", default=os.environ.get("NEREUS_CKPT_DIR", "/tmp/nereus-mg-dcp"))
    parser.add_argument("--bandwidth-mib", type=int, default=None, help="default 1024 on GPU, 4 on CPU")
    parser.add_argument("--skip-gather-scatter", action="store_true")
    parser.add_argument("--repeats", type=int, default=None, help="warm A -> B -> A cycles (default 5, quick 3)")
    parser.add_argument("--modes", default="host,device",
                        help="rollback modes timed warm besides the default (comma-separated)")
    parser.add_argument("--profile-dir", default=None, help="profile one warm transition (first case) here")
    args = parser.parse_args(argv)
    env = Env(args)
    if env.world < 2 or env.world % 2:
        raise SystemExit("reshard.py needs an even number of ranks >= 2 (it doubles from n/2 to n)")
    shape = SHAPES["8b"] if env.cuda else SHAPES["tiny"]
    if args.layers is None:
        args.layers = shape["layers"] if not args.quick else min(8, shape["layers"])
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.dcp_layers is None:
        args.dcp_layers = 1 if args.quick else 2
    bw = link_bandwidth(env, args.bandwidth_mib)
    cases = []
    for case in selected_cases(parser, args.cases, case_names(env.world), env.world):
        cases.append(run_case(env, case, args, shape, bw, lambda current: save_partial(env, args, bw, cases + [current]),
                              first_case=not cases))
        save_partial(env, args, bw, cases)
    verified = all(c["verified"] for c in cases)
    env.finish({"name": "multi_gpu_reshard", "gpus": env.world, "backend": env.backend, "device": env.device.type,
                "quick": args.quick, "shape": shape, "bandwidth": bw, "paper_4_to_8_s": PAPER_4_TO_8_S,
                "verified": verified, "cases": cases, "machine": machine()}, args.json_out)
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
