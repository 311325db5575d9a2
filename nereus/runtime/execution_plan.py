"""What the executor derives from a rank program alone, computed once per program.

Input: a RankProgram and the packed streams' chunk size. Output: an ExecutionPlan: the
after-shards a keep hands over in place and the before-shards it keeps, per round the
peers this rank exchanges with in both directions and, per message, which pieces travel
in the peer's packed stream (streams.streamed), and the parking replay of rollback="auto"
per resident bytes (parking.park_replay). Invariant: nothing here depends on the live
tensors, so a plan built once serves every later execution of the same program.
`plan_for` caches plans by the program object's identity for as long as that object
lives, so a Runtime moving back and forth between plans (it keeps its lowered programs)
builds each plan once, and callers need not pass anything.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from . import streams
from .parking import ParkReplay, park_replay
from .program import RankProgram


@dataclass(frozen=True)
class RoundPlan:
    both_ways: frozenset  # peers this rank sends to and receives from in the round
    send_in_stream: tuple  # per message of work.sends: (per piece: travels in the peer's stream)
    recv_in_stream: tuple  # the same for work.recvs


@dataclass(frozen=True)
class ExecutionPlan:
    aliased: frozenset  # (after-unit, tensor) handed over in place by a keep (never allocated)
    kept: frozenset  # (before-unit, tensor) handed over in place by a keep (never released)
    rounds: tuple  # RoundPlan per round of the program
    _replays: dict = field(default_factory=dict, compare=False, repr=False)  # resident bytes → ParkReplay

    def park_replay(self, prog: RankProgram, resident_bytes: int) -> ParkReplay:
        """parking.park_replay(prog, resident_bytes), computed once per resident bytes."""
        if resident_bytes not in self._replays:
            self._replays[resident_bytes] = park_replay(prog, resident_bytes)
        return self._replays[resident_bytes]


def build_plan(prog: RankProgram, chunk_bytes: int) -> ExecutionPlan:
    aliases = [a for work in prog.rounds for a in work.aliases]
    rounds = []
    for work in prog.rounds:
        both_ways = frozenset({m.peer for m in work.sends} & {m.peer for m in work.recvs})

        def flags(messages):
            return tuple(tuple(streams.streamed(p, m.peer in both_ways, chunk_bytes) for p in m.pieces)
                         for m in messages)

        rounds.append(RoundPlan(both_ways, flags(work.sends), flags(work.recvs)))
    return ExecutionPlan(frozenset((a.dst_unit, a.tensor) for a in aliases),
                         frozenset((a.src_unit, a.tensor) for a in aliases), tuple(rounds))


_PLANS: dict = {}  # id(program) → {chunk_bytes: ExecutionPlan}, dropped with the program


def plan_for(prog: RankProgram, chunk_bytes: int) -> ExecutionPlan:
    """The ExecutionPlan of `prog` for streams of `chunk_bytes`, built on first use."""
    key = id(prog)
    plans = _PLANS.get(key)
    if plans is None:
        plans = _PLANS[key] = {}
        weakref.finalize(prog, _PLANS.pop, key, None)  # an id is reused only after its object died
    if chunk_bytes not in plans:
        plans[chunk_bytes] = build_plan(prog, chunk_bytes)
    return plans[chunk_bytes]
