"""lower: (TransitionDag, Schedule, messages) → Program: rounds of typed ops, per-rank lists.

Input: the DAG, its memory-safe `Schedule` (or none: then everything runs in one round,
which is correct whenever memory allows) and the messages of each round (fused or not).
Output: a `Program`, still symbolic (an op covers a layer range); `ops()` yields the ops
of each round in execution order — allocs, keeps, copies, sends, stage_outs, frees — and
`rank_ops(rank)` the ops one rank executes (a send appears as `send` on its source and
`recv` on its destination, in the same round, in the same pair order on both sides).
Invariant: every send has exactly one matching receive in the same round, so a round is
one deadlock-free `batch_isend_irecv`. JSON emission (backends/json_program.py) expands
layer ranges into per-layer tensor names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

from .dag import COPY, KEEP, TransitionDag
from .fusion import Message, unfused
from .memory_model import DEFAULT
from .resources import Round, Schedule


@dataclass(frozen=True)
class Program:
    dag: TransitionDag
    schedule: Schedule
    messages: tuple[tuple[Message, ...], ...]

    @property
    def num_rounds(self) -> int:
        return len(self.schedule.rounds)

    def ops(self) -> Iterator[tuple[int, str, object]]:
        """(round, kind, record) in execution order: kind in alloc | keep | copy | send |
        stage_out | free; record an Alloc, Xfer, Message or Free index's record."""
        for k, (rnd, messages) in enumerate(zip(self.schedule.rounds, self.messages)):
            for a in rnd.allocs:
                yield k, "alloc", a
            for x in rnd.xfers:
                if x.kind == KEEP:
                    yield k, "keep", x
            for x in rnd.xfers:
                if x.kind == COPY:
                    yield k, "copy", x
            for m in messages:
                yield k, "send", m
            for f in rnd.stage_outs:
                yield k, "stage_out", f
            for f in rnd.frees:
                yield k, "free", f

    def rank_ops(self, rank: int) -> list[list[tuple[str, object]]]:
        """Per round, the ops rank `rank` executes; sends split into send / recv halves."""
        out: list[list[tuple[str, object]]] = [[] for _ in range(self.num_rounds)]
        dag = self.dag
        for k, kind, record in self.ops():
            if kind == "send":
                if record.src == rank:
                    out[k].append(("send", record))
                if record.dst == rank:
                    out[k].append(("recv", record))
            elif kind in ("alloc",):
                if dag.allocs[record].gpu == rank:
                    out[k].append((kind, record))
            elif kind in ("free", "stage_out"):
                if dag.frees[record].gpu == rank:
                    out[k].append((kind, record))
            elif record.dst_gpu == rank:
                out[k].append((kind, record))
        return out


def single_round(dag: TransitionDag, memory_model: str = DEFAULT) -> Schedule:
    """Everything in one round: allocs, transfers, frees (no memory reasoning; the
    program it lowers into records `memory_model`)."""
    rnd = Round(tuple(range(len(dag.allocs))), dag.xfers, (), tuple(range(len(dag.frees))))
    return Schedule((rnd,), (), 0, 0, memory_model=memory_model)


def lower(dag: TransitionDag, schedule: Optional[Schedule] = None,
          messages: Optional[tuple[tuple[Message, ...], ...]] = None, memory_model: str = DEFAULT) -> Program:
    """Assemble the program (module docstring); `memory_model` for a program without a
    schedule (a schedule states its own)."""
    schedule = schedule or single_round(dag, memory_model)
    if messages is None:
        messages = unfused(schedule)
    return Program(dag, schedule, messages)
