"""Where this rank sits in each model-stage of a plan, and the process groups it needs.

Global rank r is GPU r of the plan (one process per GPU, as torchrun starts them). A
placement's mesh order is replica-major, then pipeline stage, then TP innermost
(DESIGN.md), so replica r's TP group is gpus[r·tp : (r+1)·tp] (pp = 1) and the DP group of
TP rank t is {gpus[r·tp + t] for every replica r}.

torch.distributed.new_group is collective over the whole world and must be called in the
same order everywhere: `Groups.for_plan` walks every placement in plan order on every
rank and caches groups by their rank tuple, so a later plan reuses earlier groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from nereus.ir.diagnostics import SemanticError
from nereus.ir.model import Placement, Plan

from .parallel import TpGroup


@dataclass(frozen=True)
class Role:
    """This rank's place in one model-stage: replica `replica` of `dp`, TP rank `tp.rank`."""

    replica: int
    dp: int
    tp: TpGroup
    dp_group: Optional[Any]  # None when dp == 1

    def rows(self, batch: int, offset: int = 0) -> slice:
        """This replica's contiguous share of `batch` rows starting at `offset`."""
        per = batch // self.dp
        return slice(offset + self.replica * per, offset + (self.replica + 1) * per)


class Groups:
    """Process groups by rank tuple, created collectively and cached."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, ...], Any] = {}

    def _group(self, ranks: tuple[int, ...]):
        if len(ranks) == 1:
            return None
        if ranks not in self._cache:
            self._cache[ranks] = dist.new_group(list(ranks)) if dist.is_initialized() else None
        return self._cache[ranks]

    def for_plan(self, plan: Plan, world: int) -> dict[str, Optional[Role]]:
        """{model-stage name: this rank's Role, or None if the rank holds no unit of it}.

        Collective: every rank must call it with the same plan at the same point."""
        me = dist.get_rank() if dist.is_initialized() else 0
        roles: dict[str, Optional[Role]] = {}
        for placement in plan.placements:
            check_placement(placement, world)
            roles[str(placement.model_stage)] = self._role(placement, me)
        return roles

    def _role(self, p: Placement, me: int) -> Optional[Role]:
        tp_groups = [tuple(p.gpu_of(r, 0, t) for t in range(p.tp)) for r in range(p.dp)]
        dp_groups = [tuple(p.gpu_of(r, 0, t) for r in range(p.dp)) for t in range(p.tp)]
        made = {ranks: self._group(ranks) for ranks in tp_groups + dp_groups}
        for r, ranks in enumerate(tp_groups):
            if me in ranks:
                t = ranks.index(me)
                return Role(r, p.dp, TpGroup(p.tp, t, made[ranks]), made[dp_groups[t]])
        return None


def check_placement(p: Placement, world: int) -> None:
    """Errors a user can cause with a plan this loop cannot run."""
    if p.pp != 1:
        raise SemanticError(
            f"{p.model_stage}: pp {p.pp} is not supported by the bundled RL loop (pipeline "
            "parallelism is compiled and moved by Nereus, but this loop computes with TP and DP only)",
            p.loc, hint="use pp 1 for `nereus train` plans")
    if max(p.gpus) >= world:
        raise SemanticError(
            f"{p.model_stage} uses GPU {max(p.gpus)} but only {world} processes run",
            p.loc, hint=f"run with --nproc {max(p.gpus) + 1} or more")
