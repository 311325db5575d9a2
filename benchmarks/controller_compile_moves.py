"""Compile time of the moves a controller estimates on a trace, pass by pass, with rounds.

    PYTHONPATH=. python benchmarks/controller_compile_moves.py [TRACE] [--repeat 3] [--policy nereus]

Replays TRACE under one policy (no oracle) and records every transition the controller
estimates by compiling it (`transition_cost.compiled_seconds`); then compiles each again
`--repeat` times and prints, per move, the fastest CPU seconds of the whole compile, the
fastest wall seconds of its `resources` pass, the schedule's rounds, transfers and chunked transfers, and the predicted
seconds. Run it with PYTHONPATH pointing at another checkout to compare two versions of the
passes on the same moves (the moves depend on the controller, so compare trees that decide
alike).
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.dirname(HERE))

import nereus.controller.transition_cost as transition_cost  # noqa: E402
from nereus.controller.simulator import load_trace, simulate  # noqa: E402
from nereus.passes import compile_transition  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace", nargs="?", default="length-growth-noisy-1024")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--policy", default="nereus", choices=("nereus", "greedy"))
    args = parser.parse_args()
    moves = []
    original = transition_cost.compiled_seconds

    def record(module, workload, source, target):
        moves.append(transition_cost._pair_module(module, workload, source, target))
        return original(module, workload, source, target)

    transition_cost.compiled_seconds = record
    root = os.path.dirname(HERE)
    simulate(load_trace(os.path.join(root, "examples", "traces", f"{args.trace}.json")), policies=(args.policy,))
    transition_cost.compiled_seconds = original
    rows = []
    for module in moves:
        best = best_resources = None
        for _ in range(args.repeat):
            began = time.process_time()
            compiled = compile_transition(module, "current", "candidate", check_fit=False)
            spent = time.process_time() - began
            best = spent if best is None else min(best, spent)
            resources = compiled.timings.get("resources", 0.0)
            best_resources = resources if best_resources is None else min(best_resources, resources)
        schedule = compiled.state.schedule
        rows.append({"cpu_s": round(best, 3), "resources_s": round(best_resources, 3),
                     "rounds": len(schedule.rounds), "transfers": sum(len(r.xfers) for r in schedule.rounds),
                     "chunked": schedule.chunked, "predicted_s": round(float(compiled.cost.seconds), 4)})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"trace": args.trace, "policy": args.policy, "moves": len(rows),
                      "cpu_s": round(sum(r["cpu_s"] for r in rows), 2),
                      "resources_s": round(sum(r["resources_s"] for r in rows), 2),
                      "rounds": sum(r["rounds"] for r in rows)}))


if __name__ == "__main__":
    main()
