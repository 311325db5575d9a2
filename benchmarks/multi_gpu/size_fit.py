"""Fixed cost and bandwidth of Nereus and DTensor from runs of dtensor_compare.py at
several sizes: fits time = fixed_s + bytes / GBps by least squares over the runs, per
method and case, and says from which size each method is within 1.2x of the bound.

    for L in 2 4 8 16 32; do torchrun --nproc-per-node 2 benchmarks/multi_gpu/dtensor_compare.py \
        --layers $L --repeats 11 --json-out OUT/dtensor_L$L.json; done
    python3 benchmarks/multi_gpu/size_fit.py OUT/dtensor_L*.json

Why: a transition pays host work (round setup, the agreements on the control group, the
report) that does not grow with the bytes; at a few GB over NVLink (~8 ms at 5.6 GB) a
millisecond of it is already 1.13x. The fit separates the two, for both methods.
Imports neither torch nor nereus. Last stdout line: one JSON object.
"""

from __future__ import annotations

import json
import sys


def fit(points: list) -> dict:
    """Least squares of seconds = a + b * bytes over (bytes, seconds) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if n < 2 or sxx == 0:
        return {"fixed_s": None, "GBps": None, "points": n}
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - b * mx
    return {"fixed_s": a, "GBps": (1 / b) / 1e9 if b > 0 else None, "points": n}


def within(fixed_s: float, GBps: float, link_GBps: float, ratio: float = 1.2):
    """Bytes from which fixed + bytes/GBps <= ratio * bytes/link (None: never)."""
    slack = ratio / link_GBps - 1 / GBps  # seconds per GB of slack
    if slack <= 0:
        return None
    return max(fixed_s, 0.0) / slack * 1e9


def main(paths: list) -> dict:
    rows = []
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        link = run["bandwidth"].get("p2p_GBps")
        for case, c in run["cases"].items():
            rows.append({"file": path, "layers": run["shape"]["layers"], "case": case, "link_GBps": link,
                         "bytes": c["bytes_busiest_gpu_in"], "bound_s": c["bound_s"],
                         "nereus_s": c["nereus_s"], "dtensor_s": c.get("dtensor_s")})
    out = {"name": "multi_gpu_size_fit", "rows": rows, "fits": {}}
    for case in sorted({r["case"] for r in rows}):
        mine = [r for r in rows if r["case"] == case and r["bytes"]]
        if not mine:
            continue
        link = sorted(r["link_GBps"] for r in mine)[len(mine) // 2]
        for method in ("nereus", "dtensor"):
            points = [(r["bytes"], r[f"{method}_s"]) for r in mine if r.get(f"{method}_s") is not None]
            got = fit(points)
            if got["fixed_s"] is not None and got["GBps"]:
                got["bytes_within_1.2x"] = within(got["fixed_s"], got["GBps"], link)
            got["link_GBps"] = link
            out["fits"][f"{case} {method}"] = got
    print(f"{'case':<8} {'layers':>6} {'GB in':>7} {'bound ms':>9} {'nereus ms':>10} {'x':>6} {'dtensor ms':>11} {'x':>6}")
    for r in sorted(rows, key=lambda r: (r["case"], r["bytes"])):
        bound = r["bound_s"] or 0
        dt = r["dtensor_s"]
        print(f"{r['case']:<8} {r['layers']:>6} {r['bytes'] / 1e9:>7.2f} {bound * 1e3:>9.2f} "
              f"{r['nereus_s'] * 1e3:>10.2f} {r['nereus_s'] / bound if bound else 0:>5.2f}x "
              f"{(dt or 0) * 1e3:>11.2f} {dt / bound if bound and dt else 0:>5.2f}x")
    for key, got in out["fits"].items():
        size = got.get("bytes_within_1.2x")
        print(f"{key}: fixed {(got['fixed_s'] or 0) * 1e3:.2f} ms, {got['GBps'] or 0:.0f} GB/s "
              f"(link {got['link_GBps'] or 0:.0f}); within 1.2x of the bound from "
              + ("never" if size is None else f"{size / 1e9:.1f} GB"))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    main(sys.argv[1:])
