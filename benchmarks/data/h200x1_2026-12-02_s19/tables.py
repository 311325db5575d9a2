"""Session 19's tables from the raw JSON here: python3 tables.py (prints markdown).
Target as in sessions 15-18: both first calls of a run within 2 x its warm A -> B
(host_only's `plain` median) + 300 ms."""
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
TREES = {"call1": {"base": "46ae80c", "split": "c324467", "new": "016016c"},
         "call2": {"base": "46ae80c", "warm": "46ae80c + 016016c", "new": "c4f8419"},
         "call3": {"warm": "46ae80c + 016016c", "new": "64c28ce", "base": "46ae80c"}}


def runs():
    for call in sorted(TREES):
        for path in sorted(glob.glob(os.path.join(HERE, call, "*.json"))):
            name = os.path.basename(path)[:-5]
            parts = name.split("_")
            fresh = parts[1] == "fresh"
            tree = parts[2] if fresh else parts[1]
            if tree == "warmup":
                # a fresh machine's first run after the CUDA tests: 6-7 of its 8 variants
                # compiled cold (80-120 ms each, compile_log), so counted with the empty caches
                tree, fresh = "new", True
            yield call, name, parts[0], tree, fresh, json.load(open(path))


def main():
    print("| call, run | tree | warm A → B | target | cold A → B (replays, wait) | cold B → A (replays, wait) |")
    print("|---|---|---|---|---|---|")
    agg = {}
    for call, name, case, tree, fresh, d in runs():
        warm = d["plain"]["a-b"]["call_s"]
        target = 2 * warm + 0.3
        cells = []
        for k in ("a-b", "b-a"):
            x, v = d["cold_details"]["cold " + k], d["cold"]["cold " + k]
            cell = f"{v * 1e3:.0f} ({x['replays_used']}/{x['replays_in_plan']}, {x['ahead_wait_s']:.2f})"
            cells.append(cell if v <= target else f"**{cell}**")
            a = agg.setdefault((case, TREES[call][tree], fresh), {"met": 0, "n": 0, "a-b": [], "b-a": []})
            a["n"] += 1
            a["met"] += v <= target
            a[k].append(v)
        print(f"| {call[-1]}, {name} | {TREES[call][tree]} | {warm * 1e3:.1f} | {target * 1e3:.0f} | {cells[0]} | "
              f"{cells[1]} |")
    print()
    print("| case | tree | Triton cache | directions within target | median cold A → B | median cold B → A | "
          "slowest |")
    print("|---|---|---|---|---|---|---|")
    for (case, tree, fresh), a in sorted(agg.items()):
        print(f"| {case} | {tree} | {'empty or first' if fresh else 'warm'} | {a['met']} of {a['n']} | "
              f"{statistics.median(a['a-b']) * 1e3:.0f} | {statistics.median(a['b-a']) * 1e3:.0f} | "
              f"{max(a['a-b'] + a['b-a']) * 1e3:.0f} |")


if __name__ == "__main__":
    main()
