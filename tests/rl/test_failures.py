"""A rank that raises ends `nereus train` quickly, with its own error first (gloo, 2 ranks).

NEREUS_STEP_FAULT="1:2" makes rank 1 raise after step 2 while rank 0 goes on into the
next step's collectives (where it would wait forever): the job must end well within the
failure timeout, the CLI must show rank 1's error and traceback, and --json must print an
error object."""

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN = os.path.join(ROOT, "examples", "rl", "grpo-cpu.nir")

pytestmark = pytest.mark.multiprocess


def _train(tmp_path, *extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))), NEREUS_STEP_FAULT="1:2", NEREUS_FAILURE_TIMEOUT_S="60")
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", "from nereus.cli import nereus; nereus()", "train", PLAN,
                          "--algo", "grpo", "--nproc", "2", "--steps", "6", "--out", str(tmp_path), *extra],
                         capture_output=True, text=True, env=env, timeout=240)
    return run, time.perf_counter() - started


def test_a_failing_rank_ends_the_job_with_its_own_error_first(tmp_path):
    run, seconds = _train(tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert seconds < 60, seconds
    text = run.stderr
    first = text.index("training failed: rank 1 raised RuntimeError: injected fault on rank 1 after step 2")
    assert "Traceback" in text[first:] and "_injected_fault" in text[first:]
    assert "rank 0" not in text[:first]


def test_json_mode_prints_the_error_object(tmp_path):
    run, seconds = _train(tmp_path, "--json")
    assert run.returncode == 2 and seconds < 60, run.stdout + run.stderr
    error = json.loads(run.stdout.strip().splitlines()[-1])["error"]
    assert error["rank"] == 1 and error["type"] == "RuntimeError"
    assert "injected fault on rank 1 after step 2" in error["message"]
    assert "Traceback" in error["traceback"]


def test_a_rank_that_stalls_ends_the_job_after_the_collective_timeout(tmp_path):
    """A rank that stops without raising (SIGSTOP here; a deadlock, a hung device) left its
    peers waiting in a collective for gloo's default 30 minutes. With
    NEREUS_COLLECTIVE_TIMEOUT_S their wait times out, which ends the job as a failure does."""
    import signal

    from nereus.cli.launch import descendants

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))), NEREUS_COLLECTIVE_TIMEOUT_S="5", NEREUS_FAILURE_TIMEOUT_S="10")
    proc = subprocess.Popen([sys.executable, "-c", "from nereus.cli import nereus; nereus()", "train", PLAN,
                             "--algo", "grpo", "--nproc", "2", "--steps", "100000", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stopped = None
    try:
        for line in proc.stderr:  # plain progress lines: stderr is a pipe
            if "step 1/" in line:
                break
        workers = [p for p in descendants(proc.pid) if b"nereus.rl.worker" in _cmdline(p)]
        stopped = max(workers)
        os.kill(stopped, signal.SIGSTOP)
        started = time.perf_counter()
        rest = proc.stderr.read()
        proc.wait(timeout=120)
        seconds = time.perf_counter() - started
    finally:
        if proc.poll() is None:
            proc.kill()
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 2, rest
    assert seconds < 60, seconds
    assert "training failed: rank" in rest


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read()
    except OSError:
        return b""


def test_a_rank_that_fails_before_its_process_group_shows_its_own_error(tmp_path):
    """A rank that raised while choosing its GPU or joining the group (NCCL's rank 1 on a
    1-GPU host: no cuda:1, seen on the H200 image) reached the user as torchrun's dump,
    without its error. Here every rank's init_process_group raises, on any host: the
    config names a backend torch does not have."""
    from nereus.cli.launch import TrainingFailed, launch

    config = {"plan_file": PLAN, "plan": "S1", "steps": 1, "events": [], "seed": 0, "backend": "no-such-backend",
              "rl": {"algo": "grpo"}, "out": str(tmp_path / "run")}
    started = time.perf_counter()
    with pytest.raises(TrainingFailed) as caught:
        launch(config, 2, config["out"], "train", quiet=False, failure_timeout_s=60)
    assert time.perf_counter() - started < 60
    details = caught.value.details
    assert details["rank"] in (0, 1) and details["type"], details  # (ValueError or AssertionError: torch versions differ)
    assert "no-such-backend" in details["message"] and "init_process_group" in details["traceback"]
