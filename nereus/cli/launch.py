"""Running `nereus train`'s workers under torchrun, and ending the job when one fails.

`launch(config, nproc, ...)` starts `python -m torch.distributed.run ... -m
nereus.rl.worker CONFIG` in a process group of its own, turns the workers' `@nereus-rl`
lines into a progress bar and returns rank 0's result. When a rank fails the job ends
within NEREUS_FAILURE_TIMEOUT_S (default 60 s) whatever the other ranks do: torchrun
stops them as soon as the failing rank exits, and past the limit the launcher stops the
whole process group (SIGTERM, then SIGKILL), so that a worker which ignores SIGTERM, or
outlives torchrun holding the output pipe, cannot keep the command waiting. The error
shown first is the root cause (`root_cause`): the rank whose own failure started it, not
a peer that then lost its connection or aborted a transition because of it.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import click

from nereus.ir.diagnostics import NereusError, env_number

PREFIX = "@nereus-rl "  # same as nereus.rl.worker.PREFIX (not imported: it needs torch)
FAILURE_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0  # between SIGTERM and SIGKILL of the process group


def torch_version() -> tuple:
    """(major, minor) of the installed torch, read without importing it; (0, 0) if unknown."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = re.match(r"(\d+)\.(\d+)", version("torch"))
    except PackageNotFoundError:
        return (0, 0)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def torchrun_command(nproc: int, torch_at: Optional[tuple] = None) -> list:
    """torchrun for `nproc` workers on this host (the script and its arguments follow).

    From torch 2.6: a c10d rendezvous at 127.0.0.1 port 0, so the agent binds its stores'
    ports itself and no other process can take one between its choice and its bind (with
    two test workers beside, every gloo connection takes an ephemeral port); --local-addr
    hands the workers 127.0.0.1 rather than a looked-up host name. Before 2.6 the workers'
    store port is chosen and bound later anyway, and their address is the host's name, so
    there: the static rendezvous on a port chosen here (a race of torchrun's start-up)."""
    head = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc)]
    if (torch_at or torch_version()) >= (2, 6):
        return head + ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id",
                       f"nereus-{os.getpid()}-{time.monotonic_ns()}", "--local-addr", "127.0.0.1"]
    return head + ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# what a run writes into its folder (nereus.rl.worker); an earlier run's copies go first
RUN_OUTPUTS = ("result.json", "final_state.pt", "checkpoint", "error-rank*.json")


def clear_earlier_run(out: str) -> None:
    """Remove what an earlier run wrote into `out` (RUN_OUTPUTS), so that a run that fails
    leaves no result of another beside its own config; other files stay."""
    import shutil

    if not os.path.isdir(out):
        return
    for pattern in RUN_OUTPUTS:
        for old in glob.glob(os.path.join(out, pattern)):
            if os.path.isdir(old) and not os.path.islink(old):
                shutil.rmtree(old)
            else:
                os.remove(old)


def launch(config: dict, nproc: int, out: str, progress_label: str, quiet: bool,
           failure_timeout_s: Optional[float] = None) -> dict:
    """Run the worker under torchrun; returns the result dict of rank 0. When a rank
    fails, the job ends within `failure_timeout_s` (module docstring) and TrainingFailed
    carries the root cause's error and traceback (with `quiet`, the --json mode, also
    printed as one JSON line {"error": {...}}). The limit defaults to
    NEREUS_FAILURE_TIMEOUT_S, else FAILURE_TIMEOUT_S."""
    if failure_timeout_s is None:
        failure_timeout_s = env_number("NEREUS_FAILURE_TIMEOUT_S", FAILURE_TIMEOUT_S, 1.0, float)
    from nereus.rl.topology import collective_timeout

    collective_timeout()  # NEREUS_COLLECTIVE_TIMEOUT_S checked here, read by every worker
    os.makedirs(out, exist_ok=True)
    clear_earlier_run(out)
    path = os.path.join(out, "config.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    job = f"{os.getpid()}-{time.monotonic_ns()}"  # marks this job's processes (stop_group)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{JOB_VARIABLE: job},
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    command = torchrun_command(nproc) + ["-m", "nereus.rl.worker", path]
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from nereus.ir.units import human_bytes

    console = Console(stderr=True)
    other: list[str] = []
    errors: list[dict] = []
    result, guard = None, None
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console,
                  disable=quiet) as progress:
        task = progress.add_task(progress_label + " (starting)", total=config["steps"], info="")
        # rich draws no bar where stderr is no terminal (CI, a log file, `| tee`): plain
        # lines then, one per PLAIN_PROGRESS_S at most, so a long run never looks hung
        plain = None if quiet or console.is_terminal else _PlainProgress(console, progress_label, config["steps"])
        # a process group of its own: the guard (and Ctrl-C) can stop every worker, also
        # one that outlived torchrun (re-parented here, not to init: keep_orphans)
        keep_orphans()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            for line in proc.stdout:
                if not line.startswith(PREFIX):
                    other.append(line)
                    continue
                try:
                    event = json.loads(line[len(PREFIX):])
                except json.JSONDecodeError:  # another rank's output cut into the line
                    other.append(line)
                    continue
                if event["event"] == "step":
                    info = f"reward {event['reward']:.3f}  kl {event['kl']:+.4f}  loss {event['loss']:+.4f}"
                    progress.update(task, completed=event["step"], description=f"{progress_label} [{event['plan']}]",
                                    info=info)
                    if plain is not None:
                        plain.step(event["step"], event["plan"], info)
                elif event["event"] == "transition":
                    progress.console.print(f"  after step {event['after_step']}: {event['from']} → {event['to']} in "
                                           f"{event['seconds']:.2f} s, {human_bytes(event['bytes'])} sent")
                elif event["event"] == "drift":
                    progress.console.print(f"  after step {event['after_step']}: {event['set']}")
                elif event["event"] == "done":
                    result = event
                elif event["event"] == "error":
                    errors.append(_error_event(event))
                    if guard is None:
                        guard = failure_guard(proc, failure_timeout_s, job)
            proc.wait()
        except BaseException:  # Ctrl-C (or any error here): no worker outlives the command
            stop_group(proc, job)
            raise
        finally:
            if guard is not None:
                guard.cancel()
    if errors or proc.returncode != 0:
        # every rank's own report: a line on stdout can be cut into by another rank's output
        reported = {e.get("rank") for e in errors}
        errors += [e for e in _reports(out) if e.get("rank") not in reported]
    killed = _killed_ranks(other, {e.get("rank") for e in errors})
    if errors or killed:
        failed = TrainingFailed(root_cause(errors, killed, last_output(other)))
        if quiet:  # this object is the report: reports_errors would print a second, rank-less one
            click.echo(json.dumps({"error": failed.details}))
            raise SystemExit(2)
        raise failed
    if proc.returncode != 0 or result is None:
        tail = "".join(other[-40:])
        raise NereusError(f"the training processes failed (exit code {proc.returncode}):\n{tail}",
                          hint="rerun with --traceback for the launcher's own traceback")
    result.pop("event", None)
    return result


class TrainingFailed(NereusError):
    """A rank of `nereus train` failed; `details` is the root cause's error event (rank,
    type, message, traceback)."""

    kind = "training failed"

    def __init__(self, event: dict):
        self.details = {k: event.get(k) for k in ("rank", "type", "message", "traceback")}
        if event.get("user_error"):  # a NereusError: its own formatted text says it all
            message = f"rank {event.get('rank')}: {event.get('message', '')}"
        else:
            message = (f"rank {event.get('rank')} raised {event.get('type')}: {event.get('message', '')}\n"
                       f"{event.get('traceback', '')}").rstrip()
        super().__init__(message)


def _error_event(event: dict) -> dict:
    """The worker's full error event (written to a file named in the line, when it could)."""
    if "file" in event:
        try:
            with open(event["file"]) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return dict(event, message=f"rank {event.get('rank')} failed; its report {event['file']} is unreadable")
    return event


def _reports(out: str) -> list:
    """The error reports the ranks wrote to OUT/error-rank<r>.json (nereus.rl.worker), in
    rank order."""
    found = []
    for path in sorted(glob.glob(os.path.join(out, "error-rank*.json"))):
        try:
            with open(path) as f:
                found.append(json.load(f))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(found, key=lambda e: e.get("rank", -1))


# what a peer of the failing rank raises because of it
_CONSEQUENCE = re.compile(r"Connection (reset|closed) by peer|Timed out waiting|pair closure|Broken pipe|"
                          r"NCCL communicator was aborted|ProcessGroup.*aborted", re.IGNORECASE)
_NAMED = re.compile(r"rolled back on every rank: rank (\d+),")


def last_output(lines: list, keep: int = 12) -> list:
    """The workers' last `keep` non-blank lines before torchrun's own failure report (a
    rank a signal killed wrote no report; what it printed last, a fatal error of the
    interpreter or of a C++ library, says why). The ranks share the pipe: the lines may
    be any rank's."""
    end = next((i for i, line in enumerate(lines) if _TORCHRUN_REPORT.search(line)), len(lines))
    return [line.rstrip() for line in lines[:end] if line.strip()][-keep:]


# the first line of torchrun's report on a failed worker
_TORCHRUN_REPORT = re.compile(r"torch[./]distributed[./]elastic|ChildFailedError|^={20,}")


def root_cause(errors: list, killed: dict, output: Optional[list] = None) -> dict:
    """The error event to show first: when the ranks raised the same TransitionAborted,
    the event of the rank its first failure names (unless that failure is itself a lost
    connection); else the first event that is not a
    lost connection or a timeout (what the peers of a failed rank see); else a rank that
    a signal killed before it could report (a peer saw only the connection drop); else
    the first event."""
    for event in errors:
        message = str(event.get("message", ""))
        named = _NAMED.search(message)
        # an abort whose failure is a lost connection names the rank that lost it, not the
        # rank that failed (one that raised in its step while this one waited in a transition)
        if named is not None and not _CONSEQUENCE.search(message):
            for candidate in errors:
                if candidate.get("rank") == int(named.group(1)):
                    return candidate
            break
    for event in errors:
        if not _CONSEQUENCE.search(str(event.get("message", ""))):
            return event
    if killed:
        rank, signum = min(killed.items())
        name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else str(signum)
        said = "\n".join(f"  | {line}" for line in output or ())
        return {"rank": rank, "type": "Killed", "traceback": "",
                "message": f"rank {rank} was killed by signal {signum} ({name}) and reported nothing; the other "
                           "ranks' errors follow from it (out of memory? `dmesg` shows the OOM killer)"
                           + (f"\nthe workers' last output before torchrun's report:\n{said}" if said else "")}
    return errors[0]


def _killed_ranks(lines: list, reported: set) -> dict:
    """{rank: signal} of the ranks torchrun says a signal ended (its failure summary:
    `rank : R (local_rank: L)` then `exitcode : -S`), that sent no error event."""
    killed, rank = {}, None
    for line in lines:
        found = re.search(r"\brank\s*:\s*(\d+)\s*\(local_rank", line)
        if found:
            rank = int(found.group(1))
            continue
        code = re.search(r"exitcode\s*:\s*(-?\d+)", line)
        if code and rank is not None:
            signum = -int(code.group(1))
            # SIGTERM / SIGINT: torchrun (or the guard) stopping a peer of the failed rank
            if signum > 0 and signum not in (signal.SIGTERM, signal.SIGINT) and rank not in reported:
                killed[rank] = signum
            rank = None
    return killed


PLAIN_PROGRESS_S = 10.0  # seconds between plain progress lines (stderr not a terminal)


class _PlainProgress:
    """Progress as plain lines on a console that is no terminal: the first step, then at
    most one line per PLAIN_PROGRESS_S, and the last step."""

    def __init__(self, console, label: str, total: int):
        self.console, self.label, self.total = console, label, total
        self.started = time.perf_counter()
        self.last = None
        console.print(f"{label}: starting the processes", highlight=False)

    def step(self, step: int, plan: str, info: str) -> None:
        now = time.perf_counter()
        if self.last is None or now - self.last >= PLAIN_PROGRESS_S or step >= self.total:
            self.last = now
            self.console.print(f"{self.label}: step {step}/{self.total} [{plan}] {info} "
                               f"({now - self.started:.0f} s)", highlight=False, soft_wrap=True)


def stop_group(proc, job: Optional[str] = None) -> None:
    """SIGTERM the launcher's process group and the job's processes (`job_processes`:
    torchrun and its workers), SIGKILL them STOP_GRACE_S later if anything is still
    running. The processes are named one by one: torchrun (torch >= 2.13) starts each
    worker in a session of its own, which the group's signal never reaches, and an
    orphaned worker holds the output pipe open (the command would wait for it forever).
    Each is signalled through a pidfd taken when it was found, so a process that later
    reuses a freed PID is never hit."""
    family = _handles(job_processes(proc, job))
    try:
        if proc.returncode is None:
            _killpg(proc.pid, signal.SIGTERM)
        for handle in family.values():
            handle.signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        if proc.returncode is None:
            _killpg(proc.pid, signal.SIGKILL)
        for handle in family.values():
            handle.signal(signal.SIGKILL)
    finally:
        for handle in family.values():
            handle.close()


def _killpg(group: int, sig) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Process:
    """A process to signal: through a pidfd where the system has them (it keeps naming
    that process, also after its PID is freed and reused), else by PID after checking
    that the PID still started when it did."""

    def __init__(self, pid: int, started: Optional[bytes]):
        self.pid, self.started, self.fd = pid, started, None
        if hasattr(os, "pidfd_open"):
            try:
                self.fd = os.pidfd_open(pid)
            except OSError:  # gone already
                self.fd = -1
            if self.fd >= 0 and _start_time(pid) != started:  # the PID was reused in between
                os.close(self.fd)
                self.fd = -1

    def signal(self, sig) -> None:
        try:
            if self.fd is not None:
                if self.fd >= 0:
                    signal.pidfd_send_signal(self.fd, sig)
            elif _start_time(self.pid) == self.started:
                os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError, OSError):
            pass

    def close(self) -> None:
        if self.fd is not None and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _handles(pids) -> dict:
    return {pid: _Process(pid, _start_time(pid)) for pid in pids}


def _stat(pid) -> list:
    """The fields of /proc/PID/stat after the command name (which may hold spaces): [0] is
    the state, [1] the parent's PID, [19] the start time; [] when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return []
    return stat[stat.rfind(b")") + 2:].split()


def _start_time(pid: int) -> Optional[bytes]:
    """When the process started (clock ticks since boot): with the PID, it names one process."""
    fields = _stat(pid)
    return fields[19] if len(fields) > 19 else None


def keep_orphans() -> None:
    """Make this process the subreaper of its descendants (Linux): a worker orphaned by
    torchrun is re-parented here, not to init, so `stop_group` still finds it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def descendants(pid: int) -> set:
    """Every process below `pid` (children, their children, ...), from /proc; empty where
    there is no /proc."""
    children: dict = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        fields = _stat(entry) if entry.isdigit() else []
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def job_processes(proc, job: Optional[str] = None) -> set:
    """The processes below `proc`, and those below this process whose environment carries
    JOB_VARIABLE=`job` (`launch` sets it): orphans of torchrun, re-parented here because
    `launch` makes this process the subreaper of its descendants. Never another child of
    this process (a program that calls `launch` may have its own: a multiprocessing
    forkserver, data-loader workers)."""
    found = descendants(proc.pid)
    if job:
        mark = f"{JOB_VARIABLE}={job}".encode()
        found |= {pid for pid in descendants(os.getpid()) if mark in _environment(pid)}
    return found


JOB_VARIABLE = "NEREUS_LAUNCH_ID"


def _environment(pid: int) -> list:
    """The entries of /proc/PID/environ ([] where unreadable or gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return handle.read().split(b"\0")
    except OSError:
        return []


def failure_guard(proc, seconds: float, job: Optional[str] = None):
    """After a rank failed: stop the whole job (`stop_group`) if it has not ended within
    `seconds`."""
    timer = threading.Timer(seconds, stop_group, args=(proc, job))
    timer.daemon = True
    timer.start()
    return timer


def json_safe(value):
    """`value` with every NaN or infinite float as None: `--json` output stays JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
