"""Replay drift traces under fixed, greedy, Nereus and the DP oracle; write one JSON per trace.

    PYTHONPATH=. python benchmarks/controller_simulate.py [TRACE ...] [--full DIR]
    PYTHONPATH=. python benchmarks/controller_simulate.py gpu-supply-64 --margin 0.3 --out /tmp/m03

Writes OUT/controller_simulate_<trace>.json (OUT: benchmarks/data unless --out): the
per-policy summary (steps_run, failed_at, mean step s, total s, transitions, transition s
and share, gap to the oracle, controller CPU ms per step), every transition with its
reason, the oracle's candidate count, the command and the machine. With --full DIR, also
the whole result (per-step rows, Nereus' decisions) to DIR/<trace>.full.json. Margin
sensitivity: one run per --margin, each with its own --out. Last stdout line: one JSON
object, every trace's per-policy summary.
"""

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from nereus.controller.simulator import load_trace, simulate  # noqa: E402

TRACES = ("gpu-supply-64", "mixed-noisy-64", "length-growth-1024", "length-growth-noisy-1024",
          "length-growth-1024-safe", "mixed-noisy-64-seed101", "length-growth-noisy-1024-seed101")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("traces", nargs="*", default=TRACES)
    parser.add_argument("--full", help="directory for the whole results")
    parser.add_argument("--margin", type=float, default=0.1)
    parser.add_argument("--out", default=os.path.join(HERE, "data"), help="folder of the per-trace JSON")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    summaries = {}
    for name in args.traces:
        path = os.path.join(os.path.dirname(HERE), "examples", "traces", f"{name}.json")
        began, cpu = time.perf_counter(), time.process_time()
        result = simulate(load_trace(path), margin=args.margin,
                          progress=lambda phase, done, total: done == total and print(f"  {name}: {phase} done",
                                                                                      file=sys.stderr))
        out = {"trace": f"examples/traces/{name}.json", "margin": args.margin,
               "command": f"PYTHONPATH=. python benchmarks/controller_simulate.py {name}",
               "machine": f"2-core CPU dev box ({platform.machine()}), shared with other jobs",
               "wall_s": time.perf_counter() - began, "cpu_s": time.process_time() - cpu,
               "policies": result["policies"], "oracle": result["oracle"], "transitions": result["transitions"],
               "searches": result["searches"]}
        with open(os.path.join(args.out, f"controller_simulate_{name}.json"), "w") as handle:
            json.dump(out, handle, indent=1)
            handle.write("\n")
        if args.full:
            with open(os.path.join(args.full, f"{name}.full.json"), "w") as handle:
                json.dump(result, handle)
        summaries[name] = {k: {m: round(v, 4) if isinstance(v, float) else v for m, v in s.items()
                               if m in ("steps_run", "failed_at", "mean_step_s", "total_s", "transitions",
                                        "transition_share", "gap_to_oracle", "controller_ms_per_step",
                                        "controller_transition_ms_per_step", "searches", "failed_attempts")}
                           for k, s in result["policies"].items()}
        print(name, json.dumps(summaries[name]), flush=True)
    print(json.dumps({"name": "controller_simulate", "margin": args.margin, "out": args.out, "traces": summaries}))


if __name__ == "__main__":
    main()
