"""`nereus train`'s launcher (nereus/cli/launch.py): which rank's error is shown first,
and that the failure guard stops the whole process group, also a worker that ignores
SIGTERM and outlives torchrun while holding the output pipe (the command waited for it
forever before). No torch needed: the launcher's pieces are tested as they are."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from nereus.cli import launch

FAILED = {"rank": 3, "type": "ValueError", "message": "bad batch", "traceback": "..."}
RESET = {"rank": 0, "type": "RuntimeError",
         "message": "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4741"}
ABORTED = [{"rank": r, "type": "TransitionAborted",
            "message": "transition aborted: S1 -> S2 rolled back on every rank: rank 3, round 0, unpack: "
                       "InjectedFault: injected fault (unpack)"} for r in (2, 0, 3, 1)]
SUMMARY = ["Root Cause (first observed failure):\n", "[0]:\n", "  rank      : 1 (local_rank: 1)\n",
           "  exitcode  : -9 (pid: 4242)\n", "[1]:\n", "  rank      : 2 (local_rank: 2)\n",
           "  exitcode  : -15 (pid: 4243)\n"]


def test_the_rank_a_transition_abort_names_is_shown_first():
    assert launch.root_cause(ABORTED, {})["rank"] == 3


def test_an_abort_that_names_a_rank_for_a_lost_connection_is_not_the_cause():
    """A rank that raised outside any transition (its step) leaves its peer waiting in a
    transition's agreement; the peer's abort names itself for the lost connection. The
    rank whose own error started it comes first (the peer's abort was shown)."""
    lost = {"rank": 0, "type": "TransitionAborted",
            "message": "transition aborted: S1 -> S2 rolled back on every rank: rank 0, round -1, control "
                       "collective at compiling S1 -> S2: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"}
    own = {"rank": 1, "type": "RuntimeError", "message": "injected fault on rank 1 after step 2"}
    assert launch.root_cause([lost, own], {}) is own


def test_a_lost_connection_is_a_consequence_not_the_cause():
    assert launch.root_cause([RESET, FAILED], {}) is FAILED


def test_a_rank_a_signal_killed_is_named_when_the_others_only_lost_it():
    killed = launch._killed_ranks(SUMMARY, reported={0})
    assert killed == {1: signal.SIGKILL}  # -15: torchrun stopping a peer, not a cause
    cause = launch.root_cause([RESET], killed)
    assert (cause["rank"], cause["type"]) == (1, "Killed")
    assert cause["message"].startswith("rank 1 was killed by signal 9 (SIGKILL) and reported nothing")
    assert launch.root_cause([FAILED], killed) is FAILED  # a real error of its own comes first


def test_a_killed_rank_is_shown_with_what_the_workers_printed_last():
    """A rank a signal killed wrote no report: the lines before torchrun's own report (a
    fatal error of the interpreter or of gloo) are the only clue, so they are shown."""
    printed = ["train: step 2/2\n", "\n", "terminate called after throwing an instance of 'gloo::IoException'\n",
               "  what():  [gloo/transport/tcp/pair.cc:598] Connection closed by peer\n",
               "E1207 12:00:00.000000 1 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: -6)\n",
               "Traceback (most recent call last):\n", "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"]
    assert launch.last_output(printed, keep=2) == [
        "terminate called after throwing an instance of 'gloo::IoException'",
        "  what():  [gloo/transport/tcp/pair.cc:598] Connection closed by peer"]
    cause = launch.root_cause([], {1: signal.SIGABRT}, launch.last_output(printed + SUMMARY, keep=2))
    assert cause["message"].endswith("before torchrun's report:\n  | terminate called after throwing an instance "
                                     "of 'gloo::IoException'\n  |   what():  [gloo/transport/tcp/pair.cc:598] "
                                     "Connection closed by peer")
    assert launch.root_cause([], {1: signal.SIGABRT})["message"].endswith("shows the OOM killer)")


def test_json_output_has_no_nan():
    assert launch.json_safe({"a": [float("nan"), 1.0], "b": float("inf"), "c": "x"}) == \
        {"a": [None, 1.0], "b": None, "c": "x"}


# a "torchrun" that exits on SIGTERM, leaving a "worker" that ignores SIGTERM and keeps
# the shared stdout open
LAUNCHER = r"""
import os, signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); import os; print('worker', os.getpid(), flush=True); time.sleep(300)"])
signal.signal(signal.SIGTERM, lambda *a: os._exit(1))
time.sleep(300)
"""


def test_the_guard_stops_a_worker_that_ignores_sigterm_and_outlives_its_launcher(monkeypatch):
    monkeypatch.setattr(launch, "STOP_GRACE_S", 1.0)
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=_job_env("guard-1"))
    word, pid = proc.stdout.readline().split()
    assert word == "worker"
    began = time.perf_counter()
    guard = launch.failure_guard(proc, 1.0, "guard-1")
    rest = proc.stdout.read()  # EOF only once every holder of the pipe is gone
    waited = time.perf_counter() - began
    guard.cancel()
    assert rest == "" and waited < 10, waited
    assert proc.wait(timeout=5) != 0
    assert _gone(int(pid))


def _job_env(job: str) -> dict:
    """The environment `launch` gives a job's processes (their mark for stop_group)."""
    import os

    return dict(os.environ, **{launch.JOB_VARIABLE: job})


def test_stopping_a_job_spares_the_callers_other_children(monkeypatch):
    """The guard stopped every descendant of the calling process: a program (or a pytest
    worker) calling `launch` lost its own children with the job, e.g. multiprocessing's
    forkserver and resource tracker (seen: "resource_tracker: process died unexpectedly")."""
    monkeypatch.setattr(launch, "STOP_GRACE_S", 1.0)
    own = subprocess.Popen(["sleep", "60"])  # the caller's, started before the job
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=_job_env("guard-3"))
    try:
        word, pid = proc.stdout.readline().split()
        launch.stop_group(proc, "guard-3")
        assert proc.wait(timeout=10) != 0 and _gone(int(pid))
        assert own.poll() is None, "the caller's own child was stopped with the job"
    finally:
        own.kill()
        own.wait()
        subprocess.run(["kill", "-9", pid], capture_output=True)


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Dead within `within_s`: no such process, or a zombie (killed; its parent is gone,
    so init reaps it)."""
    deadline = time.perf_counter() + within_s
    while True:
        try:
            with open(f"/proc/{pid}/status") as status:
                if any(line.startswith("State:") and "Z" in line.split()[1] for line in status):
                    return True
        except FileNotFoundError:
            return True
        if time.perf_counter() > deadline:
            return False
        time.sleep(0.05)


def test_reports_are_read_from_the_files_when_a_line_was_cut(tmp_path):
    """A rank's error line on stdout can be cut into by another rank's output; its report
    file (OUT/error-rank<r>.json) still names it."""
    import json

    (tmp_path / "error-rank1.json").write_text(json.dumps(FAILED | {"rank": 1}))
    (tmp_path / "error-rank0.json").write_text(json.dumps(RESET))
    reports = launch._reports(str(tmp_path))
    assert [r["rank"] for r in reports] == [0, 1]
    assert launch.root_cause(reports, {})["rank"] == 1


# as torchrun starts workers since torch 2.13 (subprocess_handler: start_new_session=True):
# the worker is in a session and process group of its own, which killpg of the launcher's
# group never reaches
OWN_SESSION = LAUNCHER.replace('time.sleep(300)"])', 'time.sleep(300)"], start_new_session=True)')


def test_the_guard_stops_a_worker_in_its_own_session(monkeypatch):
    assert OWN_SESSION != LAUNCHER
    monkeypatch.setattr(launch, "STOP_GRACE_S", 1.0)
    proc = subprocess.Popen([sys.executable, "-c", OWN_SESSION], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=_job_env("guard-2"))
    word, pid = proc.stdout.readline().split()
    assert word == "worker"
    began = time.perf_counter()
    guard = launch.failure_guard(proc, 1.0, "guard-2")
    try:
        rest = proc.stdout.read()  # EOF only once every holder of the pipe is gone
    finally:
        guard.cancel()
        subprocess.run(["kill", "-9", pid], capture_output=True)  # never leave it behind
    waited = time.perf_counter() - began
    assert rest == "" and waited < 10, waited
    assert _gone(int(pid))


def test_a_bad_runtime_setting_is_named_before_any_process_starts(tmp_path):
    """NEREUS_* settings the runtime checks when imported were checked only in the workers,
    whose error the launcher could not show (40 lines of torchrun's dump, no name)."""
    import os
    import pathlib

    root = pathlib.Path(__file__).parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH")))), NEREUS_P2P_DEPTH="0")
    for name, value, message in (("NEREUS_P2P_GROUPS", "abc", "NEREUS_P2P_GROUPS='abc': must be a whole number"),
                                 ("NEREUS_STEP_FAULT", "x", "NEREUS_STEP_FAULT='x': must be RANK:STEP"),
                                 ("NEREUS_FAULT", "1:0", "NEREUS_FAULT='1:0': must be RANK:ROUND:PHASE")):
        run = subprocess.run([sys.executable, "-c", "from nereus.cli import nereus; nereus()", "train",
                              str(root / "examples" / "rl" / "grpo-cpu.nir"), "--algo", "grpo", "--steps", "1",
                              "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH")))), **{name: value}))
        assert run.returncode == 2 and message in run.stderr, run.stderr  # read later: checked before launch
    run = subprocess.run([sys.executable, "-c", "from nereus.cli import nereus; nereus()", "train",
                          str(root / "examples" / "rl" / "grpo-cpu.nir"), "--algo", "grpo", "--nproc", "2",
                          "--steps", "1", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "NEREUS_P2P_DEPTH='0': must be a whole number" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "out" / "run").exists()


def test_an_earlier_runs_outputs_are_cleared_before_a_new_run(tmp_path):
    """A failed rerun into the same --out left the earlier run's result.json, final weights
    and checkpoint beside the new config.json: outputs of two runs that looked like one."""
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "0.distcp").write_text("x")
    for name in ("result.json", "final_state.pt", "error-rank1.json", "notes.txt"):
        (tmp_path / name).write_text("x")
    launch.clear_earlier_run(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # what the run did not write stays


# a "torchrun" as torch 2.13's: its worker in a session of its own; on SIGTERM it reaps the
# worker (which the same SIGTERM ended: its PID is free again) and takes 2 s to shut down
REAPING_LAUNCHER = r"""
import os, signal, subprocess, sys, time
worker = subprocess.Popen(["sleep", "1000"], start_new_session=True)
print(worker.pid, flush=True)
def stop(*_):
    os.waitpid(worker.pid, 0)
    time.sleep(2)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
while True:
    time.sleep(1)
"""


def test_the_guard_never_signals_a_process_that_reuses_a_freed_pid(monkeypatch, tmp_path):
    """The guard lists the job's processes, SIGTERMs them and SIGKILLs what is left
    STOP_GRACE_S later. A worker that died at SIGTERM frees its PID; a new process given
    that PID (by wrap-around on a busy host; forced here through ns_last_pid) was
    SIGKILLed with the job."""
    import os
    import threading

    last_pid = "/proc/sys/kernel/ns_last_pid"
    if not os.access(last_pid, os.W_OK):
        import pytest

        pytest.skip("needs a writable ns_last_pid (root) to force the PID reuse")
    monkeypatch.setattr(launch, "STOP_GRACE_S", 1.0)
    proc = subprocess.Popen([sys.executable, "-c", REAPING_LAUNCHER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True, env=_job_env("guard-4"))
    worker, victim = int(proc.stdout.readline()), {}

    def reuse():
        deadline = time.perf_counter() + 5
        while os.path.exists(f"/proc/{worker}") and time.perf_counter() < deadline:  # reaped: PID free
            time.sleep(0.01)
        with open(last_pid, "w") as handle:
            handle.write(str(worker - 1))
        victim["p"] = subprocess.Popen(["sleep", "30"], start_new_session=True)

    thread = threading.Thread(target=reuse)
    thread.start()
    launch.stop_group(proc, "guard-4")
    thread.join()
    other = victim["p"]
    time.sleep(0.2)
    try:
        assert other.pid == worker, "the PID was not reused: nothing tested"
        assert other.poll() is None, f"the process that took PID {other.pid} (the worker's: {worker}) was killed"
    finally:
        other.kill()
        other.wait()


def test_torchrun_binds_its_own_store_ports_from_torch_2_6():
    """A port chosen here and bound by torchrun seconds later can be taken in between (CI
    lost a run to EADDRINUSE that way): from torch 2.6 the agent binds port 0 itself and
    hands the workers 127.0.0.1; before, the static rendezvous on a port chosen here."""
    def value(command, flag):
        return command[command.index(flag) + 1]

    new = launch.torchrun_command(4, (2, 13))
    assert new[1:3] == ["-m", "torch.distributed.run"] and value(new, "--nproc-per-node") == "4"
    assert value(new, "--rdzv-backend") == "c10d" and value(new, "--rdzv-endpoint") == "127.0.0.1:0"
    assert value(new, "--local-addr") == "127.0.0.1" and value(new, "--nnodes") == "1"
    assert "--master-port" not in new and "--standalone" not in new  # (--standalone: "localhost", a name)
    assert value(new, "--rdzv-id") != value(launch.torchrun_command(4, (2, 13)), "--rdzv-id")
    old = launch.torchrun_command(2, (2, 5))
    assert value(old, "--master-addr") == "127.0.0.1" and int(value(old, "--master-port")) > 0
    assert "--rdzv-backend" not in old and launch.torch_version() >= (2, 4)
