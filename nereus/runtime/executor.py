"""The executor: runs one rank's part of a compiled transition on live tensors.

Per round: allocate destination shards and each peer's stream buffers, agree with every
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
read), or the environment variable NEREUS_FAULT="rank:round:phase".
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import ProgramError

from . import offload, packing, streams
from .control import Failure, agree, commit
from .execution_plan import plan_for
from .posting import p2p_ops as _p2p_ops, post as _post
from .parking import ROLLBACK_MODES, Parking, default_rollback, park_plan, real_room, restore_parked
from .program import RankProgram
from .wires import (TORCH_DTYPES, Live, allocate, check_complete, copy_stream, destination, incoming, nothing,
                    outgoing, peer_streams, dst_region, src_region)

class InjectedFault(RuntimeError):
    """Raised by the fault hook."""


class _Skip(Exception):
    """Internal: this rank already failed; skip to the next agreement."""


@dataclass
class RoundTiming:
    index: int
    seconds: float = 0.0
    local_s: float = 0.0  # alloc, keep, copy, pack
    exchange_s: float = 0.0
    unpack_s: float = 0.0
    sent_bytes: int = 0
    received_bytes: int = 0
    messages: int = 0
    posted_at_s: float = 0.0  # host seconds from the transition's start to this round's first post
    device_s: Optional[float] = None  # CUDA: device time from the first post to the round's last work


@dataclass
class ExecutionResult:
    state: dict  # after-unit id → {tensor: local tensor}, this rank's new shards
    rounds: list = field(default_factory=list)
    seconds: float = 0.0
    sent_bytes: int = 0
    received_bytes: int = 0
    copied_bytes: int = 0
    kept_bytes: int = 0
    peak_bytes: int = 0  # resident + live shards + message buffers on this GPU (the compiler's replay)
    buffer_peak_bytes: int = 0  # largest sum of one round's message buffers
    verified: Optional[bool] = None
    rollback: str = "device"  # how an abort would have restored the old state ("auto" | "device" | "host")
    parked_bytes: int = 0  # before-shards copied to host memory and released on their device
    held_bytes: int = 0  # before-shards the program freed that stayed on their device until the commit
    offload_bytes: int = 0  # read from offloaded before-units or written into offloaded after-units (PCIe on CUDA)
    # seconds from `clock_start` to this rank's readiness to commit (every round done, the
    # new state complete, the device synchronized), measured just before the commit's collective
    ready_s: float = 0.0
    # every rank's [ready_s, sent_bytes], in rank order, gathered by the commit's one collective
    rank_figures: list = field(default_factory=list)


def _fault_spec(fault) -> Optional[tuple[int, int, str]]:
    if fault is not None:
        return tuple(fault)
    text = os.environ.get("NEREUS_FAULT")
    if not text:
        return None
    rank, rnd, phase = text.split(":")
    return int(rank), int(rnd), phase


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
            clock_start: Optional[float] = None) -> ExecutionResult:
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
    `time.perf_counter()` value `ExecutionResult.ready_s` counts from (default: this call)."""
    rollback = default_rollback(device) if rollback is None else rollback
    if rollback not in ROLLBACK_MODES:
        raise ProgramError(f"unknown rollback mode {rollback!r}", hint="use rollback='host' or 'device'")
    chunk_bytes = chunk_bytes or streams.CHUNK_BYTES
    plan = plan_for(prog, chunk_bytes)  # built on the program's first execution, then reused
    parking = None
    if rollback == "host":
        parking = Parking(before, park_device_types, kept=plan.kept)
    elif rollback == "auto":
        room = real_room(device) if torch.device(device).type in park_device_types else None
        units = park_plan(prog, resident_bytes, capacity_bytes, room, plan.park_replay(prog, resident_bytes))
        parking = Parking(before, park_device_types, units, kept=plan.kept)
    try:
        result = _execute(prog, before, parking, group, control, torch.device(device), resident_bytes, verify,
                          progress, _fault_spec(fault), round_hook, (chunk_bytes, depth or streams.DEPTH), offloaded,
                          clock_start, plan)
    except BaseException as error:
        # the finished frames in the traceback still hold the new shards and the buffers:
        # clear them so the device memory is free before the old shards come back
        traceback.clear_frames(error.__traceback__)
        if parking is not None and parking.devices:
            restore_parked(parking, error, prog)
        raise
    result.rollback = rollback
    if parking is not None:
        result.parked_bytes = parking.bytes
        result.held_bytes = parking.held_bytes
        parking.drop()
    return result


class _Run:
    """Mutable state of one rank's transition, shared by its rounds."""

    def __init__(self, prog: RankProgram, before: dict, parking, group, control, device, live: Live,
                 verify: bool, fault, offloaded: frozenset, plan):
        self.prog, self.before, self.parking = prog, before, parking
        # units in host memory (offload): not device bytes; written in place there
        self.host_before = {unit for phase, unit in offloaded if phase == "before"}
        self.host_after = {unit for phase, unit in offloaded if phase == "after"}
        self.group, self.control, self.device, self.live = group, control, device, live
        self.verify, self.fault = verify, fault
        self.verified = True if verify else None
        self.rank = dist.get_rank()
        self.result = ExecutionResult(state={})
        self.new: dict = {}
        self.written: dict = {}
        self.failure: Optional[Failure] = None
        # where each before-shard is read from now: its tensor, or a host copy after
        # stage_out; {} after its free
        self.sources = {unit: dict(before.get(unit, {})) for unit in prog.before}
        self.staged: set = set()
        self.plan = plan  # what the rounds derive from the program alone (execution_plan.py)
        # after-shards a keep hands over in place (not allocated)
        self.aliased = plan.aliased


def _execute(prog, before, parking, group, control, device, resident_bytes, verify, progress, fault,
             round_hook, chunking, offloaded, clock_start, plan) -> ExecutionResult:
    started = time.perf_counter()
    clock_start = started if clock_start is None else clock_start
    run = _Run(prog, before, parking, group, control, device, Live(resident_bytes), verify, fault, offloaded, plan)
    run.chunk_bytes, run.depth = chunking
    run.started = started
    events = []  # (timing, start, end) CUDA events of each round, read after the commit's synchronize
    try:
        _check_before(prog, before)
        _count_before(run)
    except Exception as error:  # noqa: BLE001 - any local error must reach every rank
        run.failure = Failure(run.rank, -1, "check before-state", None, str(error))
    if not prog.rounds:  # otherwise the first round's agreement carries a failure here
        agree(run.failure, control, prog.source, prog.target)

    bar = _progress(progress and run.rank == 0, len(prog.rounds))
    for work in prog.rounds:
        timing = _round(run, work, events)
        run.result.rounds.append(timing)
        run.result.sent_bytes += timing.sent_bytes
        run.result.received_bytes += timing.received_bytes
        if round_hook is not None:
            round_hook(work.index)
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


def _round(run: _Run, work, events: Optional[list] = None) -> RoundTiming:
    """One round on this rank; a local failure is recorded in `run.failure` and raised on
    every rank at the next agreement. The round's buffers die with this frame. On CUDA,
    appends (timing, start, end) events around the round's device work to `events`."""
    prog, before, sources, new, live, device = run.prog, run.before, run.sources, run.new, run.live, run.device
    rank, fault, result = run.rank, run.fault, run.result
    timing = RoundTiming(work.index)
    t0 = time.perf_counter()
    step = "alloc"
    peer = None
    sends, recvs, out_streams, in_streams = [], [], [], []
    try:
        if run.failure is not None:  # an earlier round failed here: go straight to agree
            raise _Skip()
        for unit in work.allocs:
            step = f"alloc {unit}"
            allocate(prog, unit, new, live, device, run.aliased, run.host_after)
        for alias in work.aliases:
            step = f"keep {alias.dst_unit} {alias.tensor}"
            tensor = before[alias.src_unit][alias.tensor]
            slot = new.setdefault(alias.dst_unit, {})
            if alias.tensor not in slot:
                slot[alias.tensor] = tensor
                if alias.dst_unit not in run.host_after:
                    live.add(tensor)
            run.written[(alias.dst_unit, alias.tensor)] = tensor.numel()
            result.kept_bytes += tensor.numel() * tensor.element_size()
        for piece in work.copies:  # allocated now, copied while the messages travel
            step = f"alloc {piece.dst_unit} {piece.tensor}"
            destination(prog, new, live, device, piece, run.host_after)
        planned = run.plan.rounds[work.index]  # which pieces join the peer streams: from the program
        host_sources = run.host_before | run.staged
        for msg, in_stream in zip(work.sends, planned.send_in_stream):
            step, peer = "pack send", msg.peer
            sends.append(outgoing(msg, sources, device, in_stream, host_sources))
        for msg, in_stream in zip(work.recvs, planned.recv_in_stream):
            step, peer = "alloc recv", msg.peer
            recvs.append(incoming(msg, prog, new, live, device, in_stream, run.host_after))
        if run.host_before or run.host_after:  # nothing offloaded (the common case): no piece to scan
            result.offload_bytes += offload.round_bytes(work, run.host_before, run.host_after)
        step, peer = "alloc stream buffers", None
        out_streams = peer_streams(sends, device, run.chunk_bytes, run.depth)
        in_streams = peer_streams(recvs, device, run.chunk_bytes, run.depth)
        if fault == (rank, work.index, "pack"):
            raise InjectedFault("injected fault (pack)")
    except _Skip:
        pass
    except Exception as error:  # noqa: BLE001
        run.failure = Failure(rank, work.index, step, peer, f"{type(error).__name__}: {error}")
    timing.local_s = time.perf_counter() - t0
    agree(run.failure, run.control, prog.source, prog.target)
    sums_in = []
    buffers = sum(s.buffer_bytes for s in out_streams + in_streams)
    if device.type != "cuda":  # off CUDA, pieces read from host memory (offloaded or staged-out
        # units) pack in host memory, as in the compiler's replay; on CUDA the stream buffer
        # NCCL sends from is device memory and counts whole
        buffers = max(buffers - sum(w.host_packed_bytes for w in sends), 0)
    result.buffer_peak_bytes = max(result.buffer_peak_bytes, buffers)
    live.peak = max(live.peak, live.bytes + buffers)  # transient message buffers count too

    t1 = time.perf_counter()
    timing.posted_at_s = t1 - run.started
    group = run.group
    marks = None
    if device.type == "cuda" and events is not None:
        marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        marks[0].record(torch.cuda.current_stream(device))
    try:
        # Large pieces go first, straight from and into the shards; then the per-peer
        # streams of the packed pieces (streams.py: chunked, packing overlaps sending);
        # same-GPU copies run meanwhile (on a side stream on CUDA). Every rank posts every
        # op of the round whatever happens locally (sizes come from the program), so a
        # local failure here cannot leave a peer waiting: it is recorded and aborts the
        # transition at the next agreement.
        requests = _post(_p2p_ops(sends, dist.isend, group), _p2p_ops(recvs, dist.irecv, group))
        late_error = None
        try:
            if fault == (rank, work.index, "post"):
                raise InjectedFault("injected fault (post)")
        except Exception as error:  # noqa: BLE001 - the streams are posted anyway
            late_error = (step, peer, error.with_traceback(None))
        # same-GPU copies overlap the transfers on a side stream (COPIES_AFTER: queued on
        # the compute stream after the exchange instead, so they never contend with it)
        side = copy_stream(device) if work.copies and not COPIES_AFTER else None
        if not COPIES_AFTER:
            late_error = late_error or _copies(run, work, side)
        step, peer = "exchange", None
        streamed = streams.exchange(out_streams, in_streams, group, depth=run.depth)  # whatever failed: every op posts
        late_error, streamed = late_error or streamed, None
        if COPIES_AFTER:
            late_error = late_error or _copies(run, work, None)
        out_ops, in_ops = [], []
        if run.verify:  # after every data op of its peer: the last batch, on the first data group
            group = group[0] if isinstance(group, (list, tuple)) else group
            for w in sends:
                sums = torch.tensor([c for v in w.views for c in packing.checksum(v)], dtype=torch.int64)
                out_ops.append((1 << 30, dist.P2POp(dist.isend, sums.to(device), w.msg.peer, group,
                                                    _VERIFY_TAG + w.msg.op_index)))
            for w in recvs:
                sums = torch.empty(2 * len(w.msg.pieces), dtype=torch.int64, device=device)
                sums_in.append(sums)
                in_ops.append((1 << 30, dist.P2POp(dist.irecv, sums, w.msg.peer, group, _VERIFY_TAG + w.msg.op_index)))
        requests += _post(out_ops, in_ops)
        try:
            for req in requests:
                req.wait()
        finally:
            if side is not None:
                torch.cuda.current_stream(device).wait_stream(side)
            if marks is not None:  # after the waits: the round's transfers, copies and unpacks
                marks[1].record(torch.cuda.current_stream(device))
                events.append((timing, *marks))
        if late_error is not None:
            # kept without its traceback, and dropped before it is raised: a live exception
            # in a local ties this frame (the round's buffers; through f_back the process
            # groups) into a cycle with its traceback that only the cyclic GC frees, and gloo
            # groups alive at interpreter exit can abort it (tests/runtime/test_abort_cycles.py)
            (step, peer, error), late_error = late_error, None
            raise error
        timing.exchange_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        for i, w in enumerate(recvs):
            step, peer = "unpack recv", w.msg.peer
            for bounce, view in w.bounce:  # a direct piece into host memory (offloaded unit)
                view.copy_(bounce)
            for p in w.msg.pieces:
                run.written[(p.dst_unit, p.tensor)] = run.written.get((p.dst_unit, p.tensor), 0) + p.numel
            if run.verify:
                got = [c for v in w.views for c in packing.checksum(v)]
                if got != sums_in[i].tolist():
                    run.verified = False
                    raise ProgramError(f"checksum mismatch in the message from {w.msg.peer}")
            if fault == (rank, work.index, "unpack"):
                raise InjectedFault("injected fault (unpack)")
        peer = None
        timing.unpack_s = time.perf_counter() - t2
        for unit in work.stage_outs:
            step = f"stage_out {unit}"
            _stage_out(run, unit)
        for unit in work.frees:
            step = f"free {unit}"
            _free(run, unit)
    except Exception as error:  # noqa: BLE001
        run.failure = Failure(rank, work.index, step, peer, f"{type(error).__name__}: {error}")
    timing.sent_bytes = sum(w.msg.nbytes for w in sends)
    timing.received_bytes = sum(w.msg.nbytes for w in recvs)
    timing.messages = len(sends) + len(recvs)
    timing.seconds = time.perf_counter() - t0
    return timing


# Where a round's same-GPU copies run on CUDA: False = on a side stream while the messages
# travel (the default); True = on the compute stream after the exchange (NEREUS_COPIES_AFTER=1,
# for measuring whether the copies slow the transfers down).
COPIES_AFTER = os.environ.get("NEREUS_COPIES_AFTER", "0") == "1"


def _copies(run: _Run, work, side) -> Optional[tuple]:
    """Queue the round's same-GPU copies (on `side` when given); returns the first local
    failure as (step, peer, exception without traceback), or None."""
    step = f"copy {len(work.copies)} pieces"
    try:
        with torch.cuda.stream(side) if side is not None else nothing():
            _copy_pieces(run, work.copies)
    except Exception as error:  # noqa: BLE001
        return step, None, error.with_traceback(None)
    return None


def _copy_pieces(run: _Run, pieces) -> None:
    """Same-GPU pieces, batched by `packing.copy_pairs` (an expert-parallel round has
    thousands: one Python step and copy launch each cost more than the bytes)."""
    written, sources, new = run.written, run.sources, run.new
    dsts, srcs = [], []
    for piece in pieces:
        srcs.append(src_region(piece, sources[piece.src_unit][piece.tensor]))
        dsts.append(dst_region(piece, new[piece.dst_unit][piece.tensor]))
        written[(piece.dst_unit, piece.tensor)] = written.get((piece.dst_unit, piece.tensor), 0) + piece.numel
        run.result.copied_bytes += piece.nbytes
    packing.copy_pairs(dsts, srcs)


def _stage_out(run: _Run, unit: str) -> None:
    """Move a before-unit's shards to host memory; later copies and sends read them there.
    rollback="host": the host copy is also the parked copy and the device tensor goes."""
    if unit in run.staged:
        return
    names = tuple(run.prog.before[unit])
    for name in names:
        if unit not in run.host_before:
            run.live.remove(run.before[unit][name])
    copies = run.parking.release(unit, names, wait=True) if run.parking is not None else {}
    for name in names:
        tensor = run.before[unit][name]
        if name in copies:
            run.sources[unit][name] = copies[name]
        else:
            run.sources[unit][name] = tensor if tensor.device.type == "cpu" else tensor.to("cpu")
    run.staged.add(unit)


def _free(run: _Run, unit: str) -> None:
    """Release a before-unit's shards. rollback="device": only from the live-bytes account
    (the caller still holds them until the commit); "host": parked, then dropped."""
    if unit not in run.staged:
        names = tuple(run.prog.before[unit])
        for name in names:
            if unit not in run.host_before:
                run.live.remove(run.before[unit][name])
        if run.parking is not None:
            run.parking.release(unit, names)
    run.sources[unit] = {}


_VERIFY_TAG = 1 << 24


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from rich.progress import Progress

    bar = Progress(transient=False)
    bar.start()
    return bar, bar.add_task("transition", total=total)
