"""One round of a rank program on this rank, and the state the rounds share (executor.py
runs them: the agreements, the commit, the rollback around them).

Input: the rank program's round (program.RoundWork), its execution plan (which pieces
stream, every piece's view, the streams' chunks, the deferred destinations) and the
live tensors. Output: the round's destination shards written, the freed before-shards
released (parked where rollback asks), a RoundTiming. Invariant: every rank posts
every op of the round whatever fails locally after the agreement (sizes come from the
program), so a local failure never leaves a peer waiting; it is recorded in the run and
raised on every rank at the next agreement or the commit.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import ProgramError, env_flag

from . import offload, packing, replay, streams
from .allocator import reserve_ahead
from .checksums import message_sums, mismatch
from .control import Failure, agree
from .posting import p2p_ops as _p2p_ops, post as _post
from .program import RankProgram
from .wires import Live, allocate, copy_stream, destination, incoming, nothing, outgoing, planned_streams, \
    round_buffer_bytes


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
    reserved_bytes: int = 0  # CUDA: the block allocator.reserve_ahead left for the round's allocations


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
    # with `execute(agreement=...)`: every rank's row, as the first agreement gathered it
    agreed_rows: Optional[list] = None


class _Run:
    """Mutable state of one rank's transition, shared by its rounds."""

    def __init__(self, prog: RankProgram, before: dict, parking, group, control, device, live: Live,
                 verify: bool, fault, offloaded: frozenset, plan, depth: int, started: float,
                 agreement: Optional[tuple] = None):
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
        self.depth = depth  # the packed streams' ring depth
        self.started = started  # time.perf_counter() at the start of the execution
        self.agreement = agreement  # (row, fresh) for the first agreement, then None (agree_first)
        # after-shards a keep hands over in place (not allocated)
        self.aliased = plan.aliased


def agree_first(run: _Run) -> None:
    """The agreement before a round's data moves; the first one carries `run.agreement`."""
    if run.agreement is None:
        agree(run.failure, run.control, run.prog.source, run.prog.target)
        return
    (row, fresh), run.agreement = run.agreement, None
    run.result.agreed_rows = agree(run.failure, run.control, run.prog.source, run.prog.target, row, fresh)


def run_round(run: _Run, work, events: Optional[list] = None) -> RoundTiming:
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
    buffers = 0  # device bytes of the round's message buffers (wires.round_buffer_bytes)
    try:
        if run.failure is not None:  # an earlier round failed here: go straight to agree
            raise _Skip()
        planned = run.plan.rounds[work.index]  # what the program alone decides (execution_plan.py)
        # shards only copies and slot-received chunks write: allocated when first written,
        # after the agreement, while the transfers run (counted in `live` from now on, as
        # the compiler's replay counts them); a failure then is reported at the commit,
        # every op posted all the same. Not with verify (every view is taken up front),
        # nor into host memory.
        deferred = frozenset() if run.verify or not DEFER_DESTINATIONS else planned.deferred
        if run.host_after and deferred:
            deferred = frozenset(k for k in deferred if k[0] not in run.host_after)
        for unit, name in deferred:
            if name not in new.get(unit, {}):
                live.reserve((unit, name), prog.after[unit][name].nbytes)
        # one cudaMalloc for what the cache lacks, not one per shard (allocator.py)
        timing.reserved_bytes = reserve_ahead(device, sum(n for unit, n in planned.alloc_bytes
                                                          if unit not in run.host_after))
        for unit in work.allocs:
            step = f"alloc {unit}"
            allocate(prog, unit, new, live, device, run.aliased, run.host_after, deferred)
        for alias in work.aliases:
            shards, slot = before[alias.src_unit], new.setdefault(alias.dst_unit, {})
            for name in alias.tensors:
                step = f"keep {alias.dst_unit} {name}"
                tensor = shards[name]
                if name not in slot:
                    slot[name] = tensor
                    if alias.dst_unit not in run.host_after:
                        live.add(tensor)
                run.written[(alias.dst_unit, name)] = tensor.numel()
                result.kept_bytes += tensor.numel() * tensor.element_size()
        for piece in work.copies:  # allocated now (unless deferred), copied while the messages travel
            for name in piece.tensors:
                if (piece.dst_unit, name) not in deferred:
                    step = f"alloc {piece.dst_unit} {name}"
                    destination(prog, new, live, device, piece.dst_unit, name, run.host_after)
        host_sources = run.host_before | run.staged
        for msg, in_stream, regions in zip(work.sends, planned.send_in_stream, planned.send_regions):
            step, peer = "pack send", msg.peer
            sends.append(outgoing(msg, sources, device, in_stream, regions, host_sources))
        for msg, in_stream, regions in zip(work.recvs, planned.recv_in_stream, planned.recv_regions):
            step, peer = "alloc recv", msg.peer
            recvs.append(incoming(msg, prog, new, live, device, in_stream, regions, run.host_after, deferred))
        if run.host_before or run.host_after:  # nothing offloaded (the common case): no piece to scan
            result.offload_bytes += offload.round_bytes(work, run.host_before, run.host_after)
        step, peer = "alloc stream buffers", None
        # the streams' chunks come from the plan: one as_strided per segment of the live tensors
        out_streams = planned_streams(planned.send_streams, lambda p, name: sources[p.src_unit][name], device,
                                      run.depth, functools.partial(replay.bind_stream, run.plan, work.index, "send",
                                                                   device))
        in_streams = planned_streams(planned.recv_streams, lambda p, name: _destination_now_or_later(run, p, name),
                                     device, run.depth, functools.partial(replay.bind_stream, run.plan, work.index,
                                                                          "recv", device))
        buffers = round_buffer_bytes(planned, work, run.depth, host_sources, run.host_after)
        step = "pack"
        if fault == (rank, work.index, "pack"):
            raise InjectedFault("injected fault (pack)")
    except _Skip:
        pass
    except Exception as error:  # noqa: BLE001
        run.failure = Failure(rank, work.index, step, peer, f"{type(error).__name__}: {error}")
    timing.local_s = time.perf_counter() - t0
    agree_first(run)
    sums_in = []
    # counted as a GPU allocates them on every device (a CPU run accounts its buffers as the
    # memory model proves them: nereus.passes.memory_model)
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
        step, peer = "post", None
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
        copied = []

        def copies_now() -> None:  # once the stream's first batch is posted (streams.exchange)
            if not COPIES_AFTER:
                copied.append(_copies(run, work, side))

        step, peer = "exchange", None
        # whatever failed: every op posts
        streamed = streams.exchange(out_streams, in_streams, group, depth=run.depth, after_first=copies_now)
        late_error, streamed = late_error or (copied[0] if copied else None) or streamed, None
        if COPIES_AFTER:
            late_error = late_error or _copies(run, work, None)
        out_ops, in_ops = [], []
        if run.verify:  # after every data op of its peer: the last batch, on the first data group
            group = group[0] if isinstance(group, (list, tuple)) else group
            for w in sends:  # the regions the receiver expects, read through the shards' boxes (checksums.py)
                sums = torch.tensor(message_sums(w.msg, sources, prog.before, True), dtype=torch.int64)
                out_ops.append((1 << 30, dist.P2POp(dist.isend, sums.to(device), w.msg.peer, group,
                                                    _VERIFY_TAG + w.msg.op_index)))
            for w in recvs:
                sums = torch.empty(2 * sum(p.count for p in w.msg.pieces) + 1, dtype=torch.int64, device=device)
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
        for w in recvs:
            step, peer = "unpack recv", w.msg.peer
            for bounce, view in w.bounce:  # a direct piece into host memory (offloaded unit)
                view.copy_(bounce, non_blocking=True)  # queued: the commit synchronizes first
        if run.verify and device.type == "cuda" and (run.host_after or run.host_before):
            torch.cuda.current_stream(device).synchronize()  # host views written by queued copies
        for i, w in enumerate(recvs):
            step, peer = "unpack recv", w.msg.peer
            _count_written(run.written, w.msg.pieces)
            if run.verify:  # the regions this rank expects written, read through its shards' boxes
                got, sent = message_sums(w.msg, new, prog.after, False), sums_in[i].tolist()
                if got != sent:
                    run.verified = False
                    raise ProgramError(f"checksum mismatch in the message from {w.msg.peer} (op {w.msg.op_index}): "
                                       f"{mismatch(w.msg, got, sent)}")
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
COPIES_AFTER = env_flag("NEREUS_COPIES_AFTER", False)
# Whether after-shards that only copies and slot-received chunks write are allocated when
# first written, after the round's agreement (RoundPlan.deferred; NEREUS_DEFER_DESTINATIONS=1),
# or all before it as the compiler's replay orders them (the default). Off since session 8:
# on 2 H200s, interleaved in one process, deferring made a weight sync to tp 2 dp 1 24.8 ms
# against 20.4 ms and TP -> DP of 8 layers 12.0 against 11.2 ms (its copies wait, on the side
# stream, for the current stream's work queued before each late allocation); it saved host
# time on CPUs only (benchmarks/RESULTS.md, "session 8 ... 2 x H200").
DEFER_DESTINATIONS = env_flag("NEREUS_DEFER_DESTINATIONS", False)


def _destination_now_or_later(run: _Run, piece, name: str):
    """A received piece's destination shard of tensor `name`, or for a deferred one not
    allocated yet a function that allocates it (PeerStream.planned calls it when the
    chunk is unpacked)."""
    shard = run.new.get(piece.dst_unit, {}).get(name)
    if shard is not None:
        return shard
    return functools.partial(destination, run.prog, run.new, run.live, run.device, piece.dst_unit, name,
                             run.host_after)


def _count_written(written: dict, pieces) -> None:
    """Add each piece's elements to `written` per (after-unit, tensor) it writes."""
    for p in pieces:
        unit, numel = p.dst_unit, p.numel
        for name in p.tensors:
            written[(unit, name)] = written.get((unit, name), 0) + numel


def _copies(run: _Run, work, side) -> Optional[tuple]:
    """Queue the round's same-GPU copies (on `side` when given); returns the first local
    failure as (step, peer, exception without traceback), or None. Deferred destinations
    are allocated first, on the current stream: a block allocated under the side stream
    would belong to that stream's pool after the new state is handed over."""
    step = f"copy {len(work.copies)} pieces"
    try:
        for piece in work.copies:
            for name in piece.tensors:
                destination(run.prog, run.new, run.live, run.device, piece.dst_unit, name, run.host_after)
        if side is not None:
            # a destination just allocated may reuse a block that work queued on the current
            # stream since `side` last waited for it (a temporary freed meanwhile) still
            # writes: the copies come after that work
            side.wait_stream(torch.cuda.current_stream(run.device))
        with torch.cuda.stream(side) if side is not None else nothing():
            _copy_pieces(run, work.copies, work.index)
    except Exception as error:  # noqa: BLE001
        return step, None, error.with_traceback(None)
    return None


def _copy_pieces(run: _Run, pieces, index: int) -> None:
    """Same-GPU pieces, batched by `packing.copy_pairs` (an expert-parallel round has
    thousands: one Python step and copy launch each cost more than the bytes)."""
    sources, new = run.sources, run.new
    _count_written(run.written, pieces)
    run.result.copied_bytes += sum(piece.total_bytes for piece in pieces)
    # CUDA: one replayed launch per access class, its tables kept with the plan (replay.py)
    if replay.copies(run.plan, run.prog, index, pieces, sources, new, run.device):
        return
    dsts, srcs = [], []
    for piece, (src, dst) in zip(pieces, run.plan.rounds[index].copy_regions):
        shards, slot = sources[piece.src_unit], new[piece.dst_unit]
        for name in piece.tensors:
            srcs.append(src.view(shards[name]))
            dsts.append(dst.view(slot[name]))
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
            # pinned where CUDA exists: the pack kernels then read it in place over PCIe
            # (offload.py); a pageable copy would be packed on one CPU thread
            run.sources[unit][name] = tensor if tensor.device.type == "cpu" else offload.to_host(tensor)
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
