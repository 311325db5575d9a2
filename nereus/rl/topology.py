"""Where this rank sits in each model-stage of a plan, and the process groups it needs.

Global rank r is GPU r of the plan (one process per GPU, as torchrun starts them). A
placement's mesh order is replica-major, then pipeline stage, then TP innermost
(docs/ir.md): gpu(r, p, t) = gpus[r·pp·tp + p·tp + t]. The TP group of (r, p) is
{gpu(r, p, t) for all t}; the DP group of (p, t) is {gpu(r, p, t) for all r}; pipeline
neighbours are gpu(r, p±1, t).

torch.distributed.new_group is collective over the whole world and must be called in the
same order everywhere: `Groups.for_plan` walks every placement in plan order on every
rank and caches groups by their rank tuple, so a later plan reuses earlier groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from nereus.models import pp_layer_range
from nereus.ir.model import Module, Placement, Plan

from nereus.models.parallel import TpGroup
from .checks import check_placement
from .pipeline import PipeStage


@dataclass(frozen=True)
class Role:
    """This rank's place in one model-stage: replica `replica` of `dp`, TP rank `tp.rank`,
    pipeline stage `pipe.index`."""

    replica: int
    dp: int
    tp: TpGroup
    dp_group: Optional[Any]  # None when dp == 1
    pipe: PipeStage
    zero: int = 0  # the placement's `zero`: 1 → a dp chunk of the optimizer state, 3 → of the weights too
    dp_ranks: tuple[int, ...] = ()  # global rank of each replica of this rank's (stage, TP rank)

    @property
    def contributes(self) -> bool:
        """Whether this rank writes its replica's outputs (last stage, TP rank 0)."""
        return self.pipe.is_last and self.tp.rank == 0

    def rows(self, batch: int, offset: int = 0) -> slice:
        """This replica's contiguous share of `batch` rows starting at `offset`: dp need not
        divide the batch, so the first batch % dp replicas take one row more (the split
        pp_layer_range makes of layers). Losses are sums over the global token count, so
        uneven shares still sum to the global mean."""
        lo, hi = pp_layer_range(batch, self.dp, self.replica)
        return slice(offset + lo, offset + hi)


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

    def for_plan(self, module: Module, plan: Plan, world: int) -> dict[str, Optional[Role]]:
        """{model-stage name: this rank's Role, or None if the rank holds no unit of it}.

        Collective: every rank must call it with the same plan at the same point."""
        me = dist.get_rank() if dist.is_initialized() else 0
        roles: dict[str, Optional[Role]] = {}
        for placement in plan.placements:
            check_placement(placement, world)
            layers = module.model(placement.model_stage.model).layers
            roles[str(placement.model_stage)] = self._role(placement, layers, me)
        return roles

    def _role(self, p: Placement, layers: int, me: int) -> Optional[Role]:
        tp_groups = {(r, s): tuple(p.gpu_of(r, s, t) for t in range(p.tp)) for r in range(p.dp) for s in range(p.pp)}
        dp_groups = {(s, t): tuple(p.gpu_of(r, s, t) for r in range(p.dp)) for s in range(p.pp) for t in range(p.tp)}
        made = {ranks: self._group(ranks) for ranks in [*tp_groups.values(), *dp_groups.values()]}
        for (r, s), ranks in tp_groups.items():
            if me in ranks:
                t = ranks.index(me)
                pipe = PipeStage(s, p.pp, pp_layer_range(layers, p.pp, s),
                                 prev=p.gpu_of(r, s - 1, t) if s > 0 else None,
                                 next=p.gpu_of(r, s + 1, t) if s < p.pp - 1 else None,
                                 first=p.gpu_of(r, 0, t), last=p.gpu_of(r, p.pp - 1, t))
                return Role(r, p.dp, TpGroup(p.tp, t, made[ranks], ranks), made[dp_groups[(s, t)]], pipe,
                            p.zero, dp_groups[(s, t)])
        return None


def runnable(module: Module, plan: Plan, world: int) -> bool:
    """Whether this loop can compute with `plan` on `world` processes (no groups made)."""
    for placement in plan.placements:
        if max(placement.gpus) >= world:
            return False
    return True
