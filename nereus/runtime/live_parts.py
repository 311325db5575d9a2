"""The collective half of a transition's preparation (`Runtime` inherits it): this rank's
part of a transition compiled and lowered, restricted to the model-stages some rank
registered, and the small agreement that decides it (registration counts and Adam steps
gathered; a warm call speculates on the last counts and the executor's first agreement
checks them). Input: the module, the current plan, this rank, the control group and the
registry (`_state`), all held by the Runtime (nereus.runtime.runtime). Output: the lowered
work list, cached per (plan, target, live model-stages). Invariant: every rank derives the
same live set and the same decision from gathered values alone, so every rank takes the
same way or raises the same error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import NereusError, SemanticError
from nereus.ir.model import ModelStage
from nereus.passes.layout import unit_id

from .ahead import lower_part
from .control import collectives, gather_flagged
from .local_state import known_plan
from .program import part_facts, rank_program, restrict_program
from .state import step_name


class LiveParts:
    """Mixin of `Runtime`: see the module docstring. Uses the Runtime's `module`, `rank`,
    `world_size`, `direct_min_bytes`, `_plan`, `_state`, `_control`, `_trained`,
    `_registrations`, the caches `_programs`, `_lowered`, `_lowered_figures`,
    `_lowered_ahead`, `_unused_lowering`, `_gathered`, `_live_known`, and `_compiled`."""

    def _speculation(self, target: str) -> Optional[tuple]:
        """(lowered program, its key, the registration counts it assumes) of a warm
        transition to `target`, or None. Warm: compiled and lowered before for the live
        model-stages that the last gathered registration counts gave. The executor's first
        agreement then carries this rank's row (`_row`) instead of a collective of its own
        (`_live_stages`); when some rank's count differs, every rank raises Stale there and
        the transition starts over the full way. Every input is the same on every rank (the
        gathered counts and what was derived from them), so every rank takes the same way."""
        known_plan(self.module, target)
        self._check_ranks(target)
        if self._gathered is None or (self._plan, target) not in self._programs:
            return None
        counts = self._gathered[0]
        live = self._live_known.get((self._plan, target, counts))
        key = (self._plan, target, tuple(sorted(live))) if live is not None else None
        if key not in self._lowered:
            return None
        return self._lowered[key], key, counts

    def _row(self) -> list:
        """This rank's registration count and the Adam step of each training model-stage."""
        return [self._registrations] + [self._local_step(ms) for ms in self._trained]

    def _steps(self, rows: list) -> dict:
        """{training model-stage: the max of its Adam step over the ranks (-1: none holds one)}."""
        return {ms: max(row[1 + i] for row in rows) for i, ms in enumerate(self._trained)}

    def _lower(self, target: str) -> tuple:
        """Collective: (compile seconds of this call (0 when cached), this rank's lowered
        program restricted to the live model-stages, its cache key, {training model-stage:
        Adam step, max over ranks, -1 where no rank holds one}). What the call derives from
        the JSON part (resident and capacity bytes, offloaded units) is in
        `_lowered_figures[key]`; the parsed part itself is not kept (see `_programs`). A
        peer gone meanwhile: TransitionAborted, not gloo's error."""
        known_plan(self.module, target)
        self._check_ranks(target)
        cached = (self._plan, target) in self._programs
        with collectives(self._plan, target, "compile"):
            # the part lowered into this rank's work list while rank 0's prover proves it
            # (unrestricted: every model-stage is live unless some rank registered fewer)
            text, compile_s, untouched, early = self._compiled(target, self._lower_part)
            try:
                live, steps = self._live_stages(target, untouched)
            except BaseException:
                if early is not None:  # for the retry
                    self._unused_lowering[(self._plan, target)] = early
                raise
        if cached:
            compile_s = 0.0
        key = (self._plan, target, tuple(sorted(live)))
        if key not in self._lowered:  # a job moving back and forth restricts and lowers each program once
            (facts, lowered), from_thread = early if early is not None else ((None, None), False)
            program = None
            if facts is None:
                program = json.loads(text)
                facts = part_facts(program, self.rank)
            if facts.model_stages - live:  # some rank registered fewer: the part restricted to the rest
                program = restrict_program(program if program is not None else json.loads(text), live)
                facts, lowered, from_thread = part_facts(program, self.rank), None, False
            if lowered is None:
                lowered = rank_program(program, self.rank, self.direct_min_bytes)
            self._lowered[key] = lowered
            self._lowered_figures[key] = _Lowered(facts.resident_bytes, facts.capacity_bytes, facts.offloaded)
            if from_thread:
                self._lowered_ahead[(self._plan, target)] = True
        return compile_s, self._lowered[key], key, steps

    def _lower_part(self, text: str) -> tuple:
        """ahead.lower_part for this rank: run while rank 0's prover proves."""
        return lower_part(text, self.rank, self.direct_min_bytes)

    # -- helpers -----------------------------------------------------------------------

    def _check_ranks(self, plan: str) -> None:
        for placement in self.module.plan(plan).placements:
            if max(placement.gpus) >= self.world_size:
                raise SemanticError(f"plan {plan} places {placement.model_stage} on GPU {max(placement.gpus)}, "
                                    f"but only {self.world_size} ranks run (rank r drives GPU r)",
                                    loc=placement.loc, hint="launch one process per GPU of the plan")

    def _live_stages(self, target: str, untouched: frozenset) -> tuple[set, dict]:
        """Collective: (the model-stages of the transition that some rank registered, the
        same set on every rank: derived from the plans, not from this rank's part;
        {training model-stage of the workload: its Adam step, the max over the ranks that
        hold one, -1 where none does}). Raises the same NereusError on every rank when a
        holder of a live model-stage did not register it. One small all_gather carries
        every rank's registration count and steps; the ranks' registered sets are gathered
        only when some rank's count changed since the last gather (counts only grow)."""
        table = [r[1:] for r in gather_flagged(None, self._row(), torch.int64, self._control,
                                               (self._plan, target, "live"))]
        counts = tuple(r[0] for r in table)
        steps = self._steps(table)
        if self._gathered is None or self._gathered[0] != counts:
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, sorted(self._state), group=self._control)
            self._gathered = (counts, gathered)
        gathered = self._gathered[1]
        # the same registrations and transition give the same answer: checked once (its
        # program is compiled once, kept in self._programs for the Runtime's life)
        known = (self._plan, target, counts)
        if known in self._live_known:
            return set(self._live_known[known]), steps
        registered = set().union(*map(set, gathered))
        source = self.module.plan(self._plan)
        live = set()
        for placement in source.placements:  # in plan order: every rank raises the same error
            ms = str(placement.model_stage)
            if ms in untouched or ms not in registered:
                continue
            live.add(ms)
            for r in range(placement.dp):
                for gpu in placement.replica_gpus(r):
                    if ms not in gathered[gpu]:
                        raise NereusError(f"rank {gpu} holds {unit_id(ms, r)} but did not register {ms}",
                                          hint="every rank of a model-stage must call register() before transition()")
        self._live_known[known] = frozenset(live)
        return live, steps

    def _local_step(self, model_stage: str) -> int:
        """This rank's Adam step of a training model-stage, -1 when it holds none."""
        local = self._state.get(model_stage, {})
        key = step_name(ModelStage.parse(model_stage).model)
        return int(local[key]) if key in local else -1


@dataclass(frozen=True)
class _Lowered:
    """What a transition derives from its (restricted) program alone, once per cache key."""

    resident_bytes: int  # this rank's resident bytes in the program
    capacity_bytes: Optional[int]  # this GPU's capacity in the program
    offloaded: frozenset  # ("before" | "after", unit id) of the units kept in host memory
