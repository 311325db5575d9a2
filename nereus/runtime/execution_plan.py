"""What the executor derives from a rank program alone, computed once per program.

Input: a RankProgram and the packed streams' chunk size. Output: an ExecutionPlan: the
after-shards a keep hands over in place and the before-shards it keeps, per round the
peers this rank exchanges with in both directions and, per message, which pieces travel
in the peer's packed stream (streams.streamed), every piece's region of its local tensor
(wires.Region) and the chunks of every peer stream (streams.plan_chunks), the bytes of
the shards it allocates first (for allocator.reserve_ahead), and the parking
replay of rollback="auto" per resident bytes (parking.park_replay). Why: slicing each
piece and cutting each stream again cost every execution ~1-2 us of host time per piece
and segment (thousands of them in a large transition) before the first byte moved; from
the plan a view is one `as_strided`. Invariant: nothing here depends on the live
tensors, so a plan built once serves every later execution of the same program.
`plan_for` caches plans by the program object's identity for as long as that object
lives, so a Runtime moving back and forth between plans (it keeps its lowered programs)
builds each plan once, and callers need not pass anything.
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from . import streams
from .allocator import block_bytes
from .parking import ParkReplay, park_replay
from .program import RankProgram
from .wires import TORCH_DTYPES, region


@dataclass(frozen=True)
class StreamPlan:
    """One direction of a round's packed stream with one peer, by shape alone. Its views
    (a chunk segment's `view`) are the packed pieces' tensors in order: piece i's k-th
    tensor is view `starts[i] + k`."""

    peer: int
    pieces: tuple  # the packed pieces in stream order (message order)
    chunks: tuple  # streams.ChunkPlan; segment.view indexes the pieces' tensors (see `members`)
    starts: tuple = ()  # per piece, the index of its first tensor among the stream's views

    def members(self) -> list:
        """[(piece, tensor)] per view of the stream, in order."""
        return [(p, name) for p in self.pieces for name in p.tensors]

    def member(self, view: int) -> tuple:
        """(piece, tensor) of the stream's view `view`."""
        i = bisect.bisect_right(self.starts, view) - 1
        piece = self.pieces[i]
        return piece, piece.tensors[view - self.starts[i]]


@dataclass(frozen=True)
class RoundPlan:
    both_ways: frozenset  # peers this rank sends to and receives from in the round
    send_in_stream: tuple  # per message of work.sends: (per piece: travels in the peer's stream)
    recv_in_stream: tuple  # the same for work.recvs
    send_regions: tuple = ()  # per message of work.sends: (per piece: its wires.Region in the source shard)
    recv_regions: tuple = ()  # the same for work.recvs, in the destination shard
    copy_regions: tuple = ()  # per piece of work.copies: (source Region, destination Region)
    send_streams: tuple = ()  # StreamPlan per peer with packed pieces to send (first-message order)
    recv_streams: tuple = ()  # the same for receiving
    # (after-unit, tensor) written in this round only by received chunks that do not
    # travel in place and by same-GPU copies: allocated when first written, after the
    # round's agreement, overlapping the transfers (see rounds.run_round)
    deferred: frozenset = frozenset()
    # ((after-unit, bytes), ...): the large-pool bytes (allocator.block_bytes) of the
    # after-shards first allocated in this round, per unit (an offloaded unit's are host
    # memory: the executor leaves them out); allocator.reserve_ahead makes room for them
    alloc_bytes: tuple = ()


@dataclass(frozen=True)
class ExecutionPlan:
    aliased: frozenset  # (after-unit, tensor) handed over in place by a keep (never allocated)
    kept: frozenset  # (before-unit, tensor) handed over in place by a keep (never released)
    rounds: tuple  # RoundPlan per round of the program
    _replays: dict = field(default_factory=dict, compare=False, repr=False)  # (resident, offloaded) → ParkReplay
    # the kernel replays of the rounds' copies and stream chunks (runtime/replay.py), by round and residues
    launches: OrderedDict = field(default_factory=OrderedDict, compare=False, repr=False)
    launches_used: dict = field(default_factory=dict, compare=False, repr=False)  # key -> last execution
    # [executions so far]: replay.py builds replays from a program's second execution on
    executions: list = field(default_factory=lambda: [0], compare=False, repr=False)

    def park_replay(self, prog: RankProgram, resident_bytes: int, offloaded: frozenset = frozenset()) -> ParkReplay:
        """parking.park_replay(prog, resident_bytes, offloaded), computed once per resident
        bytes and offloaded units."""
        key = (resident_bytes, offloaded)
        if key not in self._replays:
            self._replays[key] = park_replay(prog, resident_bytes, offloaded)
        return self._replays[key]


def build_plan(prog: RankProgram, chunk_bytes: int) -> ExecutionPlan:
    """The ExecutionPlan of `prog` (module docstring). A piece of several tensors (a v2
    range) is planned once: one Region for all of its tensors (they share the shard's
    shape), one flag, and its tensors cut into a stream's chunks as runs
    (streams.plan_chunks with counts), so the plan's work grows with the pieces, not with
    the tensors they move."""
    aliases = [a for work in prog.rounds for a in work.aliases]
    metas: dict = {}

    def meta(info) -> torch.Tensor:  # a shard's shape and dtype, no memory
        key = (tuple(info.shape), info.dtype)
        if key not in metas:
            metas[key] = torch.empty(key[0], dtype=TORCH_DTYPES[info.dtype], device="meta")
        return metas[key]

    def src(p):
        return region(p, meta(prog.before[p.src_unit][p.tensors[0]]), True)

    def dst(p):
        return region(p, meta(prog.after[p.dst_unit][p.tensors[0]]), False)

    def stream_plans(messages, flags, regions_of, side: str) -> tuple:
        per_peer: dict = {}
        for msg, in_stream, regions in zip(messages, flags, regions_of):
            entry = per_peer.setdefault(msg.peer, ([], [], []))
            for p, streamed, r in zip(msg.pieces, in_stream, regions):
                if streamed:
                    info = prog.before[p.src_unit][p.tensors[0]] if side == "src" else \
                        prog.after[p.dst_unit][p.tensors[0]]
                    entry[0].append(p)
                    entry[1].append(r.view(meta(info)))
                    entry[2].append(p.count)
        plans = (StreamPlan(peer, tuple(pieces), streams.plan_chunks(views, chunk_bytes, counts=counts),
                            tuple(itertools.accumulate(counts, initial=0))[:-1])
                 for peer, (pieces, views, counts) in per_peer.items())
        return tuple(plan for plan in plans if plan.chunks)

    aliased = frozenset((a.dst_unit, name) for a in aliases for name in a.tensors)
    rounds = []
    allocated = set(aliased)  # keeps hand these over: never allocated
    for work in prog.rounds:
        both_ways = frozenset({m.peer for m in work.sends} & {m.peer for m in work.recvs})

        send_flags, recv_flags = _flags(work.sends, both_ways, chunk_bytes), _flags(work.recvs, both_ways, chunk_bytes)
        send_regions = tuple(tuple(src(p) for p in m.pieces) for m in work.sends)
        recv_regions = tuple(tuple(dst(p) for p in m.pieces) for m in work.recvs)
        recv_streams = stream_plans(work.recvs, recv_flags, recv_regions, "dst")
        rounds.append(RoundPlan(both_ways, send_flags, recv_flags, send_regions, recv_regions,
                                tuple((src(p), dst(p)) for p in work.copies),
                                stream_plans(work.sends, send_flags, send_regions, "src"), recv_streams,
                                _deferred(work, recv_flags, recv_streams), _alloc_bytes(prog, work, allocated)))
    return ExecutionPlan(aliased, frozenset((a.src_unit, name) for a in aliases for name in a.tensors),
                         tuple(rounds))


def _deferred(work, recv_flags: tuple, recv_streams: tuple) -> frozenset:
    """The round's after-shards that no op needs before the data moves: written only by
    same-GPU copies and by received chunks that land in a ring slot (not in place)."""
    written = {(p.dst_unit, name) for p in work.copies for name in p.tensors}
    needed = {(a.dst_unit, name) for a in work.aliases for name in a.tensors}
    for msg, flags in zip(work.recvs, recv_flags):
        for p, streamed in zip(msg.pieces, flags):
            (written if streamed else needed).update((p.dst_unit, name) for name in p.tensors)
    for plan in recv_streams:
        for chunk in plan.chunks:
            if chunk.single:  # may be received into the shard itself: it must exist at the post
                for s in chunk.segments:
                    piece, name = plan.member(s.view)
                    needed.add((piece.dst_unit, name))
    return frozenset(written - needed)


def _alloc_bytes(prog: RankProgram, work, allocated: set) -> tuple:
    """Per after-unit, the large-pool bytes of its shards the round allocates first (alloc
    ops, copy and receive destinations, deferred or not); adds them to `allocated`."""
    keys = [(unit, name) for unit in work.allocs for name in prog.after.get(unit, {})]
    keys += [(p.dst_unit, name) for p in work.copies for name in p.tensors]
    keys += [(p.dst_unit, name) for m in work.recvs for p in m.pieces for name in p.tensors]
    per_unit: dict = {}
    for key in keys:
        if key not in allocated:
            allocated.add(key)
            per_unit[key[0]] = per_unit.get(key[0], 0) + block_bytes(prog.after[key[0]][key[1]].nbytes)
    return tuple((unit, n) for unit, n in per_unit.items() if n)


def _flags(messages, both_ways: frozenset, chunk_bytes: int) -> tuple:
    return tuple(tuple(streams.streamed(p, m.peer in both_ways, chunk_bytes) for p in m.pieces) for m in messages)


_PLANS: dict = {}  # id(program) → {(chunk_bytes, switches): ExecutionPlan}, dropped with the program


def plan_for(prog: RankProgram, chunk_bytes: int) -> ExecutionPlan:
    """The ExecutionPlan of `prog` for streams of `chunk_bytes` (and the streams' switches
    as they are now: ALONE_BYTES, IN_PLACE, BOTH_DIRECT_MIN), built on first use."""
    key = id(prog)
    plans = _PLANS.get(key)
    if plans is None:
        plans = _PLANS[key] = {}
        weakref.finalize(prog, _PLANS.pop, key, None)  # an id is reused only after its object died
    switches = (chunk_bytes, streams.ALONE_BYTES, streams.IN_PLACE, streams.BOTH_DIRECT_MIN)
    if switches not in plans:
        plans[switches] = build_plan(prog, chunk_bytes)
    return plans[switches]
