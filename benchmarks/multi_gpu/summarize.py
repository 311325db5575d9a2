"""Summary of a run_all.sh run: reads the JSON files it left, prints one table per
script, writes summary.json beside them. Imports neither torch nor nereus.

    python3 benchmarks/multi_gpu/summarize.py OUT/multi_gpu
"""

from __future__ import annotations

import glob
import json
import os
import sys


def _s(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _x(x) -> str:
    return "-" if x is None else f"{x:.1f}x"


def load(folder: str) -> dict:
    out = {}
    paths = sorted(glob.glob(os.path.join(folder, "*.json")) + glob.glob(os.path.join(folder, "*.json.partial")))
    for path in paths:
        base = os.path.basename(path)
        key = base[:-5] if base.endswith(".json") else base[:-len(".json.partial")] + " (partial)"
        if base == "summary.json" or (base.endswith(".partial") and os.path.exists(path[:-len(".partial")])):
            continue  # a finished run's partial file is superseded by its JSON
        try:
            with open(path) as f:
                out[key] = json.load(f)
        except (OSError, ValueError) as error:
            out[key] = {"error": str(error)}
    return out


def lines(results: dict, steps: dict) -> list:
    text = []
    for step, status in steps.items():
        text.append(f"{step:28s} {status}")
    text.append("")
    for key, r in results.items():
        name = r.get("name", key)
        if name == "multi_gpu_correctness":
            text.append(f"{key}: {'PASSED' if r['passed'] else 'FAILED'} on {r['gpus']} x {r['device']} ({r['backend']})")
            for s in r["scenarios"]:
                text.append(f"  {s['scenario']:10s} {s['transitions']} transitions, up to {s['rounds_max']} rounds, "
                            f"{s['bytes_sent'] / 1e9:.2f} GB sent, fault rollback {'ok' if s['fault_ok'] else 'FAILED'}, "
                            f"{'passed' if s['passed'] else 'FAILED'}; coverage {s['coverage']}")
        elif name == "multi_gpu_reshard":
            bw = r["bandwidth"]
            text.append(f"{key}: {r['gpus']} x {r.get('device', '?')}, p2p {_s(bw['p2p_GBps'], 1)} GB/s, "
                        f"ring {_s(bw['ring_GBps'], 1)} GB/s per GPU; verified {r.get('verified')}")
            text.append("  case          models        layers  state GB  warm s  cold s  prepared s  link bound s  "
                        "warm/bound  gather-scatter s  dcp subset s  dcp extrap s  bound s  par.bound s  paper s")
            for c in r["cases"]:
                text.append(f"  {c['case']:13s} {'+'.join(c['models']):13s} {c['layers']:6d}  "
                            f"{c['state_bytes'] / 1e9:8.1f}  {_s(c['nereus_s']):>6s}  {_s(c.get('nereus_cold_s')):>6s}  "
                            f"{_s(c.get('nereus_prepared_s')):>10s}  {_s(c.get('bound_link_s')):>12s}  "
                            f"{_x(c.get('nereus_over_bound_link')):>10s}  "
                            f"{_s(c.get('gather_scatter_s')):>16s}  {_s(c.get('dcp_s'), 2):>12s}  "
                            f"{_s(c.get('dcp_s_extrapolated'), 1):>12s}  {_s(c['bound_s']):>7s}  "
                            f"{_s(c['bound_parallel_s']):>11s}  {_s(c.get('paper_s'), 2):>7s}"
                            f"{'' if c.get('verified', c.get('verified_nereus')) else '  NOT VERIFIED'}")
                if c.get("modes"):
                    text.append("    rollback modes (warm s): " + ", ".join(
                        f"{m} {_s(v['wall_s'])} (parked {v['parked_bytes'] / 1e9:.1f} GB, held "
                        f"{v['held_bytes'] / 1e9:.1f} GB)" for m, v in c["modes"].items()))
                for key_, value in c.items():
                    if key_.endswith("_error"):
                        text.append(f"    {key_}: {value}")
        elif name == "multi_gpu_weight_sync":
            text.append(f"{key}: {r['gpus']} x {r['device']}, {r['shape']['layers']} layers; verified {r['verified']}")
            for c in r["cases"]:
                if "nereus_cold_s" in c:
                    nereus = f"nereus {_s(c['nereus_s'] * 1e3, 1)} ms (cold {_s(c['nereus_cold_s'] * 1e3, 1)})"
                else:  # JSON before 2026-12-02: nereus_s was the executor's time, nereus_wall_s the call's
                    nereus = (f"nereus {_s(c['nereus_wall_s'] * 1e3, 1)} ms per call "
                              f"(executor {_s(c['nereus_s'] * 1e3, 1)}; ratios against the executor)")
                text.append(f"  {c['case']:28s} {nereus}, "
                            f"gather-push {_s(c['gather_push_s'] * 1e3, 1)} ms "
                            f"({_x(c.get('gather_push_over_nereus'))}), bound {_s((c['bound_s'] or 0) * 1e3, 1)} ms, "
                            f"parallel bound {_s((c['bound_parallel_s'] or 0) * 1e3, 1)} ms, "
                            f"{c['bytes_moved'] / 1e9:.2f} GB moved")
        elif name == "multi_gpu_dtensor":
            text.append(f"{key}: {r['gpus']} x {r['device']}, {r['shape']['layers']} layers, "
                        f"{r['weight_bytes'] / 1e9:.2f} GB of bf16 weights; verified {r['verified']}; Nereus first call "
                        f"after prepare {_s(r['nereus_prepared_s'] * 1e3, 1)} ms, cold {_s(r['nereus_cold_s'] * 1e3, 1)} ms")
            for case, c in r["cases"].items():
                text.append(f"  {case:6s} nereus {_s(c['nereus_s'] * 1e3, 1)} ms, dtensor {c['dtensor']} "
                            f"{_s(c['dtensor_s'] * 1e3, 1)} ms ({_x(c.get('dtensor_over_nereus'))}), bound "
                            f"{_s((c['bound_s'] or 0) * 1e3, 1)} ms, {c['bytes_moved'] / 1e9:.2f} GB moved")
        elif name == "failure":
            text.append(f"{key}: {r}")
        elif name == "offload_check":
            bw = r.get("bandwidth_gbps", {})
            text.append(f"{key}: {'PASSED' if r['passed'] else 'FAILED'} on {r['gpus']} x {r['device']}, PCIe h2d "
                        f"{_s(bw.get('h2d'), 1)} GB/s, d2h {_s(bw.get('d2h'), 1)} GB/s; problems {r.get('problems')}")
            last = max((t["repeat"] for t in r["transitions"]), default=0)
            for t in r["transitions"]:
                if t["repeat"] == last:
                    text.append(f"  {t['from']} -> {t['to']} (warm) {_s(t['seconds'] * 1e3, 1)} ms, PCIe bound "
                                f"{_s(t['pcie_bound_s'] * 1e3, 1)} ms ({_x(t.get('seconds_over_bound'))}), "
                                f"{t['offload_bytes_max_rank'] / 1e9:.2f} GB on the busiest rank")
        elif name == "multi_gpu_moe_reshard":
            bw = r["bandwidth"]
            text.append(f"{key}: {r['gpus']} x {r['device']}, {r['shape']['layers']} layers, p2p "
                        f"{_s(bw['p2p_GBps'], 1)} GB/s; verified {r['verified']}")
            for c in r["cases"]:
                text.append(f"  {c['case']:14s} warm {_s(c['nereus_s'] * 1e3, 1)} ms (back "
                            f"{_s(c['nereus_reverse_s'] * 1e3, 1)}), cold {_s(c['nereus_cold_s'] * 1e3, 1)} ms, link "
                            f"bound {_s((c['bound_link_s'] or 0) * 1e3, 1)} ms ({_x(c.get('nereus_over_bound_link'))}), "
                            f"{c['bytes_moved'] / 1e9:.2f} GB moved")
        elif name == "multi_gpu_variants":
            text.append(f"{key}: {r['gpus']} x {r.get('backend')}, {r['repeats']} repeats; bounds "
                        + ", ".join(f"{case} {_s(v * 1e3, 2)} ms" for case, v in r["bounds_s"].items())
                        + f"; verified {_passed(r)}")
            for variant, cases in r["medians_s"].items():
                text.append(f"  {variant:18s} " + ", ".join(
                    f"{case} {_s(v * 1e3, 1)} ms ({_x(r['over_bound'][variant].get(case))})" for case, v in cases.items()))
        else:
            text.append(f"{key}: {r}")
    return text


def _passed(r: dict) -> bool:
    """A result's own verdict: its `passed`, else its `verified` (every entry true where it
    is a table of them, as in variants.py's per variant and case)."""
    if "passed" in r:
        return bool(r["passed"])

    def every(v) -> bool:
        return all(every(x) for x in v.values()) if isinstance(v, dict) else bool(v)

    return every(r.get("verified", False))


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Summarize a run_all.sh output folder: a table per script, "
                                                 "summary.json, and one JSON line last.")
    parser.add_argument("folder", help="the folder run_all.sh wrote (its *.json and steps.txt)")
    folder = parser.parse_args(sys.argv[1:] if argv is None else argv).folder
    steps = {}
    status_path = os.path.join(folder, "steps.txt")
    if os.path.exists(status_path):
        for line in open(status_path):
            if line.strip():
                step, _, status = line.strip().partition(" ")
                steps[step] = status
    results = load(folder)
    if steps:  # this run's steps only: steps.txt starts afresh, an earlier run's JSON stays
        results = {k: r for k, r in results.items() if k.removesuffix(" (partial)") in steps}
    text = lines(results, steps)
    print("\n".join(text))
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump({"steps": steps, "results": results}, f)
    complete = bool(steps) and all(status.startswith("rc=0") for status in steps.values())
    checked = bool(results) and all(_passed(r) for r in results.values())
    passed = complete and checked
    print(json.dumps({"name": "multi_gpu_run_all", "steps": steps, "complete": complete, "passed": passed}))
    return 0 if passed else 1  # (a script's `&&` must not go on after a failed or missing step)


if __name__ == "__main__":
    sys.exit(main())
