"""Compile time of transitions at 32 to 1,024 GPUs (issue 4's plan_scale benchmark).

For 8B and 70B PPO workloads (actor, critic, ref, reward; generation, inference and
training), two transitions per cluster size:
  - length-growth: responses grow, generation and inference Merge into larger TP or PP
    groups and training deepens its pipeline (same GPUs);
  - gpu-count: the job doubles its GPUs (N/2 -> N), the paper's scale-up case.
Plans are written as .nir text and parsed, as a user would write them. Each case is
compiled `--repeat` times and the fastest run is reported (per pass and in total).

    python benchmarks/plan_scale.py [--sizes 32,64,...] [--models 8b,70b] [--repeat 3]

Last stdout line: {"name": "plan_scale", "cases": [{"gpus", "model", "transition",
"total_s", "passes": {...}, "ops", "bytes"}, ...], "linearity": {...}}.

Rank programs (issue 19): one rank's JSON program lowered alone from the symbolic program
(`nereus.backends.rank_json`), per case in a fresh process (so that its peak memory is its
own): compile time, per-rank lowering time and size for the first, a middle and the last
rank, the link bounds of the schedule (aggregate and busiest-NIC, `cost.link_bounds`) and
the process's peak RSS. A case is a .nir file (its only transition), or `gen:MODEL:GPUS:
TRANSITION` for the generated PPO plans above (same per-rank shards at every size):

    python benchmarks/plan_scale.py --rank-programs examples/grpo-70b-1024.nir,gen:70b:256:length-growth

Last stdout line: {"name": "plan_scale_rank_programs", "cases": [...]}.

The runtime's per-rank programs (issue 19, nereus.runtime.distribute): every rank does what
`--rank-programs` measures (compile + its own part); rank 0, which proves the program,
also emits the whole program once, verifies it against the plans and cuts every rank's
digest out of it. That extra work of rank 0, in a fresh process (peak memory its own):

    python benchmarks/plan_scale.py --prove gen:70b:256:length-growth

Last stdout line: {"name": "plan_scale_prove", ...}.

ZeRO (issue 19): bytes sent per model-stage by a file's transition as written (`zero 1`)
and with `zero` removed from every placement (compiled with the plan check off, since the
replicated optimizer state may not fit), next to the training optimizer state's size:

    python benchmarks/plan_scale.py --zero-compare examples/grpo-405b-4096.nir
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MODELS = {
    "8b": "layers 32 hidden 4096 heads 32 kv_heads 8 ffn 14336 vocab 128256",
    "70b": "layers 80 hidden 8192 heads 64 kv_heads 8 ffn 28672 vocab 128256",
}

# (generation tp, pp), (inference tp, pp), (training tp, pp) before and after length growth
LAYOUTS = {
    "8b": {"short": ((4, 1), (2, 1), (4, 2)), "long": ((8, 1), (4, 1), (2, 4))},
    "70b": {"short": ((8, 1), (8, 2), (8, 4)), "long": ((8, 2), (8, 4), (8, 8))},
}


def _fit(tp: int, pp: int, gpus: int) -> tuple[int, int]:
    while tp * pp > gpus and pp > 1:  # small clusters: shallower pipelines
        pp //= 2
    return tp, pp


def _stage_lines(gpus: int, layout, offload_all: bool, first_gpu: int = 0) -> list[str]:
    (gen_tp, gen_pp), (inf_tp, inf_pp), (tr_tp, tr_pp) = (_fit(tp, pp, gpus) for tp, pp in layout)
    on = f"on {first_gpu}..{first_gpu + gpus - 1}"
    # 70B: generation and inference state waits in host memory outside its stage
    extra = " offload" if offload_all else ""
    lines = [f"  actor.generation dp {gpus // (gen_tp * gen_pp)} tp {gen_tp} pp {gen_pp} {on}{extra}"]
    for model, offload in (("actor", extra), ("ref", " offload"), ("reward", " offload"), ("critic", extra)):
        lines.append(f"  {model}.inference dp {gpus // (inf_tp * inf_pp)} tp {inf_tp} pp {inf_pp} {on}{offload}")
    for model in ("actor", "critic"):
        lines.append(f"  {model}.training dp {gpus // (tr_tp * tr_pp)} tp {tr_tp} pp {tr_pp} {on}")
    return lines


def nir_source(gpus: int, model: str, transition: str) -> str:
    nodes = gpus // 8
    arch = MODELS[model]
    offload = model == "70b"
    if transition == "length-growth":
        before = _stage_lines(gpus, LAYOUTS[model]["short"], offload)
        after = _stage_lines(gpus, LAYOUTS[model]["long"], offload)
    else:  # gpu-count: the same layout on half the GPUs, then on all of them
        before = _stage_lines(gpus // 2, LAYOUTS[model]["long"], offload)
        after = _stage_lines(gpus, LAYOUTS[model]["long"], offload)
    return "\n".join([
        f"cluster c{gpus} {{ nodes {nodes} gpus_per_node 8 gpu {{ mem 141GB flops 989TFLOPS hbm 4.8TB/s }}",
        "  intra 900GB/s inter 50GB/s host_mem 2TB }",
        f"model actor = llama {{ {arch} }}",
        f"model critic = llama {{ {arch} head value }}",
        "model ref = actor",
        "model reward = critic",
        "workload ppo { batch 1024 prompt 1024 response 4096 microbatch 1 recompute selective",
        "  generation: actor  inference: actor, ref, reward, critic  training: actor, critic }",
        "plan A {", *before, "}",
        "plan B {", *after, "}",
        "transition A -> B",
    ]) + "\n"


def run_case(gpus: int, model: str, transition: str, repeat: int) -> dict:
    from nereus.ir import parse_source
    from nereus.passes import compile_transition

    from nereus.passes.feasibility import check_plan

    module = parse_source(nir_source(gpus, model, transition), f"<plan_scale {gpus} {model} {transition}>")
    for plan in ("A", "B"):
        report = check_plan(module, plan)
        if not report.feasible:  # e.g. 70B PPO's training state alone overflows 16 GPUs
            return {"gpus": gpus, "model": model, "transition": transition, "skipped":
                    f"plan {plan} does not fit: GPU {report.worst.gpu} needs "
                    f"{report.worst.bytes / 2**30:.1f} GiB in {report.worst.stage}"}
    best = None
    for _ in range(repeat):
        start = time.perf_counter()
        compiled = compile_transition(module, "A", "B")
        total = time.perf_counter() - start
        if best is None or total < best[0]:
            best = (total, compiled)
    total, compiled = best
    summary = compiled.summary
    case = {"gpus": gpus, "model": model, "transition": transition, "total_s": round(total, 4),
            "passes": {name: round(seconds, 4) for name, seconds in compiled.timings.items()}}
    for key in ("ops", "rounds", "bytes_total", "bytes_lower_bound"):
        value = getattr(summary, key, None) if not isinstance(summary, dict) else summary.get(key)
        if isinstance(value, (int, float)):
            case[key] = value
    return case


def linearity(cases: list[dict]) -> dict:
    """Growth of compile time from the smallest to the largest size, per (model,
    transition), against the growth in GPUs: a ratio ≤ ~1 means no worse than linear."""
    out = {}
    for key in sorted({(c["model"], c["transition"]) for c in cases if "total_s" in c}):
        series = sorted((c["gpus"], c["total_s"]) for c in cases
                        if (c["model"], c["transition"]) == key and "total_s" in c)
        if len(series) >= 2 and series[0][1] > 0:
            (g0, t0), (g1, t1) = series[0], series[-1]
            out[f"{key[0]}/{key[1]}"] = round((t1 / t0) / (g1 / g0), 3)
    return out


def _rank_case(case: str) -> dict:
    """Compile `case` and lower three rank programs (runs in its own process)."""
    import resource

    from nereus.backends.rank_json import rank_program_json
    from nereus.cli.compile import RANK_PIPELINE
    from nereus.passes import compile_transition
    from nereus.passes.cost import link_bounds

    module = _module_of(case)
    (t,) = module.transitions
    wall, cpu = time.perf_counter(), time.process_time()
    # what `nereusc --emit json --rank R` runs: the plan check and every pass but cost
    compiled = compile_transition(module, t.source, t.target, pipeline=RANK_PIPELINE)
    out = {"case": case, "gpus": module.cluster.num_gpus, "transition": str(t),
           "compile_wall_s": round(time.perf_counter() - wall, 3), "compile_cpu_s": round(time.process_time() - cpu, 3),
           "passes_wall_s": {k: round(v, 3) for k, v in compiled.timings.items()}}
    summary = compiled.summary
    out["bytes_sent"] = summary["bytes"]["intra_node"] + summary["bytes"]["inter_node"]
    out["lower_bound_bytes"] = summary["lower_bound_bytes"]
    out["rounds"], out["messages"] = summary["rounds"], summary["messages"]
    out["bounds"] = link_bounds(compiled.program, compiled.cost).to_json()
    n = module.cluster.num_gpus
    out["ranks"] = []
    for rank in (0, n // 2 + 3, n - 1):
        wall, cpu = time.perf_counter(), time.process_time()
        text = json.dumps(rank_program_json(compiled, rank), separators=(",", ":"))
        out["ranks"].append({"rank": rank, "lower_wall_s": round(time.perf_counter() - wall, 3),
                             "lower_cpu_s": round(time.process_time() - cpu, 3), "bytes": len(text),
                             "ops": text.count('"op":'), "peers": len(json.loads(text)["peers"])})
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def _module_of(case: str):
    from nereus.ir import parse_file, parse_source

    if case.startswith("gen:"):
        _, model, gpus, transition = case.split(":")
        return parse_source(nir_source(int(gpus), model, transition), case)
    return parse_file(case)


def prove_case(case: str) -> dict:
    """Rank 0's extra work in the runtime (module docstring): emit, verify, digest."""
    import resource

    from nereus.backends.json_program import program_json
    from nereus.backends.rank_json import rank_digests
    from nereus.passes import compile_transition
    from nereus.passes.verify import verify_program

    module = _module_of(case)
    (t,) = module.transitions
    compiled = compile_transition(module, t.source, t.target)
    out = {"case": case, "gpus": module.cluster.num_gpus}
    cpu = time.process_time()
    whole = program_json(compiled)
    out["emit_cpu_s"] = round(time.process_time() - cpu, 2)
    out["whole_bytes"] = len(json.dumps(whole, separators=(",", ":")))
    cpu = time.process_time()
    verify_program(whole, against=module)
    out["verify_cpu_s"] = round(time.process_time() - cpu, 2)
    cpu = time.process_time()
    digests = rank_digests(whole)
    out["digests_cpu_s"] = round(time.process_time() - cpu, 2)
    out["digest_bytes_per_rank"] = len(next(iter(digests.values())))
    out["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def zero_compare(path: str) -> dict:
    """Bytes sent per model-stage with and without zero (module docstring)."""
    import dataclasses

    from nereus.ir import parse_file
    from nereus.passes import compile_transition
    from nereus.passes.layout import OPTIMIZER_SUFFIXES, tensor_entries

    module = parse_file(path)
    (t,) = module.transitions
    plain = dataclasses.replace(module, plans=tuple(
        dataclasses.replace(p, placements=tuple(dataclasses.replace(x, zero=0) for x in p.placements),
                            declared=tuple(dataclasses.replace(x, zero=0) for x in p.declared))
        for p in module.plans))
    out = {"file": path, "transition": str(t)}
    for label, m in (("zero", module), ("replicated", plain)):
        cpu = time.process_time()
        compiled = compile_transition(m, t.source, t.target, check_fit=False)
        sent: dict = {}
        for messages in compiled.program.messages:
            for message in messages:
                for x in message.xfers:
                    name = compiled.dag.stages[x.stage].name
                    key = "optimizer" if x.states[0] in OPTIMIZER_SUFFIXES else "weights"
                    if len(x.states) > 1:  # replicated: weights and state move together
                        per = compiled.dag.stages[x.stage].element_bytes
                        sent[f"{name} optimizer"] = sent.get(f"{name} optimizer", 0) + x.bytes * 12 // per
                        key = "weights"
                        sent[f"{name} {key}"] = sent.get(f"{name} {key}", 0) + x.bytes - x.bytes * 12 // per
                        continue
                    sent[f"{name} {key}"] = sent.get(f"{name} {key}", 0) + x.bytes
        summary = compiled.summary
        out[label] = {"bytes_sent": summary["bytes"]["intra_node"] + summary["bytes"]["inter_node"],
                      "lower_bound_bytes": summary["lower_bound_bytes"], "predicted_s": summary["predicted_seconds"],
                      "by_model_stage": sent, "compile_cpu_s": round(time.process_time() - cpu, 2)}
    training = [m for m in module.models if any(ms.stage == "training" and ms.model == m.name
                                                for ms in module.workload.model_stages())]
    out["optimizer_state_bytes"] = {m.name: sum(4 * _numel(shape) for name, shape, _ in
                                                tensor_entries(m, ("",) + OPTIMIZER_SUFFIXES) if "#" in name)
                                    for m in training}
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def rank_programs(cases: list[str]) -> list[dict]:
    """Each case in a fresh interpreter (peak memory per case)."""
    import subprocess

    results = []
    for case in cases:
        done = subprocess.run([sys.executable, __file__, "--rank-case", case], capture_output=True, text=True,
                              check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(result)
        worst = max(result["ranks"], key=lambda r: r["bytes"])
        print(f"{case}: compile {result['compile_cpu_s']:.2f} s CPU ({result['compile_wall_s']:.2f} s wall); rank"
              f" program up to {worst['bytes'] / 1e6:.3f} MB, {max(r['lower_cpu_s'] for r in result['ranks']):.3f}"
              f" s CPU; peak RSS {result['peak_rss_mib']} MiB; predicted {result['bounds']['predicted_s']:.2f} s vs"
              f" busiest NIC {result['bounds']['busiest_nic_s']:.2f} s, aggregate"
              f" {result['bounds']['aggregate_s']:.2f} s", file=sys.stderr, flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-programs", metavar="CASES", help="comma-separated .nir files or gen:MODEL:GPUS:T")
    parser.add_argument("--rank-case", help=argparse.SUPPRESS)
    parser.add_argument("--prove", metavar="CASE", help="rank 0's proof of the whole program: emit, verify, digest")
    parser.add_argument("--zero-compare", metavar="FILE", help="bytes sent with and without zero")
    parser.add_argument("--sizes", default="32,64,128,256,512,1024")
    parser.add_argument("--models", default="8b,70b")
    parser.add_argument("--transitions", default="length-growth,gpu-count")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if args.rank_case:
        print(json.dumps(_rank_case(args.rank_case)))
        return 0
    if args.prove:
        print(json.dumps({"name": "plan_scale_prove", **prove_case(args.prove)}))
        return 0
    if args.zero_compare:
        print(json.dumps({"name": "plan_scale_zero", **zero_compare(args.zero_compare)}))
        return 0
    if args.rank_programs:
        print(json.dumps({"name": "plan_scale_rank_programs", "cases": rank_programs(args.rank_programs.split(","))}))
        return 0
    cases = []
    for model in args.models.split(","):
        for transition in args.transitions.split(","):
            for gpus in (int(s) for s in args.sizes.split(",")):
                case = run_case(gpus, model, transition, args.repeat)
                cases.append(case)
                if "skipped" in case:
                    print(f"{model:>4} {transition:<13} {gpus:>5} GPUs  skipped: {case['skipped']}",
                          file=sys.stderr, flush=True)
                    continue
                passes = " ".join(f"{k}={v:.3f}" for k, v in case["passes"].items())
                print(f"{model:>4} {transition:<13} {gpus:>5} GPUs  total {case['total_s']:.3f} s  [{passes}]",
                      file=sys.stderr, flush=True)
    print(json.dumps({"name": "plan_scale", "cases": cases, "linearity": linearity(cases)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
