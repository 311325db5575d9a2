"""Executor correctness on one process per GPU: random transitions, byte-exact after each.

    torchrun --nproc-per-node 8 benchmarks/multi_gpu/correctness.py            # H200s, NCCL
    torchrun --nproc-per-node 4 benchmarks/multi_gpu/correctness.py --backend gloo --device cpu --quick

Two scenarios, each a chain of random plans over the world's GPUs for three colocated
model-stages: actor.generation (weights only), actor.training and critic.training
(bf16 weights + fp32 master / exp_avg / exp_avg_sq + the Adam step). Each plan draws
(dp, tp, pp) and a GPU set in random order per model-stage, so the chain has TP, PP, DP
and GPU-count changes up and down (the JSON lists how many of each it covered).

- "small": a small GQA llama on a cluster whose GPU memory is set tight, so that the
  compiler must spread transitions over several rounds;
- "8b-shaped": Llama-3.1-8B layer shapes (hidden 4096, 32/8 heads, ffn 14336, vocab
  128256) with fewer layers (`--big-layers`, default 2: embed + 2 layers + head per
  model keep every tensor kind and the largest tensors at full size while a chain step
  stays a few seconds). On CPU (`--device cpu`) it uses the "tiny" shapes instead.

After every transition each rank compares its shards with freshly computed reference
slices (no gather), checks that ranks without a unit hold nothing, that the step
counter survived, and that its peak bytes stay within the compiler's replay. Every other
transition runs with the executor's checksum verify mode. One transition per scenario
first runs with an injected failure (on the receiver of its first message, after the
exchange): every rank must raise TransitionAborted and keep its old state byte for byte,
then the transition is retried. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from mg_common import SHAPES, Env, whole_program, add_common_args, build_local, check_local, cluster_source, free_memory, \
    machine, model_source, plan_source

STAGES = ("actor.generation", "actor.training", "critic.training")
KINDS = ("tp_up", "tp_down", "pp_up", "pp_down", "dp_up", "dp_down", "gpus_up", "gpus_down")
WORKLOAD = """workload ppo {
  batch 8  prompt 16  response 16  microbatch 1
  generation: actor
  training:   actor, critic
}
"""


def valid_tps(shape: dict, world: int) -> list:
    """TP degrees docs/ir.md allows for this shape (divide heads, ffn, vocab; the kv rule)."""
    out = []
    for tp in (1, 2, 4, 8, 16):
        if tp > world or shape["heads"] % tp or shape["ffn"] % tp or shape["vocab"] % tp:
            continue
        kv = shape["kv_heads"]
        if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
            continue
        out.append(tp)
    return out


def draw_plan(rng: random.Random, shape: dict, layers: int, world: int) -> dict:
    plan = {}
    for ms in STAGES:
        tp = rng.choice(valid_tps(shape, world))
        pp = rng.randint(1, max(1, min(layers, world // tp)))
        dp = rng.randint(1, world // (tp * pp))
        plan[ms] = (dp, tp, pp, rng.sample(range(world), dp * tp * pp))
    return plan


def changes(a: dict, b: dict) -> dict:
    """Which kinds of change a → b makes, counted over model-stages."""
    out = dict.fromkeys(KINDS, 0)
    for ms in STAGES:
        for i, kind in ((1, "tp"), (2, "pp"), (0, "dp")):
            if b[ms][i] != a[ms][i]:
                out[f"{kind}_{'up' if b[ms][i] > a[ms][i] else 'down'}"] += 1
        ga, gb = len(a[ms][3]), len(b[ms][3])
        if ga != gb:
            out[f"gpus_{'up' if gb > ga else 'down'}"] += 1
    return out


def chain_source(rng: random.Random, shape: dict, layers: int, world: int, steps: int, mem: int) -> tuple:
    """A module source with plans S0..S{steps}, each transition compilable (a drawn plan
    that does not fit, or whose transition cannot fit, is redrawn), that together cover
    every kind of change (the chain is redrawn up to 20 times until it does); and the
    coverage counts."""
    import nereus.ir as ir
    from nereus.ir.diagnostics import NereusError
    from nereus.passes import compile_transition

    head = cluster_source(world, mem) + model_source(shape, layers) + WORKLOAD
    wanted = [k for k in KINDS if not (world == 1 and k.startswith(("tp", "dp", "gpus")))]
    for attempt in range(20):
        plans = [draw_plan(rng, shape, layers, world)]
        while len(plans) <= steps:
            for _ in range(20):
                candidate = draw_plan(rng, shape, layers, world)
                text = head + plan_source("A", plans[-1]) + plan_source("B", candidate)
                try:
                    compile_transition(ir.parse_source(text, "draw.nir"), "A", "B")
                except NereusError:
                    continue
                plans.append(candidate)
                break
            else:
                break  # the last plan (or the first) leads nowhere: draw a new chain
        if len(plans) <= steps:
            if attempt == 19:
                raise SystemExit(f"no compilable chain in 20 draws (GPU memory {mem} B too tight?)")
            continue
        cover = dict.fromkeys(KINDS, 0)
        for a, b in zip(plans, plans[1:]):
            for k, v in changes(a, b).items():
                cover[k] += v
        if all(cover[k] for k in wanted):
            break
    text = head + "".join(plan_source(f"S{i}", p) for i, p in enumerate(plans))
    return text, cover


def fault_point(program: dict, world: int) -> tuple:
    """Where to inject a failure: after the exchange ("unpack") on the receiver of the
    first message, so the data has moved when it fails; before any exchange ("pack") on
    rank 1 when the transition sends nothing."""
    for index, rnd in enumerate(program["rounds"]):
        for op in rnd["ops"]:
            if op["op"] == "send":
                return (op["dst"], index, "unpack")
    return (1 % world, 0, "pack")


def check_all(rt, env, seed: int, step: int) -> list:
    """Mismatches over every model-stage of this rank (empty when right)."""
    bad = []
    for ms in STAGES:
        specs = rt.tensor_specs(ms)
        got = check_local(rt.state(ms), rt.layout(ms), env.rank, specs, seed, ms, env.device,
                          step=step if ms.endswith(".training") else None)
        bad += [f"{ms} {b}" for b in got]
    return bad


def scenario(env: Env, name: str, shape: dict, layers: int, steps: int, mem: int, seed: int,
             rollback=None) -> dict:
    import torch.distributed as dist

    import nereus.ir as ir
    from nereus.passes.verify import verify_program
    from nereus.runtime import Runtime, TransitionAborted

    started = time.perf_counter()
    box = [None]
    if env.rank == 0:  # one rank draws, every rank runs the same chain
        box[0] = chain_source(random.Random(seed), shape, layers, env.world, steps, mem)
    dist.broadcast_object_list(box, src=0, group=env.ctrl)
    source, cover = box[0]
    module = ir.parse_source(source, f"{name}.nir")
    rt = Runtime(module, "S0", device=env.device, direct_min_bytes=64 * 1024, rollback=rollback)
    step = 1000 + seed
    for ms in STAGES:
        local = build_local(rt.layout(ms), env.rank, rt.tensor_specs(ms), seed, ms, env.device,
                            step=step if ms.endswith(".training") else None)
        rt.register(ms, local)
    failures = []
    initial = check_all(rt, env, seed, step)
    if not env.all_true(not initial):
        failures.append({"step": 0, "rank": env.rank, "bad": initial[:5]})
    fault_at = max(1, steps // 2)
    records = []
    for k in range(1, steps + 1):
        target = f"S{k}"
        record = {"target": target}
        if k == fault_at and env.world > 1:
            fault = fault_point(whole_program(rt, target), env.world)
            record["fault_at"] = list(fault)
            try:
                rt.transition(target, fault=fault)
                record["fault"] = "no error raised"
            except TransitionAborted as error:
                expected = f"rank {fault[0]}, round {fault[1]}"
                record["fault"] = "aborted" if expected in str(error) else f"wrong error: {error}"
            intact = check_all(rt, env, seed, step)
            record["fault_state_intact"] = env.all_true(not intact and rt.plan == f"S{k - 1}")
            record["fault_ok"] = env.all_true(record["fault"] == "aborted") and record["fault_state_intact"]
        program = whole_program(rt, target)
        replay = verify_program(program).peak_bytes.get(env.rank, 0)
        verify = k % 2 == 1
        env.barrier()
        report = rt.transition(target, verify=verify)
        env.sync()
        bad = check_all(rt, env, seed, step)
        within = report.peak_bytes <= max(replay, 1) or report.peak_bytes == 0
        ok = env.all_true(not bad and within and (report.verified is not False))
        record.update(ok=ok, rounds=len(program["rounds"]), seconds=report.max_seconds, verify=verify,
                      bytes_sent=int(report.total_bytes_sent), peak_within_replay=env.all_true(within),
                      rollback=report.rollback, parked_bytes=int(env.total(report.parked_bytes)),
                      held_bytes=int(env.total(report.held_bytes)))
        if not ok:
            failures.append({"step": k, "rank": env.rank, "bad": bad[:5], "peak": report.peak_bytes,
                             "replay": replay})
        records.append(record)
        env.log(f"{name} {target}: {'ok' if ok else 'FAIL'}, {record['rounds']} rounds, "
                f"{record['bytes_sent'] / 2**20:.1f} MiB sent, {record['seconds'] * 1e3:.1f} ms")
    gathered = [None] * env.world
    dist.all_gather_object(gathered, failures, group=env.ctrl)
    failures = [f for per_rank in gathered for f in per_rank]
    del rt
    free_memory(env)
    fault_ok = all(r.get("fault_ok", True) for r in records)
    return {"scenario": name, "shape": dict(shape, layers=layers), "transitions": steps, "coverage": cover,
            "rounds_max": max(r["rounds"] for r in records), "bytes_sent": sum(r["bytes_sent"] for r in records),
            "fault_checked": any("fault" in r for r in records), "fault_ok": fault_ok,
            "parked_bytes": sum(r["parked_bytes"] for r in records), "held_bytes": sum(r["held_bytes"] for r in records),
            "passed": not failures and fault_ok and all(r["ok"] for r in records),
            "failures": failures[:10], "steps": records, "seconds": time.perf_counter() - started}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--steps", type=int, default=None, help="transitions per scenario (default 8, quick 4)")
    parser.add_argument("--big-layers", type=int, default=2, help="layers of the 8B-shaped model")
    parser.add_argument("--scenarios", default="small,8b-shaped")
    parser.add_argument("--rollback", choices=("auto", "host", "device"), default=None,
                        help="the Runtime's rollback mode (default: its own, auto on CUDA)")
    args = parser.parse_args(argv)
    env = Env(args)
    steps = args.steps or (4 if args.quick else 8)
    out = []
    for name in [s for s in args.scenarios.split(",") if s]:
        if name == "small":
            shape, layers = SHAPES["tiny" if not env.cuda else "small"], 4
            # tight, so that transitions need several rounds (fewer GPUs need more room each)
            mem = 6 * 2**20 if not env.cuda else int(48 * (1 + (8 - min(env.world, 8)) / 6)) * 2**20
        elif name == "8b-shaped":
            shape = SHAPES["8b"] if env.cuda else SHAPES["tiny"]
            layers = args.big_layers
            mem = env.gpu_mem_bytes()
        else:
            parser.error(f"unknown scenario {name}")
        env.log(f"scenario {name}: {shape}, layers {layers}, {steps} transitions on {env.world} ranks")
        out.append(scenario(env, name, shape, layers, steps, mem, args.seed + len(out), args.rollback))
    passed = all(s["passed"] for s in out)
    env.log(f"correctness: {'PASSED' if passed else 'FAILED'}")
    env.finish({"name": "multi_gpu_correctness", "gpus": env.world, "backend": env.backend,
                "device": env.device.type, "quick": args.quick, "passed": passed, "scenarios": out,
                "machine": machine()}, args.json_out)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
