"""The executor: runs one rank's part of a compiled transition on live tensors.

Per round (rounds.py): allocate destination shards and each peer's stream buffers, agree with every
rank that nothing failed so far, post the direct pieces (sent from and received into
the shards in place), start the same-GPU copies (a side stream on CUDA), then move
each peer's stream of the other pieces in chunks, packed while earlier chunks travel and
unpacked as they land (streams.py), wait, then release what the program frees. Each
post is one `batch_isend_irecv` (it works on gloo and NCCL). keep = the source tensor
reused in place, copy = a local `copy_`; neither touches the network. NCCL moves CUDA tensors and gloo CPU
tensors: the caller passes the group that matches the tensors' device.

Safety (all or nothing): new shards are written into new buffers only, and the old
state survives until a final commit in which every rank confirms; the new state is handed
back only then. Where the old state waits depends on `rollback` (see parking.py):
"device" keeps every old tensor on its device until the commit; "host" copies each shard
the program frees or stages out to pinned host memory on a side stream (overlapping the
next rounds) and drops the device tensor, so the GPU follows the compiler's memory
replay; "auto" (the default on CUDA) keeps on the device every freed shard the replay
leaves room for and parks only the rest. An abort copies parked shards back. A failure
anywhere is turned into a `Failure` (round, op, peer) and broadcast by `control.agree`,
so every rank raises. Before the commit each rank synchronizes its device, so the
commit (and `ExecutionResult.seconds`) marks the point where the new state is usable.
The commit's one collective also gathers every rank's figures for the report
(`ExecutionResult.ready_s`, `rank_figures`), so a transition costs the control group one
agreement per round plus the commit.

Fault injection for tests: `fault=(rank, round, phase)` with phase "pack" (before the
agreement), "post" (after the large pieces were posted), "unpack" (after the
exchange) or "commit" (at the commit, after the device synchronized; the round is not
read), or the environment variable NEREUS_FAULT="rank:round:phase[:source->target]" (the
last field: only in that transition).
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Callable, Optional

import torch

from nereus.ir.diagnostics import ProgramError, SettingError

from . import replay, streams
from .control import Failure, commit
from .execution_plan import plan_for
from .gc_pause import paused
from .parking import ROLLBACK_MODES, Parking, default_rollback, park_plan, real_room, restore_parked
from .program import RankProgram
from .rounds import ExecutionResult, InjectedFault, RoundTiming, _Run, agree_first, run_round
from .wires import TORCH_DTYPES, Live, check_complete

__all__ = ["TORCH_DTYPES", "ExecutionResult", "InjectedFault", "RoundTiming", "execute"]

def _fault_spec(fault, source: str = "", target: str = "") -> Optional[tuple[int, int, str]]:
    """The fault to inject in the transition `source` -> `target`: `fault` when given, else
    NEREUS_FAULT="RANK:ROUND:PHASE[:SOURCE->TARGET]" (with the fourth field, only in that
    transition: under `nereus train` each step's weight sync is a transition too)."""
    if fault is not None:
        return tuple(fault)
    text = os.environ.get("NEREUS_FAULT")
    if not text:
        return None
    fields = text.split(":", 3)
    spec = where = None
    try:
        rank, rnd, phase = fields[:3]
        spec = int(rank), int(rnd), phase
        if len(fields) == 4:
            where = tuple(part.strip() for part in fields[3].split("->"))
            if len(where) != 2 or not all(where):
                spec = None
    except ValueError:
        spec = None
    if spec is None or spec[2] not in FAULT_PHASES:
        raise SettingError(f"NEREUS_FAULT={text!r}: must be RANK:ROUND:PHASE[:SOURCE->TARGET]",
                           hint=f"phases: {', '.join(FAULT_PHASES)} (tests inject a failure there); the last "
                                "field limits it to one transition, e.g. 1:0:pack:S1->S2")
    if where is not None and where != (source, target):
        return None
    return spec


FAULT_PHASES = ("pack", "post", "unpack", "commit")


def _check_before(prog: RankProgram, before: dict) -> None:
    for unit, shards in prog.before.items():
        have = before.get(unit)
        if have is None:
            raise ProgramError(f"this rank holds no state for before-unit {unit}")
        for name, info in shards.items():
            t = have.get(name)
            if t is None:
                raise ProgramError(f"before-unit {unit} lacks its shard of {name}")
            if not t.is_contiguous():
                raise ProgramError(f"{unit} {name}: the local tensor is not contiguous")
            if tuple(t.shape) != info.shape or t.dtype != TORCH_DTYPES[info.dtype]:
                raise ProgramError(f"{unit} {name}: holds {tuple(t.shape)} {t.dtype}, "
                                   f"the layout says {info.shape} {info.dtype}")


def execute(prog: RankProgram, before: dict, *, group, control, device: torch.device,
            resident_bytes: int = 0, verify: bool = False, progress: bool = False,
            fault=None, rollback: Optional[str] = None, park_device_types=("cuda",),
            round_hook: Optional[Callable[[int], None]] = None,
            capacity_bytes: Optional[int] = None, chunk_bytes: Optional[int] = None,
            depth: Optional[int] = None, offloaded: frozenset = frozenset(),
            clock_start: Optional[float] = None, agreement: Optional[tuple] = None) -> ExecutionResult:
    """Collective over `group` (data; or a list of data groups over the same ranks, whose
    communicators then move a round's ops concurrently) and `control` (gloo).

    Input: this rank's program and its before-state {unit: {tensor: local tensor}}
    (the shards of every before-unit on this GPU; extra entries are ignored). Output:
    the after-state on this GPU. Invariant: the before tensors are never written; on any
    failure on any rank every rank raises TransitionAborted with the old state in `before`.

    rollback="device" (default off CUDA): `before` is not modified; the old tensors stay
    on their device until the commit, so device memory holds old + new during the move.
    rollback="host": when a round frees or stages out a before-shard on a device of
    `park_device_types`, the shard is copied to (pinned) host memory (on a side stream
    for CUDA), its entry in `before` is replaced by that copy and every reference the
    executor holds to the device tensor is dropped, so the caching allocator reuses the
    memory for the next rounds' allocations. On abort the copies go back to the device
    (new tensor objects, after the new buffers were dropped) into `before`; on commit they
    are removed from `before`. References the caller keeps elsewhere keep their device
    memory alive. Shards handed over by a keep are never parked.
    rollback="auto" (default on CUDA): "host" only for the units `park_plan` picks (the
    replay has no room for them within `capacity_bytes` and the device's free memory),
    "device" for the others. `park_device_types={"cpu"}` makes CPU tensors take the host
    path (tests). `round_hook(index)` runs on this rank after each round. chunk_bytes,
    depth: the packed streams' chunk size and ring depth (streams.py; default
    streams.CHUNK_BYTES and streams.DEPTH); sender and receiver must pass the same.
    offloaded: {("before" | "after", unit id)} of the units in host memory (`offload`, see
    offload.py): read and written there, never counted as device bytes. clock_start: the
    `time.perf_counter()` value `ExecutionResult.ready_s` counts from (default: this call).
    agreement: (row, fresh) for the transition's first agreement (control.agree): its
    collective also gathers this rank's `row`, every rank's rows land in
    `ExecutionResult.agreed_rows`, and control.Stale is raised on every rank, before any
    data moved, when `fresh(rows)` is False."""
    rollback = default_rollback(device) if rollback is None else rollback
    if rollback not in ROLLBACK_MODES:
        raise ProgramError(f"unknown rollback mode {rollback!r}", hint="use rollback='host' or 'device'")
    chunk_bytes = chunk_bytes or streams.CHUNK_BYTES
    plan = plan_for(prog, chunk_bytes)  # built on the program's first execution, then reused
    plan.executions[0] += 1
    parking = None
    if rollback == "host":
        parking = Parking(before, park_device_types, kept=plan.kept)
    elif rollback == "auto":
        room = real_room(device) if torch.device(device).type in park_device_types else None
        units = park_plan(prog, resident_bytes, capacity_bytes, room, plan.park_replay(prog, resident_bytes, offloaded))
        parking = Parking(before, park_device_types, units, kept=plan.kept)
    try:
        # no autograd: registered parameters that require grad would record a graph node
        # for every view taken of them; the cyclic GC paused (gc_pause.py)
        with torch.no_grad(), paused():
            result = _execute(prog, before, parking, group, control, torch.device(device), resident_bytes, verify,
                              progress, _fault_spec(fault, prog.source, prog.target), round_hook,
                              depth or streams.DEPTH,
                              offloaded, clock_start, plan, agreement)
    except BaseException as error:
        # the finished frames in the traceback still hold the new shards and the buffers:
        # clear them so the device memory is free before the old shards come back
        traceback.clear_frames(error.__traceback__)
        if parking is not None and parking.devices:
            restore_parked(parking, error, prog)
        raise
    finally:
        replay.compile_pending()  # kernel variants the replays lacked, compiled after the call
    result.rollback = rollback
    if parking is not None:
        result.parked_bytes = parking.bytes
        result.held_bytes = parking.held_bytes
        parking.drop()
    return result


def _execute(prog, before, parking, group, control, device, resident_bytes, verify, progress, fault,
             round_hook, depth, offloaded, clock_start, plan, agreement=None) -> ExecutionResult:
    started = time.perf_counter()
    clock_start = started if clock_start is None else clock_start
    run = _Run(prog, before, parking, group, control, device, Live(resident_bytes), verify, fault, offloaded, plan,
               depth, started, agreement)
    events = []  # (timing, start, end) CUDA events of each round, read after the commit's synchronize
    try:
        _check_before(prog, before)
        _count_before(run)
    except Exception as error:  # noqa: BLE001 - any local error must reach every rank
        run.failure = Failure(run.rank, -1, "check before-state", None, str(error))
    if not prog.rounds:  # otherwise the first round's agreement carries a failure here
        agree_first(run)

    bar = _progress(progress and run.rank == 0, len(prog.rounds))
    for work in prog.rounds:
        timing = run_round(run, work, events)
        run.result.rounds.append(timing)
        run.result.sent_bytes += timing.sent_bytes
        run.result.received_bytes += timing.received_bytes
        if round_hook is not None:
            try:  # the user's code: a failure in it aborts on every rank, as any other
                round_hook(work.index)
            except Exception as error:  # noqa: BLE001
                if run.failure is None:
                    run.failure = Failure(run.rank, work.index, "round_hook", None, f"{type(error).__name__}: {error}")
        if bar is not None:
            bar[0].update(bar[1], advance=1, description=f"round {work.index}: {timing.messages} messages, "
                          f"{timing.sent_bytes / 2**20:.1f} MiB out, {timing.seconds * 1e3:.1f} ms")
    if bar is not None:
        bar[0].stop()

    if run.failure is None:
        try:
            check_complete(prog, run.new, run.written)
            if device.type == "cuda":  # the new state is usable (and a late device error surfaces) here
                torch.cuda.current_stream(device).synchronize()
                for timing, start, end in events:
                    timing.device_s = start.elapsed_time(end) / 1e3
            if fault is not None and fault[0] == run.rank and fault[2] == "commit":
                raise InjectedFault("injected fault (commit)")
        except Exception as error:  # noqa: BLE001
            run.failure = Failure(run.rank, len(prog.rounds), "commit", None, str(error))
    ready_s = time.perf_counter() - clock_start
    # the commit; its collective carries the report's figures of every rank
    figures = commit(run.failure, (ready_s, run.result.sent_bytes), control, prog.source, prog.target)
    result = run.result
    result.ready_s, result.rank_figures = ready_s, figures
    result.state = run.new
    result.peak_bytes = run.live.peak
    result.verified = run.verified
    result.seconds = time.perf_counter() - started
    return result


def _count_before(run: _Run) -> None:
    for unit, shards in run.prog.before.items():
        for name in shards:
            if unit not in run.host_before:
                run.live.add(run.before[unit][name])


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from rich.progress import Progress

    bar = Progress(transient=False)
    bar.start()
    return bar, bar.add_task("transition", total=total)
