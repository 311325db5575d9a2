"""`nereus train` end to end: torchrun launch, --json last line, checkpoint, errors."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN = os.path.join(ROOT, "examples", "rl", "grpo-cpu.nir")


def _nereus(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", "from nereus.cli import nereus; nereus()", "train", *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.multiprocess
def test_train_json_line_transitions_and_checkpoint(tmp_path):
    run = _nereus(PLAN, "--algo", "grpo", "--nproc", "2", "--steps", "3", "--events", "1:S2,2:S3",
                  "--out", str(tmp_path), "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["name"] == "train"
    assert [s["step"] for s in result["steps"]] == [1, 2, 3]
    assert all(set(s) >= {"step", "loss", "reward", "kl", "seconds"} for s in result["steps"])
    assert [(t["after_step"], t["to"]) for t in result["transitions"]] == [(1, "S2"), (2, "S3")]
    assert all(t["bytes"] > 0 for t in result["transitions"])
    assert len(result["final_weights_sha256"]) == 64
    assert os.path.exists(tmp_path / "run" / "checkpoint" / ".metadata")


def test_bad_events_are_reported_without_traceback():
    run = _nereus(PLAN, "--steps", "3", "--events", "2:S9")
    assert run.returncode == 2
    assert "unknown plan 'S9'" in run.stderr and "Traceback" not in run.stderr
    run = _nereus(PLAN, "--steps", "3", "--events", "3:S2")
    assert run.returncode == 2 and "not a step boundary" in run.stderr
