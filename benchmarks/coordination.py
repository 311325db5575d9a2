"""Coordinated transitions under memory pressure: the paper's Table 5 in symbolic replay.

Two model-stages share a 32-48 GPU cluster whose GPUs are nearly full. Each trial draws
random plans S and S* for both (random dp/tp/pp, random GPU subsets that overlap, so
units trade places), sets GPU memory to the busiest GPU's step-boundary state in S or S*
plus a small random slack (1-15%, and exactly 1% in a quarter of the trials: a trade of
place on full GPUs, whose only free memory is the 1% every real job keeps for transfer
buffers), compiles S -> S* twice and replays each program with the verifier:

  - with resource edges (the default pipeline: one global DAG, free -> alloc edges across
    model-stages, cycles broken by chunking or host staging);
  - independent local DAGs (`independent=True`): each model-stage scheduled alone, blind
    to the others' memory, the local schedules run side by side (lockstep);
  - independent local DAGs executed one model-stage at a time, as a user of per-component
    resharding would run them: first one model-stage moves (its own schedule, seeing the
    memory as it is: the other's state where it was), then the other (seeing the first one
    moved), in both orders (`first_then_second`, `second_then_first`; the better order is
    reported too, and `either` counts a trial that succeeds in at least one order). Each
    leg is a transition of its own through an intermediate plan in which only that
    model-stage has moved, compiled with `independent=True` (no staging) and verified;
  - the same sequential legs, each compiled by the full default pipeline (chunking and
    host staging allowed, as the coordinated program may use them): what a competent user
    of per-model-stage resharding with Nereus's own compiler would run (issue 41: the
    baseline above was denied the host staging the coordinated program used in 40-67% of
    the trials). Both orders, the better one and either, as above, and how often a leg
    staged.

A trial succeeds when compilation succeeds and the verifier proves the program (no GPU
over capacity in any round, no read after free, every box written once, sends matched).

Overlap types (as in the paper): SM-CS, the same model in two stages (actor.generation
and actor.training); CM-SS, two models in one stage (actor.training and
critic.training); CM-CS, two models in two stages (actor.generation and critic.training).

    python benchmarks/coordination.py [--trials 100] [--seed 0] [--jobs N]

Last stdout line: {"name": "coordination", "cases": [{"type", "trials",
"success_with_edges", "success_independent", "success_one_at_a_time": {"first_then_second",
"second_then_first", "better_order", "either"}, "success_sequential_full_pipeline": {the
same keys}, "sequential_staged_share": {"first_then_second", "second_then_first"},
"gap_to_sequential_full_pipeline" (points: with edges minus the better order),
"edges_mean", "staged_share"}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

TYPES = {
    "SM-CS": (("actor", "generation"), ("actor", "training")),
    "CM-SS": (("actor", "training"), ("critic", "training")),
    "CM-CS": (("actor", "generation"), ("critic", "training")),
}
ARCH = "layers 8 hidden 1024 heads 16 kv_heads 4 ffn 4096 vocab 32000"
LAYOUTS = [(tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4)]


def _placement(rng: random.Random, gpus: list[int], model_stage: str) -> str:
    tp, pp = rng.choice([(t, p) for t, p in LAYOUTS if t * p <= len(gpus) // 2])
    dp = rng.randint(1, len(gpus) // (tp * pp))
    chosen = rng.sample(gpus, dp * tp * pp)
    if rng.random() < 0.5:  # node-aligned, contiguous sets are common in practice
        start = rng.randrange(0, len(gpus) - dp * tp * pp + 1)
        chosen = gpus[start:start + dp * tp * pp]
    return f"  {model_stage} dp {dp} tp {tp} pp {pp} on {', '.join(map(str, chosen))}"


def _source(nodes: int, mem: str, stages, plans: dict[str, list[str]]) -> str:
    by_stage: dict[str, list[str]] = {}
    for model, stage in stages:
        by_stage.setdefault(stage, []).append(model)
    stage_text = "  ".join(f"{s}: {', '.join(ms)}" for s, ms in by_stage.items())
    lines = [
        f"cluster c {{ nodes {nodes} gpus_per_node 8 gpu {{ mem {mem} flops 989TFLOPS hbm 4.8TB/s }}",
        "  intra 900GB/s inter 25GB/s host_mem 2TB }",
        f"model actor = llama {{ {ARCH} }}",
        f"model critic = llama {{ {ARCH} head value }}",
        f"workload w {{ batch 64 prompt 256 response 256 microbatch 1  {stage_text} }}",
    ]
    for name, body in plans.items():
        lines += [f"plan {name} {{", *body, "}"]
    # the halfway plans of the one-at-a-time baseline: only one model-stage has moved
    if "S" in plans and "T" in plans:
        lines += ["plan M1 {", plans["T"][0], plans["S"][1], "}", "plan M2 {", plans["S"][0], plans["T"][1], "}"]
    lines.append("transition S -> T")
    return "\n".join(lines) + "\n"


def draw_plans(rng: random.Random, kind: str) -> tuple:
    """The random part of one trial of overlap type `kind`: (nodes, plans, slack). Only
    this consumes `rng`, so trials can be drawn in order and built and run anywhere."""
    nodes = rng.choice([4, 5, 6])
    gpus = list(range(nodes * 8))
    plans = {name: [_placement(rng, gpus, f"{m}.{s}") for m, s in TYPES[kind]] for name in ("S", "T")}
    # 1% headroom at the least: a receive buffer must exist somewhere; on an H200 that is
    # 1.4 GB, far more than one chunk of a transfer
    slack = 0.01 if rng.random() < 0.25 else rng.uniform(0.01, 0.15)
    return nodes, plans, slack


def build_trial(kind: str, nodes: int, plans: dict, slack: float):
    """The module of a drawn trial: GPU memory = the busiest GPU's state in S or T + slack."""
    from nereus.ir import parse_source
    from nereus.passes.feasibility import resident_bytes_per_gpu

    stages = TYPES[kind]
    probe = parse_source(_source(nodes, "1TB", stages, plans), "<coordination>")
    busiest = max(max(resident_bytes_per_gpu(probe, probe.plan(p)).values()) for p in ("S", "T"))
    mem = int(busiest * (1 + slack)) + 1
    return parse_source(_source(nodes, f"{mem}B", stages, plans), "<coordination>")


def draw_trial(rng: random.Random, kind: str):
    """One random (module source, slack) of overlap type `kind`."""
    nodes, plans, slack = draw_plans(rng, kind)
    return build_trial(kind, nodes, plans, slack), slack


def attempt(module, source: str = "S", target: str = "T", **options) -> tuple[bool, int, bool, str]:
    """(verified, resource edges, staged through host, failure reason)."""
    from nereus.ir.diagnostics import NereusError
    from nereus.passes import compile_transition
    from nereus.backends.json_program import program_json
    from nereus.passes.verify import verify_program

    try:
        # check_fit off: GPU memory is sized to the step-boundary state (what a transition
        # moves), not to a stage's activations, which the fail-fast fit check would add
        compiled = compile_transition(module, source, target, check_fit=False, **options)
        verify_program(program_json(compiled))
    except NereusError as error:
        return False, 0, False, error.message.split(":")[0][:60]
    summary = compiled.summary
    edges = sum(summary.get("resource_edges", {}).values())
    staged = summary.get("bytes", {}).get("staged", 0) > 0
    return True, edges, staged, ""


def one_at_a_time(module, halfway: str, **options) -> tuple[bool, str, bool]:
    """Move one model-stage, then the other, through plan `halfway` (M1: the first
    model-stage moves first; M2: the second), each leg compiled with `options` (the
    default pipeline, or `independent=True`) and verified: (ok, failure reason, a leg
    staged through host)."""
    staged = False
    for source, target in (("S", halfway), (halfway, "T")):
        ok, _, leg_staged, reason = attempt(module, source, target, **options)
        if not ok:
            return False, f"{source}->{target}: {reason}", staged
        staged |= leg_staged
    return True, "", staged


ORDERS = (("first_then_second", "M1"), ("second_then_first", "M2"))


def run_trial(drawn: tuple) -> dict:
    """Every method on one drawn trial (kind, nodes, plans, slack): what succeeded, why not."""
    module = build_trial(*drawn)
    ok, edges, was_staged, reason = attempt(module)
    ok_i, _, _, reason_i = attempt(module, independent=True)
    orders = {order: one_at_a_time(module, halfway, independent=True)[:2] for order, halfway in ORDERS}
    sequential = {order: one_at_a_time(module, halfway) for order, halfway in ORDERS}
    return {"ok": ok, "edges": edges, "staged": was_staged, "reason": reason, "ok_i": ok_i, "reason_i": reason_i,
            "orders": orders, "sequential": sequential}


def summarize(kind: str, outcomes: list, seconds: float) -> dict:
    trials = len(outcomes)
    reasons: dict = {}

    def count(key):
        reasons[key] = reasons.get(key, 0) + 1

    ok_order = {order: 0 for order, _ in ORDERS}
    ok_sequential = {order: 0 for order, _ in ORDERS}
    staged_sequential = {order: 0 for order, _ in ORDERS}
    sequential_failures: dict = {}
    ok_either = ok_sequential_either = 0
    for o in outcomes:
        if not o["ok"]:
            count(f"edges: {o['reason']}")
        if not o["ok_i"]:
            count(o["reason_i"])
        for order, (ok_s, reason_s) in o["orders"].items():
            ok_order[order] += ok_s
            if not ok_s:
                count(f"{order}: {reason_s.split(':')[0]} {reason_s.split(':')[1].strip()[:40]}")
        ok_either += any(ok_s for ok_s, _ in o["orders"].values())
        for order, (ok_s, reason_s, staged_s) in o["sequential"].items():
            ok_sequential[order] += ok_s
            staged_sequential[order] += staged_s
            if not ok_s:
                key = f"{order}: {reason_s.split(':')[0]} {reason_s.split(':')[1].strip()[:40]}"
                sequential_failures[key] = sequential_failures.get(key, 0) + 1
        ok_sequential_either += any(ok_s for ok_s, _, _ in o["sequential"].values())
    pct = lambda n: round(100.0 * n / trials, 1)  # noqa: E731
    with_edges = pct(sum(o["ok"] for o in outcomes))
    return {"type": kind, "trials": trials,
            "success_with_edges": with_edges,
            "success_independent": pct(sum(o["ok_i"] for o in outcomes)),
            "success_one_at_a_time": {**{k: pct(v) for k, v in ok_order.items()},
                                      "better_order": pct(max(ok_order.values())), "either": pct(ok_either)},
            "success_sequential_full_pipeline": {**{k: pct(v) for k, v in ok_sequential.items()},
                                                 "better_order": pct(max(ok_sequential.values())),
                                                 "either": pct(ok_sequential_either)},
            "sequential_staged_share": {k: pct(v) for k, v in staged_sequential.items()},
            "gap_to_sequential_full_pipeline": round(with_edges - pct(max(ok_sequential.values())), 1),
            "edges_mean": round(sum(o["edges"] for o in outcomes) / trials, 2),
            "staged_share": pct(sum(o["staged"] for o in outcomes)),
            "independent_failures": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:8]),
            "sequential_failures": dict(sorted(sequential_failures.items(), key=lambda kv: -kv[1])[:8]),
            "seconds": round(seconds, 2)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes (trials are drawn in order first: same results for any value)")
    args = parser.parse_args(argv)
    cases = []
    pool = None
    if args.jobs > 1:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(args.jobs)
    try:
        for kind in TYPES:
            rng = random.Random(f"{args.seed}/{kind}")
            drawn = [(kind, *draw_plans(rng, kind)) for _ in range(args.trials)]
            start = time.perf_counter()
            outcomes = []
            runs = pool.imap(run_trial, drawn) if pool is not None else map(run_trial, drawn)
            for trial, outcome in enumerate(runs):
                outcomes.append(outcome)
                if (trial + 1) % 25 == 0:
                    print(f"{kind}: {trial + 1}/{args.trials} trials", file=sys.stderr, flush=True)
            case = summarize(kind, outcomes, time.perf_counter() - start)
            cases.append(case)
            print(f"{kind}: with edges {case['success_with_edges']}%  independent {case['success_independent']}%  "
                  f"one at a time {case['success_one_at_a_time']}  "
                  f"sequential, full pipeline {case['success_sequential_full_pipeline']}  "
                  f"edges/trial {case['edges_mean']}  staged in {case['staged_share']}% of trials", file=sys.stderr)
    finally:
        if pool is not None:
            pool.close()
    print(json.dumps({"name": "coordination", "cases": cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
