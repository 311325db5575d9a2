"""How little of a run can transitions take, and at what total time? A priced-moves DP.

    PYTHONPATH=. python benchmarks/controller_share_floor.py [TRACE ...]

For each trace: replays it like `controller_simulate.py` (the same candidate set C: every
plan a policy ran ∪ the search's optima under the truth), then runs the DP oracle with every
move priced (1 + λ)× its true seconds for λ on a grid, and scores each optimal sequence at
the true prices. λ = 0 is the least-total-time oracle; growing λ trades step time for fewer
or cheaper moves. Printed per λ: total s, transition s, share, moves, and the gap of the
total to the oracle's. The least total whose share is below `--share` (0.1%) answers "what
would meeting the share target cost" over C, under the simulator's move model; pricing finds
only some of the trade-offs, so it is bracketed by a bound that holds for every sequence over
C: total + λ·moves ≥ T_λ + λ·M_λ for the λ-optimal (T_λ, M_λ), and moves < share·total give
total ≥ (T_λ + λ·M_λ) / (1 + λ·share), the largest over the grid. Writes
OUT/controller_share_floor_<trace>.json (OUT: benchmarks/data unless --out); last stdout
line: one JSON object, per trace the oracle's and Nereus' figures and the bound.
"""

import argparse
import json
import os
import platform
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from nereus.controller import simulator  # noqa: E402
from nereus.controller.oracle import dp_oracle  # noqa: E402

TRACES = ("gpu-supply-64", "mixed-noisy-64", "mixed-noisy-64-seed101")
PRICES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 40.0, 48.0, 64.0, 96.0, 128.0, 1024.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("traces", nargs="*", default=TRACES)
    parser.add_argument("--share", type=float, default=0.001)
    parser.add_argument("--out", default=os.path.join(HERE, "data"), help="folder of the per-trace JSON")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    summaries = {}
    for name in args.traces:
        trace = simulator.load_trace(os.path.join(os.path.dirname(HERE), "examples", "traces", f"{name}.json"))
        worlds = []
        original = simulator._World.__init__

        def keep(self, *a, **k):  # the replay's world: its candidate set and true prices
            original(self, *a, **k)
            worlds.append(self)

        simulator._World.__init__ = keep
        try:
            result = simulator.simulate(trace)
        finally:
            simulator._World.__init__ = original
        world = worlds[0]
        start = world.add(trace.module.plan(trace.plan))
        oracle, step_s = simulator._oracle(world, trace, start, None)
        count = len(world.plans)
        moves = np.array([[world.move(a, b) for b in range(count)] for a in range(count)])
        rows = []
        for price in PRICES:
            best = dp_oracle(step_s, moves * (1.0 + price), start)
            run = float(sum(step_s[t, c] for t, c in enumerate(best.path)))
            previous = (start,) + best.path[:-1]
            spent = float(sum(moves[a, b] for a, b in zip(previous, best.path) if a != b))
            rows.append({"price": price, "total_s": run + spent, "transition_s": spent,
                         "share": spent / (run + spent), "transitions": best.transitions,
                         "gap_to_oracle": (run + spent) / oracle.total_s - 1})
        under = [r for r in rows if r["share"] < args.share]
        cheapest = min(under, key=lambda r: r["total_s"]) if under else None
        bound = max((r["total_s"] + r["price"] * r["transition_s"]) / (1.0 + r["price"] * args.share) for r in rows)
        nereus = result["policies"]["nereus"]
        out = {"trace": f"examples/traces/{name}.json", "share_target": args.share,
               "command": f"PYTHONPATH=. python benchmarks/controller_share_floor.py {name}",
               "machine": f"2-core CPU dev box ({platform.machine()})", "candidates": count,
               "oracle_total_s": oracle.total_s, "nereus_total_s": nereus["total_s"],
               "nereus_share": nereus["transition_share"], "priced": rows, "least_total_under_target": cheapest,
               "total_bound_under_target": bound, "bound_gap_to_oracle": bound / oracle.total_s - 1}
        with open(os.path.join(args.out, f"controller_share_floor_{name}.json"), "w") as handle:
            json.dump(out, handle, indent=1)
            handle.write("\n")
        print(name, f"oracle {oracle.total_s:.1f} s, nereus {nereus['total_s']:.1f} s "
              f"(share {100 * nereus['transition_share']:.3f}%)")
        for r in rows:
            print(f"  λ={r['price']:<7g} total {r['total_s']:.1f} s  transitions {r['transition_s']:.2f} s "
                  f"share {100 * r['share']:.3f}%  moves {r['transitions']}  vs oracle {100 * r['gap_to_oracle']:+.3f}%")
        print("  least total with share <", f"{100 * args.share:g}%:",
              "none on the grid" if cheapest is None else
              f"{cheapest['total_s']:.1f} s ({100 * cheapest['gap_to_oracle']:+.3f}% vs oracle);",
              f"every sequence with that share takes ≥ {bound:.1f} s ({100 * (bound / oracle.total_s - 1):+.3f}%)",
              flush=True)
        summaries[name] = {k: out[k] for k in ("oracle_total_s", "nereus_total_s", "nereus_share",
                                               "least_total_under_target", "total_bound_under_target",
                                               "bound_gap_to_oracle")}
    print(json.dumps({"name": "controller_share_floor", "share_target": args.share, "out": args.out,
                      "traces": summaries}))


if __name__ == "__main__":
    main()
