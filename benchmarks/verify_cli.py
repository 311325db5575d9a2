"""Cost of `nereusc verify` on a large whole program, this tree against another (issue 41).

Issue 41 made the verifier read JSON strictly (a key written twice, NaN, Infinity: errors
at file:line:col) and check every field's JSON type before the replay. This measures what
that costs where it matters, on a 256-GPU program (157 MB):

  - the command itself: the program is emitted once (`nereusc NIR --emit json -o`), then
    `nereusc verify PROGRAM [--against NIR]` runs in fresh processes, the trees given
    alternating run by run (this one, and `--base DIR`: a directory holding another tree's
    `nereus` package, e.g. `git archive COMMIT nereus | tar -x -C DIR`); per tree and mode
    the child's CPU seconds (user + sys) and wall seconds, median of `--repeat` runs;
  - in this process, alternated `--repeat` times, the two steps the change touched:
    json.loads against strict_json.loads of the file's text, and the unknown-field walk
    (what verify_program ran before) against check_fields (types and unknown fields).

A case is a .nir file (its only transition) or `gen:MODEL:GPUS:TRANSITION`, the generated
PPO plans of plan_scale.py.

    python benchmarks/verify_cli.py [--case gen:70b:256:length-growth] [--repeat 3] [--base DIR]
                                    [--program-version 1|2]

Last stdout line: {"name": "verify_cli", "case", "program_bytes", "runs": [{"tree",
"against", "cpu_s", "wall_s"}, ...], "medians": {"TREE against|alone": {"cpu_s", "wall_s"}},
"steps": {"json.loads", "strict_json.loads", "unknown_fields", "check_fields"} (CPU s, each
run)}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _nir(case: str, folder: str) -> str:
    if not case.startswith("gen:"):
        return case
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from plan_scale import nir_source

    _, model, gpus, transition = case.split(":")
    path = os.path.join(folder, "case.nir")
    with open(path, "w") as handle:
        handle.write(nir_source(int(gpus), model, transition))
    return path


def _run(tree: str, args: list[str]) -> tuple[float, float, int]:
    """(child CPU seconds, wall seconds, exit code) of `python -m nereus.cli ARGS` on `tree`."""
    env = dict(os.environ, PYTHONPATH=tree, PYTHONDONTWRITEBYTECODE="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "nereus.cli", *args], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: nereusc {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return cpu, wall, done.returncode


def _steps(path: str, repeat: int) -> dict:
    from nereus.ir import strict_json
    from nereus.passes.verify_fields import check_fields, unknown_fields

    with open(path, encoding="utf-8-sig") as handle:
        text = handle.read()

    def cpu(function):
        gc.collect()
        start = time.process_time()
        value = function()
        return time.process_time() - start, value

    out: dict = {"json.loads": [], "strict_json.loads": [], "unknown_fields": [], "check_fields": []}
    for _ in range(repeat):
        seconds, data = cpu(lambda: json.loads(text))
        out["json.loads"].append(round(seconds, 2))
        del data
        seconds, data = cpu(lambda: strict_json.loads(text, path))
        out["strict_json.loads"].append(round(seconds, 2))
        out["unknown_fields"].append(round(cpu(lambda: unknown_fields(data))[0], 2))
        out["check_fields"].append(round(cpu(lambda: check_fields(data))[0], 2))
        del data
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="gen:70b:256:length-growth")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--base", metavar="DIR", help="another tree's root (holding its nereus package)")
    parser.add_argument("--program-version", type=int, choices=(1, 2), default=None,
                        help="the program's JSON version (default: what nereusc writes; version 1 names every "
                             "member: the 157 MB program of the default case)")
    args = parser.parse_args(argv)
    trees = {"this": str(ROOT)}
    if args.base:
        trees["base"] = os.path.abspath(args.base)
    with tempfile.TemporaryDirectory() as folder:
        nir = _nir(args.case, folder)
        program = os.path.join(folder, "program.json")
        from nereus.ir import parse_file

        (transition,) = parse_file(nir).transitions
        version = ["--program-version", str(args.program_version)] if args.program_version else []
        _run(trees["this"], [nir, "--transition", f"{transition.source}:{transition.target}", "--emit", "json",
                             "-o", program, *version])
        runs = []
        for repeat in range(args.repeat):
            for name, tree in trees.items():
                for against in (True, False):
                    cpu, wall, _ = _run(tree, ["verify", program, *(["--against", nir] if against else [])])
                    runs.append({"tree": name, "against": against, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2)})
                    print(f"{name} {'against' if against else 'alone'} run {repeat + 1}: {cpu:.2f} s CPU, "
                          f"{wall:.2f} s wall", file=sys.stderr, flush=True)
        steps = _steps(program, args.repeat)
        size = os.path.getsize(program)
    medians = {}
    for name in trees:
        for against in (True, False):
            mine = [r for r in runs if r["tree"] == name and r["against"] == against]
            medians[f"{name} {'against' if against else 'alone'}"] = {
                "cpu_s": round(statistics.median(r["cpu_s"] for r in mine), 2),
                "wall_s": round(statistics.median(r["wall_s"] for r in mine), 2)}
    print(json.dumps({"name": "verify_cli", "case": args.case, "program_version": args.program_version,
                      "program_bytes": size, "trees": trees,
                      "runs": runs, "medians": medians, "steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
