"""benchmarks/multi_gpu/host_only.py on the CPU (the harness of the one-GPU host figures in
benchmarks/RESULTS.md): its last stdout line is one JSON object with each direction's
first and second call and the medians of every pass; `--ab-replay` reports replays off
and on, `--moe` runs plans A and B of an expert-parallel case."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "benchmarks", "multi_gpu", "host_only.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, ".."), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--repeats", "2", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=os.path.dirname(SCRIPT))


@pytest.mark.parametrize("args, passes, directions", [
    (("--shape", "tiny", "--layers", "2", "--ab-replay"), ["replay-off", "replay-on"], ["tp-dp", "dp-tp"]),
    (("--shape", "tiny", "--layers", "1", "--moe", "gen-ep2-tp2"), ["plain"], ["a-b", "b-a"]),
])
def test_host_only_reports_every_pass_and_direction(args, passes, directions):
    done = _run(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(result["cold"]) == sorted(f"{c} {d}" for c in ("cold", "second") for d in directions)
    for label in passes:
        assert sorted(result[label]) == sorted(directions)
        assert all(result[label][d]["call_s"] > 0 for d in directions)


def test_the_moe_host_shape_needs_a_moe_case():
    done = _run("--shape", "host")
    assert done.returncode == 2 and "--shape host is a MoE shape: give --moe CASE too" in done.stderr
