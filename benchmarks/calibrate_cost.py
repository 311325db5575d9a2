"""Calibrate the transition cost model on device measurements; predict refits at scale.

    PYTHONPATH=. python benchmarks/calibrate_cost.py \
        [--data benchmarks/data/multi_gpu_h200x2_2026-11-30_merged3] [--join | --no-join] \
        [--predict examples/moe-235b-256.nir,examples/moe-dsv3-256.nir] [--out FILE]

Fit. Every measured warm transition of `reshard.json` (dense 8B layers, actor and critic
with Adam) and `moe_reshard_6l.json` (Qwen3-30B-A3B, 6 layers, EP <-> TP/DP) is rebuilt
from the benchmark scripts' own plan sources and compiled here; then

    measured seconds = link_s + piece_s * pieces + fixed_s

where link_s = the busiest rank's bytes / the P2P bandwidth measured in that run, and
pieces = the busiest GPU's pieces (`cost.pieces_per_gpu`: sent, received and copied) as
the runtime that was measured lowered them: `--no-join` (default) for runs made before
the runtime joined the parts of a tensor moving whole (the 2026-11-30 data), `--join` for
later runs. piece_s and fixed_s come from a least-squares fit (non-negative). The link
term is not fitted: it is the measured bandwidth.

Predict. Each `--predict` file's transition is compiled (timed), and its default estimate
(the cluster's declared constants) and calibrated estimate (`cost.Calibration`: measured
per-direction NVLink bandwidth for intra-node sends, the fitted piece_s and fixed_s, the
runtime's current piece count) are reported with the bytes against the lower bound.
Inter-node bandwidth was not measured (the data come from 2 GPUs of one host): it stays
the file's declared `inter`; `--inter` adds the prediction at other per-node figures.

Last stdout line: one JSON object {"fit": {...}, "cases": [...], "predictions": [...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "multi_gpu"))

DATA = os.path.join(HERE, "data", "multi_gpu_h200x2_2026-11-30_merged3")


def _compile(module, source: str, target: str):
    from nereus.passes import compile_transition

    started = time.perf_counter()
    compiled = compile_transition(module, source, target)
    return compiled, time.perf_counter() - started


def _busiest_pieces(program, join: bool) -> int:
    from nereus.passes.cost import pieces_per_gpu

    totals: dict = {}
    for counts in pieces_per_gpu(program, join):
        for g, n in counts.items():
            totals[g] = totals.get(g, 0) + n
    return max(totals.values(), default=0)


def dense_cases(data: dict, join: bool) -> list:
    """reshard.json's cases rebuilt: the models (actor and critic, or the actor alone)
    are the ones whose state size matches the measured case's."""
    import nereus.ir as ir
    import reshard
    from nereus.runtime.runtime import tensor_specs

    world, mem = data["gpus"], data["machine"]["gpu_mem_bytes"]
    out = []
    for case in data["cases"]:
        a, b = reshard.case_plans(case["case"], world)
        for models in (("actor", "critic"), ("actor",)):
            module = ir.parse_source(reshard.module_source(world, mem, data["shape"], case["layers"], models, a, b),
                                     f"{case['case']}.nir")
            size = 0
            for m in models:
                for name, (shape, dtype) in tensor_specs(module, f"{m}.training").items():
                    n = 1
                    for d in shape:
                        n *= d
                    size += 0 if name.endswith("#step") else n * dtype.itemsize
            if size == case["state_bytes"]:
                break
        else:
            raise SystemExit(f"{case['case']}: no model set gives the measured state of {case['state_bytes']} bytes")
        out.append(_case("dense " + case["case"], module, case, data["bandwidth"], join))
    return out


def moe_cases(data: dict, join: bool) -> list:
    import nereus.ir as ir
    import moe_reshard

    world, mem = data["gpus"], data["machine"]["gpu_mem_bytes"]
    out = []
    for case in data["cases"]:
        source = moe_reshard.module_source(case["case"], world, mem, data["shape"], case["layers"])
        out.append(_case("moe " + case["case"], ir.parse_source(source, f"{case['case']}.nir"), case,
                         data["bandwidth"], join))
    return out


def _case(label: str, module, case: dict, bandwidth: dict, join: bool) -> dict:
    compiled, _ = _compile(module, "A", "B")
    return {"case": label, "measured_s": case["nereus_s"], "bytes_busiest_link": case["bytes_busiest_link"],
            "link_s": case["bytes_busiest_link"] / (bandwidth["p2p_GBps"] * 1e9),
            "pieces": _busiest_pieces(compiled.program, join), "p2p_GBps": bandwidth["p2p_GBps"],
            "bytes_sent_compiled": compiled.cost.bytes_intra + compiled.cost.bytes_inter}


def fit(cases: list) -> dict:
    """Non-negative least squares of (measured - link) on (pieces, 1)."""
    import numpy as np

    y = np.array([c["measured_s"] - c["link_s"] for c in cases])
    columns = {"piece_s": np.array([float(c["pieces"]) for c in cases]), "fixed_s": np.ones(len(cases))}
    names = list(columns)
    while True:
        x = np.stack([columns[n] for n in names], axis=1)
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        if (coef >= 0).all() or len(names) == 1:
            break
        names.pop(int(np.argmin(coef)))  # a negative term is dropped (held at 0) and the rest refitted
    values = {n: 0.0 for n in columns}
    values.update({n: float(max(c, 0.0)) for n, c in zip(names, coef)})
    for c in cases:
        c["fitted_s"] = c["link_s"] + values["piece_s"] * c["pieces"] + values["fixed_s"]
        c["fitted_over_measured"] = c["fitted_s"] / c["measured_s"]
    return values


def _with_inter(text: str, inter_gbps: float) -> str:
    return re.sub(r"\binter\s+[0-9.]+\s*[GMT]B/s", f"inter {inter_gbps:g}GB/s", text, count=1)


def predict(path: str, calibration, inter: list) -> dict:
    """Compile the file's transition (timed) and predict it, default and calibrated."""
    import nereus.ir as ir
    from nereus.models.tensors import parameter_count
    from nereus.passes.cost import estimate, link_bounds

    text = open(path).read()
    module = ir.parse_source(text, path)
    (transition,) = module.transitions
    compiled, seconds = _compile(module, transition.source, transition.target)
    cost = compiled.cost
    program = compiled.program
    calibrated = calibration.estimate(program)
    out = {"file": path, "gpus": module.cluster.num_gpus, "parameters": {m.name: parameter_count(m) for m in
                                                                          module.models},
           "compile_s": seconds, "rounds": program.num_rounds, "messages": cost.messages,
           "bytes_sent": cost.bytes_intra + cost.bytes_inter, "bytes_intra": cost.bytes_intra,
           "bytes_inter": cost.bytes_inter, "bytes_local_copy": cost.bytes_local, "lower_bound_bytes": cost.lower_bound,
           "sent_over_lower_bound": (cost.bytes_intra + cost.bytes_inter) / cost.lower_bound,
           "pieces_busiest_gpu": calibrated.pieces, "peak_bytes": cost.peak.bytes if cost.peak else None,
           "inter_GBps_declared": module.cluster.inter_bytes_per_s / 1e9,
           "predicted_default_s": cost.seconds, "busiest_nic_s": link_bounds(program, cost).busiest_nic_seconds,
           "predicted_calibrated_s": calibrated.seconds,
           "predicted_calibrated_no_piece_term_s": estimate(program, message_latency_s=0.0,
                                                            intra_bytes_per_s=calibration.intra_bytes_per_s,
                                                            fixed_s=calibration.fixed_s).seconds,
           "at_inter": []}
    for gbps in inter:
        other = ir.parse_source(_with_inter(text, gbps), path)
        again, _ = _compile(other, transition.source, transition.target)
        out["at_inter"].append({"inter_GBps": gbps, "rounds": again.program.num_rounds,
                                "predicted_default_s": again.cost.seconds,
                                "predicted_calibrated_s": calibration.estimate(again.program).seconds})
    return out


def main(argv=None) -> int:
    from nereus.passes.cost import Calibration

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--join", action=argparse.BooleanOptionalAction, default=False,
                        help="the measured runtime joined a tensor's parts (runs after 2026-11-30)")
    parser.add_argument("--predict", default="", help="comma-separated .nir files with one transition each")
    parser.add_argument("--inter", default="", help="comma-separated per-node inter-node GB/s to predict at too")
    parser.add_argument("--out", default=None, help="also write the JSON object here")
    args = parser.parse_args(argv)

    load = lambda name: json.load(open(os.path.join(args.data, name)))  # noqa: E731
    dense, moe = load("reshard.json"), load("moe_reshard_6l.json")
    cases = dense_cases(dense, args.join) + moe_cases(moe, args.join)
    values = fit(cases)
    p2p = [dense["bandwidth"]["p2p_GBps"], moe["bandwidth"]["p2p_GBps"]]
    calibration = Calibration(intra_bytes_per_s=min(p2p) * 1e9, piece_s=values["piece_s"], fixed_s=values["fixed_s"],
                              source=f"{os.path.relpath(args.data)}: {len(cases)} warm transitions on 2 H200s")
    for c in cases:
        print(f"{c['case']:>24}: measured {c['measured_s'] * 1e3:8.1f} ms, link {c['link_s'] * 1e3:7.1f} ms, "
              f"{c['pieces']:6d} pieces -> fitted {c['fitted_s'] * 1e3:8.1f} ms ({c['fitted_over_measured']:.2f}x)")
    print(f"fit: piece_s {values['piece_s'] * 1e6:.1f} us, fixed_s {values['fixed_s'] * 1e3:.2f} ms, "
          f"NVLink {min(p2p):.0f} GB/s per direction (measured)")
    predictions = []
    inter = [float(v) for v in args.inter.split(",") if v]
    for path in [p for p in args.predict.split(",") if p]:
        got = predict(path, calibration, inter)
        predictions.append(got)
        print(f"{path}: compile {got['compile_s']:.2f} s, {got['rounds']} rounds, sent {got['bytes_sent'] / 1e12:.3f} TB "
              f"({got['sent_over_lower_bound']:.4f}x the lower bound), {got['pieces_busiest_gpu']} pieces on the "
              f"busiest GPU; predicted {got['predicted_default_s']:.2f} s default, "
              f"{got['predicted_calibrated_s']:.2f} s calibrated "
              f"({got['predicted_calibrated_no_piece_term_s']:.2f} s without the piece term)")
        for row in got["at_inter"]:
            print(f"    at inter {row['inter_GBps']:g} GB/s per node: {row['rounds']} rounds, "
                  f"{row['predicted_default_s']:.2f} s default, {row['predicted_calibrated_s']:.2f} s calibrated")
    result = {"name": "calibrate_cost", "data": os.path.relpath(args.data), "join": args.join,
              "fit": dict(values, intra_GBps=min(p2p), source=calibration.source), "cases": cases,
              "predictions": predictions}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
