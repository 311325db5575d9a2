"""Session 20's tables from the raw JSON here: python3 tables.py (prints markdown).
Target as in sessions 15-19: both first calls of a run within 2 x its warm A -> B
(host_only's `plain` median) + 300 ms."""
import glob
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
# what each call's tree names were (the scripts callN/s20*.sh say the same)
TREES = {"call1": {"warm": "46ae80c + 016016c", "new": "fdc873f"},
         "call4": {"head": "fdc873f", "new": "0e22fb1"},  # the working tree before its commit: the same
         "call5": {"head": "fdc873f", "new": "0e22fb1"},  # run at 2d5c300: 0e22fb1 + thread_steps.py
         "call6": {"head": "fdc873f", "new": "0e22fb1"},  # run at 69c50fa (results only since)
         "call7": {"new": "6b2868a"}}  # 0e22fb1 + the review fixes (5a31897, 6b2868a)
THREAD_STEPS = {"call2": "fdc873f, thread_steps.py before --intraop (the process's team)",
                "call3": "fdc873f, as call 2, with getrusage",
                "call4": "0e22fb1, thread_steps.py --intraop one or inherit",
                "call7": "6b2868a"}


def first_calls():
    print("| call, run | tree | Triton cache | warm A → B | target | cold A → B (replays, wait) | "
          "cold B → A (replays, wait) | thread's last step ends | replay steps median / max |")
    print("|---|---|---|---|---|---|---|---|---|")
    agg = {}
    for call in sorted(TREES):
        for path in sorted(glob.glob(os.path.join(HERE, call, "*.json"))):
            name = os.path.basename(path)[:-5]
            d = json.load(open(path))
            if d.get("name") != "multi_gpu_host_only":
                continue
            parts = name.split("_")
            tree = next((p for p in parts if p in TREES[call]), "new")
            # call 6's warm-up ran third, after the two empty-cache runs (their own cache
            # directories): the default cache was still empty, so it counts as one
            cache = "empty" if "empty" in parts or "warmup" in parts else "warm"
            warm = d["plain"]["a-b"]["call_s"]
            target = 2 * warm + 0.3
            cells, ok = [], 0
            for k in ("a-b", "b-a"):
                x, v = d["cold_details"]["cold " + k], d["cold"]["cold " + k]
                cell = f"{v * 1e3:.0f} ({x['replays_used']}/{x['replays_in_plan']}, {x['ahead_wait_s']:.2f})"
                ok += v <= target
                cells.append(cell if v <= target else f"**{cell}**")
            steps = d.get("ahead_steps", [])
            replays = [s[5] for s in steps if s[3] == "replay"]
            end = f"{max(s[4] + s[5] for s in steps):.2f} s" if steps else "—"
            spread = f"{statistics.median(replays) * 1e3:.0f} / {max(replays) * 1e3:.0f}" if replays else "—"
            label = TREES[call][tree]
            if name.startswith("g24"):
                label += " (generation, 24 layers)"
            print(f"| {call[4:]}, {name} | {label} | {cache} | {warm * 1e3:.1f} | {target * 1e3:.0f} | "
                  f"{cells[0]} | {cells[1]} | {end} | {spread} |")
            a = agg.setdefault((TREES[call][tree], cache, name.startswith("g24")), [0, 0])
            a[0] += ok
            a[1] += 2
    print()
    print("| tree | Triton cache | case | directions within target |")
    print("|---|---|---|---|")
    for (tree, cache, gen), (ok, n) in sorted(agg.items()):
        print(f"| {tree} | {cache} | {'generation 24' if gen else 'training 6'} | {ok} of {n} |")


def thread_steps():
    print("| call, run | tree | beside | thread's intra-op threads | replay builds: thread CPU min / median / max (ms) "
          "| tables built (s, sum) | lowering step (s) |")
    print("|---|---|---|---|---|---|---|")
    for call in sorted(THREAD_STEPS):
        for path in sorted(glob.glob(os.path.join(HERE, call, "*.json"))):
            d = json.load(open(path))
            if d.get("name") != "thread_steps":
                continue
            cpu = d["replay_cpu_s"]
            lowered = [s["wall_s"] for s in d["steps"] if s["what"] == "lowered"]
            team = d.get("intraop_threads") or (["1 (OMP_NUM_THREADS=1)"] if "omp1" in path else ["process's"])
            env = " (OMP_NUM_THREADS=1)" if "omp1" in path else " (expandable segments)" if "expandable" in path else ""
            print(f"| {call[4:]}, {os.path.basename(path)[:-5]} | {THREAD_STEPS[call]} | {d['beside']}{env} | "
                  f"{team[0]} | {min(cpu) * 1e3:.0f} / {statistics.median(cpu) * 1e3:.0f} / {max(cpu) * 1e3:.0f} | "
                  f"{d['replay_parts_s']['build']:.2f} | {' / '.join(f'{x:.2f}' for x in lowered)} |")


def interference():
    print("| run | tree | thread busy (s) | GPU-bound step: busy median / max, idle median (ms) | "
          "launch-bound step: busy steps, median / max, idle median (ms) |")
    print("|---|---|---|---|---|")
    for path in sorted(glob.glob(os.path.join(HERE, "call5", "int_*.json"))):
        d = json.load(open(path))
        tree = TREES["call5"][os.path.basename(path).split("_")[1]]
        g, h = d["kinds"]["device"], d["kinds"]["host"]
        print(f"| {os.path.basename(path)[:-5]} | {tree} | {d['busy_s']:.2f} | {g['busy_median_ms']:.1f} / "
              f"{g['busy_max_ms']:.0f}, {g['idle_median_ms']:.1f} | {h['busy_steps']}, {h['busy_median_ms']:.1f} / "
              f"{h['busy_max_ms']:.0f}, {h['idle_median_ms']:.1f} |")


if __name__ == "__main__":
    print("# Session 20 tables (generated: python3 tables.py)\n")
    print("## First calls right after construction (host_only.py)\n")
    first_calls()
    print("\n## The thread's steps timed one by one (thread_steps.py)\n")
    thread_steps()
    print("\n## The loop beside the thread (ahead_interference.py, call 5)\n")
    interference()
