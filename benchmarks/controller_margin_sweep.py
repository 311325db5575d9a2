"""Sensitivity of the Nereus policy to the admission margin on a drift trace.

    PYTHONPATH=. python benchmarks/controller_margin_sweep.py [TRACE] [--margins 0,0.1,0.3,0.5,0.8,0.95]

For each margin: Nereus' mean step latency, transitions, transition share and gap to the
oracle (the fixed, greedy and oracle policies do not depend on the margin and are reported
once). Transition costs use the bytes/bandwidth estimate (--compile to use the compiler's).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os

from nereus.controller.simulator import load_trace, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace", nargs="?", default=os.path.join(ROOT, "examples", "traces", "gpu-supply-64.json"))
    parser.add_argument("--margins", default="0,0.1,0.3,0.5,0.8,0.95")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    method = "compile" if args.compile else "estimate"
    rows = {}
    baselines = None
    for margin in [float(x) for x in args.margins.split(",")]:
        policies = ("nereus",) if baselines else ("fixed", "greedy", "nereus", "oracle")
        result = simulate(trace, margin=margin, policies=policies + (("oracle",) if baselines else ()),
                          transition_method=method)
        if baselines is None:
            baselines = {k: v for k, v in result["policies"].items() if k != "nereus"}
        n = result["policies"]["nereus"]
        gap = n["gap_to_oracle"]  # total time (steps + transitions) over the DP oracle's, − 1
        rows[str(margin)] = {"mean_step_s": round(n["mean_step_s"], 4), "transitions": n["transitions"],
                             "transition_share": round(n["transition_share"], 6),
                             "gap_to_oracle": None if gap is None else round(gap, 5)}
        print(f"margin {margin:4.2f}: nereus mean {n['mean_step_s']:.2f} s, {n['transitions']} transitions, "
              f"share {100 * n['transition_share']:.3f}%, gap to oracle {rows[str(margin)]['gap_to_oracle']}")
    print(json.dumps({"name": "controller_margin_sweep", "trace": os.path.relpath(args.trace, ROOT),
                      "transition_cost": method, "nereus_by_margin": rows,
                      "baselines": {k: {"mean_step_s": round(v["mean_step_s"], 4), "transitions": v["transitions"]}
                                    for k, v in baselines.items()}}))


if __name__ == "__main__":
    main()
