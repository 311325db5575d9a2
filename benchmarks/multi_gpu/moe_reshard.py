"""Expert-parallel ↔ tensor-parallel transitions of a Qwen3-MoE over NCCL, byte-exact and
timed against the link bound.

    torchrun --nproc-per-node 2 benchmarks/multi_gpu/moe_reshard.py                    # 2 H200s
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/multi_gpu/moe_reshard.py --backend gloo --quick

Qwen3-30B-A3B's shapes (48 layers, hidden 2048, 128 experts of width 768, 8 per token,
32 heads, 4 KV heads of 128, vocab 151,936; bf16) on a world of n GPUs (a tiny Qwen3-MoE
with 8 experts on CPU). Cases, each a plan A and a plan B of one model-stage:

- gen-ep{n}-tp{n}: actor.generation weights (the per-step refit's layouts), expert
  parallel ep n (each GPU holds 128/n experts whole, attention replicated) -> tensor
  parallel tp n (every expert split over the n GPUs, attention split);
- train-ep{n}-tp{n}: actor.training with Adam state (bf16 weights + fp32 master,
  exp_avg, exp_avg_sq + step), the same two layouts;
- train-ep{n}-dp{n}: actor.training, ep n -> dp n (every GPU gets every expert).

When a case's peak (old shards + new shards not kept in place, on one GPU) would not fit
in 88% of GPU memory less 8 GB, it runs with the most layers that fit; each case reports
the layers it ran with (the generation case runs all 48 on 2 H200s; estimated peak
63 GB per GPU; the training cases 11 and 12 layers).

Timing as benchmarks/multi_gpu/reshard.py (`Env.timed`: barrier with the devices
synchronized at both ends, the slowest rank): nereus_cold_s is the first A -> B of a
fresh Runtime (compile, lowering, links; process_cold marks the first case), then one
untimed warm-up cycle, then nereus_s is the median of `--repeats` warm A -> B calls (the
way back B -> A in between, nereus_reverse_s, median too). bound_link_s = the busiest
rank's max(bytes sent, bytes received) of the warm A -> B / the P2P bandwidth measured
in this run (one large send GPU 0 -> 1); bound_s and bound_parallel_s as in
reshard.py. After every timed call, every rank's shards are checked byte for byte
against reference values (mg_common: a hash of each element's global index), so the
check never needs a gather. Last, `moe_forward`: one MoE layer's forward and backward
with ep = n over this backend's all_to_all_single (nereus.models.expert_parallel)
against the single-rank computation. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from mg_common import Env, add_common_args, bounds, build_local, check_local, cluster_source, free_memory, \
    incoming_bytes, layout_bytes, machine, link_bandwidth, selected_cases

STEP = 7
SHAPES = {
    # Qwen3-30B-A3B (tests/data/hf/qwen3-30b-a3b/config.json)
    "30b-a3b": dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144, vocab=151936,
                    experts=128, experts_per_token=8, expert_ffn=768),
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256,
                 experts=8, experts_per_token=2, expert_ffn=32),
    # Qwen3-30B-A3B's tensor and piece counts (128 experts) on tiny dimensions: the host
    # work per piece dominates, as it does on GPUs where bytes move fast
    "host": dict(layers=48, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256,
                 experts=128, experts_per_token=8, expert_ffn=32),
}


def case_names(world: int) -> list:
    return [f"gen-ep{world}-tp{world}", f"train-ep{world}-tp{world}", f"train-ep{world}-dp{world}"]


def module_source(case: str, world: int, mem: int, shape: dict, layers: int) -> str:
    stage = "generation" if case.startswith("gen") else "training"
    gpus = f"0..{world - 1}"
    after = f"dp 1 tp {world}" if "-tp" in case else f"dp {world}"
    s = dict(shape, layers=layers)
    return (cluster_source(world, mem)
            + f"model actor = qwen3_moe {{ layers {s['layers']} hidden {s['hidden']} heads {s['heads']} "
              f"kv_heads {s['kv_heads']} head_dim {s['head_dim']} ffn {s['ffn']} vocab {s['vocab']} dtype bf16 "
              f"experts {s['experts']} experts_per_token {s['experts_per_token']} expert_ffn {s['expert_ffn']} }}\n"
            + f"workload w {{\n  batch {2 * world}  prompt 16  response 16  microbatch 1\n  {stage}: actor\n}}\n"
            + f"plan A {{ actor.{stage} dp 1 ep {world} on {gpus} }}\n"
            + f"plan B {{ actor.{stage} {after} on {gpus} }}\n")


def stage_specs(module, model_stage: str) -> dict:
    """{name: (shape, torch dtype)} of the model-stage's full tensors, without the step."""
    from nereus.runtime.runtime import tensor_specs

    return {n: v for n, v in tensor_specs(module, model_stage).items() if not n.endswith("#step")}


def peak_bytes(module, ms: str) -> int:
    """Largest per-GPU bytes while both layouts live (kept shards counted once)."""
    from nereus.backends.json_program import plan_units_json

    specs = stage_specs(module, ms)
    before, after = plan_units_json(module, "A", ms), plan_units_json(module, "B", ms)
    old = {(s["gpu"], s["tensor"]): s["boxes"] for u in before for s in u["shards"]}
    moved = [dict(u, shards=[s for s in u["shards"] if old.get((s["gpu"], s["tensor"])) != s["boxes"]]) for u in after]
    peak = layout_bytes(before, specs)
    for g, n in layout_bytes(moved, specs).items():
        peak[g] = peak.get(g, 0) + n
    return max(peak.values())


def fit_case(case: str, world: int, mem: int, shape: dict, layers: int, budget: int):
    """The most layers (up to `layers`) whose peak fits `budget`: the peak is linear in the
    layer count (edges + per-layer bytes), so two small layouts give it, and the chosen
    count is then checked on its own layout."""
    import nereus.ir as ir

    def build(n: int):
        module = ir.parse_source(module_source(case, world, mem, shape, n), f"{case}.nir")
        ms = str(next(iter(module.workload.model_stages())))
        return module, ms, peak_bytes(module, ms)

    n = layers
    if layers > 2:
        one, two = build(1)[2], build(2)[2]
        per_layer = max(1, two - one)
        n = max(1, min(layers, (budget - (one - per_layer)) // per_layer))
    while n >= 1:
        module, ms, peak = build(n)
        if peak <= budget:
            return module, ms, n, peak
        n -= 1
    raise SystemExit(f"{case}: even one layer does not fit {budget} bytes per GPU")


def run_case(env: Env, case: str, args, shape: dict, bw: dict, first_case: bool) -> dict:
    from nereus.backends.json_program import plan_units_json
    from nereus.runtime import Runtime

    mem = env.gpu_mem_bytes()
    budget = int(0.88 * mem) - (8 << 30 if env.cuda else 0)
    module, ms, layers, peak = fit_case(case, env.world, mem, shape, args.layers or shape["layers"], budget)
    training = ms.endswith(".training")
    env.log(f"{case}: {ms}, {layers} layers, estimated peak {peak / 1e9:.1f} GB per GPU")
    units = (plan_units_json(module, "A", ms), plan_units_json(module, "B", ms))
    specs = stage_specs(module, ms)
    step = STEP if training else None
    rt = Runtime(module, "A", device=env.device, timeout_s=args.timeout_s)
    rt.register(ms, build_local(units[0], env.rank, specs, args.seed, ms, env.device, step=step))

    def verified(layout: int) -> bool:
        return env.all_true(not check_local(rt.state(ms), units[layout], env.rank, specs, args.seed, ms, env.device,
                                            step=step))

    ok = True
    cold, cold_wall = env.timed(lambda: rt.transition("B"))
    ok = verified(1) and ok
    rt.transition("A")
    ok = verified(0) and ok
    pieces = _piece_counts(rt.compile("B")[0], env.rank)  # A -> B, cached by the cold call
    rt.transition("B")  # warm-up cycle, untimed
    rt.transition("A")
    walls, execs, back = [], [], []
    report = None
    cpu = []
    for _ in range(args.repeats):
        started = time.process_time()
        report, wall = env.timed(lambda: rt.transition("B"))
        cpu.append(env.slowest(time.process_time() - started))
        walls.append(wall)
        execs.append(report.max_seconds)
        ok = verified(1) and ok
        back.append(env.timed(lambda: rt.transition("A"))[1])
        ok = verified(0) and ok
    if args.profile:  # one more warm A -> B under the profiler, then back
        from mg_profile import profile_call

        profile_call(env, lambda: rt.transition("B"), os.path.join(args.profile, "profile_moe.txt"),
                     f"{case} A -> B ({ms}, {layers} layers)", rt=rt, source="A", target="B")
        rt.transition("A")
    if args.cprofile:  # one more warm A -> B -> A, rank 0 under cProfile (host work per piece)
        import cProfile
        import pstats

        for target, suffix in (("B", ""), ("A", ".reverse")):
            profiler = cProfile.Profile() if env.rank == 0 else None
            if profiler is not None:
                profiler.enable()
            rt.transition(target)
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(f"{args.cprofile}.{case}{suffix}.prof")
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    link = env.slowest(float(max(report.bytes_sent, report.bytes_received)))
    out = {"case": case, "model_stage": ms, "layers": layers, "state_bytes":
           sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in specs.values()),
           "peak_estimate_bytes": peak, "rollback": report.rollback,
           "nereus_s": statistics.median(walls), "nereus_times_s": walls, "nereus_exec_s": statistics.median(execs),
           "nereus_cpu_s": statistics.median(cpu), "nereus_reverse_s": statistics.median(back), "nereus_reverse_times_s": back,
           "nereus_cold_s": cold_wall, "nereus_cold_exec_s": cold.max_seconds, "nereus_cold_compile_s": cold.compile_s,
           "process_cold": first_case, "rounds": len(report.rounds), "rank0_pieces": pieces, "bytes_moved": report.total_bytes_sent,
           "bytes_busiest_link": int(link),
           "bound_link_s": link / (bw["p2p_GBps"] * 1e9) if bw.get("p2p_GBps") else None,
           **bounds(incoming_bytes(units[0], units[1], specs), bw), "verified": bool(ok)}
    out["bytes_moved_at_lower_bound"] = out["bytes_moved"] == out["bytes_owner_change"]
    if out["bound_link_s"]:
        out["nereus_over_bound_link"] = out["nereus_s"] / out["bound_link_s"]
    if out["bound_s"]:
        out["nereus_over_bound"] = out["nereus_s"] / out["bound_s"]
    env.log(f"{case}: warm {out['nereus_s']:.3f} s (host CPU {out['nereus_cpu_s']:.3f} s, reverse {out['nereus_reverse_s']:.3f}), cold "
            f"{cold_wall:.3f} (compile {cold.compile_s:.3f}), pieces {pieces}, {out['bytes_moved'] / 1e6:.1f} MB sent (owner change "
            f"{out['bytes_owner_change'] / 1e6:.1f}), link bound {out['bound_link_s'] or 0:.3f} s, verified {ok}")
    del rt
    free_memory(env)
    if env.cuda:
        out["max_allocated_bytes"] = int(env.slowest(float(torch.cuda.max_memory_allocated(env.device))))
        torch.cuda.reset_peak_memory_stats(env.device)
    return out


def _piece_counts(program: dict, rank: int) -> dict:
    """This rank's pieces of a program: sent, received (in place or packed) and copied, a
    piece of several tensors (a v2 range) once per tensor; `ranged`: the work list's pieces."""
    from nereus.runtime.program import rank_program

    prog = rank_program(program, rank)
    sent = [p for w in prog.rounds for m in w.sends for p in m.pieces]
    received = [p for w in prog.rounds for m in w.recvs for p in m.pieces]
    copied = [p for w in prog.rounds for p in w.copies]
    return {"sent": sum(p.count for p in sent), "received": sum(p.count for p in received),
            "direct": sum(p.count for p in sent + received if p.direct), "copied": sum(p.count for p in copied),
            "ranged": len(sent) + len(received) + len(copied)}


def forward_check(env: Env, seed: int) -> dict:
    """The MoE layer's all-to-all dispatch/combine on this backend: one Qwen3-MoE layer
    (hidden 64, 8 experts, 2 per token) with ep = world, each rank its own 4 rows, forward
    and backward, against the single-rank computation of all rows on every rank (fp32).
    Returns the largest differences of the output and of the router and expert gradients."""
    import nereus.ir as ir
    from nereus.models.expert_parallel import EpGroup
    from nereus.models.parallel import TpGroup
    from nereus.models.qwen3_moe import moe_mlp

    world, rank = env.world, env.rank
    experts = 2 * world
    model = ir.Model("actor", "qwen3_moe", layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=32,
                     dtype="fp32", qk_norm=True, experts=experts, experts_per_token=2, expert_ffn=32,
                     norm_topk_prob=True)
    gen = torch.Generator().manual_seed(seed)
    full = {"layers.0.mlp.router.weight": torch.randn(experts, 64, generator=gen)}
    for e in range(experts):
        full[f"layers.0.mlp.experts.{e}.gate_up.weight"] = 0.1 * torch.randn(64, 64, generator=gen)
        full[f"layers.0.mlp.experts.{e}.down.weight"] = 0.1 * torch.randn(64, 32, generator=gen)
    x = torch.randn(world, 4, 64, generator=gen)

    def run(weights, rows, ep):
        w = {k: v.to(env.device).requires_grad_() for k, v in weights.items()}
        y = moe_mlp(model, w, 0, rows.to(env.device), TpGroup(), ep)
        (y * y).sum().backward()
        return y.detach().cpu(), {k: v.grad.cpu() if v.grad is not None else torch.zeros_like(v).cpu()
                                  for k, v in w.items()}

    expected_y, expected_g = run(full, x, None)
    mine = {k: v for k, v in full.items() if ".experts." not in k or int(k.split(".")[4]) // 2 == rank}
    import torch.distributed as dist

    y, grads = run(mine, x[rank:rank + 1], EpGroup(world, rank, dist.group.WORLD, tuple(range(world))))
    router = grads["layers.0.mlp.router.weight"].to(env.device)
    dist.all_reduce(router)  # dense gradients are summed over the EP ranks' rows
    grads["layers.0.mlp.router.weight"] = router.cpu()
    y_error = env.slowest(float((y - expected_y[rank:rank + 1]).abs().max()))
    g_error = env.slowest(max(float((grads[n] - expected_g[n]).abs().max()) for n in grads))
    return {"ep": world, "output_max_abs_error": y_error, "grad_max_abs_error": g_error,
            "grad_scale": max(float(g.abs().max()) for g in expected_g.values()),
            "verified": y_error < 1e-4 and g_error < 1e-3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--cases", default=None, help="comma-separated (default: all three for this world)")
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's (48 on GPU, 2 tiny)")
    parser.add_argument("--repeats", type=int, default=None, help="warm A -> B -> A cycles (default 5, quick 3)")
    parser.add_argument("--shape", choices=tuple(SHAPES), default=None,
                        help="default 30b-a3b on GPU, tiny on CPU; host = 30b-a3b's counts on tiny dimensions")
    parser.add_argument("--cprofile", default=None, metavar="PREFIX",
                        help="rank 0 profiles one more warm A -> B and B -> A with cProfile into PREFIX.CASE.prof and PREFIX.CASE.reverse.prof")
    parser.add_argument("--bandwidth-mib", type=int, default=None, help="default 1024 on GPU, 4 on CPU")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="profile one warm transition per case (PyTorch profiler; summary in DIR/profile_moe.txt)")
    args = parser.parse_args(argv)
    env = Env(args)
    if env.world < 2:
        raise SystemExit("moe_reshard.py needs 2 or more ranks")
    shape = SHAPES[args.shape or ("30b-a3b" if env.cuda else "tiny")]
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    bw = link_bandwidth(env, args.bandwidth_mib)
    cases = []
    for case in selected_cases(parser, args.cases, case_names(env.world), env.world):
        cases.append(run_case(env, case, args, shape, bw, first_case=not cases))
    forward = forward_check(env, args.seed)
    env.log(f"MoE layer, ep {env.world}, all-to-all over {env.backend}: output error "
            f"{forward['output_max_abs_error']:.2e}, gradient error {forward['grad_max_abs_error']:.2e}")
    verified = all(c["verified"] for c in cases) and forward["verified"]
    env.finish({"name": "multi_gpu_moe_reshard", "gpus": env.world, "backend": env.backend,
                "device": env.device.type, "quick": args.quick, "shape": shape, "bandwidth": bw,
                "verified": verified, "cases": cases, "moe_forward": forward, "machine": machine()}, args.json_out)
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
