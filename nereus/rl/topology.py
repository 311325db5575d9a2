"""Where this rank sits in each model-stage of a plan, and the process groups it needs.

Global rank r is GPU r of the plan (one process per GPU, as torchrun starts them). A
placement's mesh order is replica-major, then pipeline stage, then TP innermost
(docs/ir.md): gpu(r, p, t) = gpus[r·pp·tp + p·tp + t]. The TP group of (r, p) is
{gpu(r, p, t) for all t}; the DP group of (p, t) is {gpu(r, p, t) for all r}; pipeline
neighbours are gpu(r, p±1, t).

With expert parallelism (ep E > 1) a stage of a replica is an E × tp grid, gpu(r, p, e, t)
= gpus[r·pp·E·tp + p·E·tp + e·tp + t], and the E EP ranks run the dense part
data-parallel on different rows (Megatron's expert-data-parallel arrangement): the rows
are split over dp·E shards, shard r·E + e; the EP group of (r, p, t) is {gpu(r, p, e, t)
for all e} (the all-to-all of the MoE layers); dense gradients are summed over the dp·E
ranks {gpu(·, p, ·, t)}, an expert's over the dp ranks holding it {gpu(·, p, e, t)}.

torch.distributed.new_group is collective over the whole world and must be called in the
same order everywhere: `Groups.for_plan` walks every placement in plan order on every
rank and caches groups by their rank tuple, so a later plan reuses earlier groups.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from nereus.ir.diagnostics import env_number
from nereus.models import pp_layer_range
from nereus.ir.model import Module, Placement, Plan

from nereus.models.expert_parallel import EpGroup
from nereus.models.parallel import TpGroup
from .checks import check_placement
from .pipeline import PipeStage


@dataclass(frozen=True)
class Role:
    """This rank's place in one model-stage: replica `replica` of `dp`, TP rank `tp.rank`,
    pipeline stage `pipe.index`, EP rank `ep.rank` of its replica's stage."""

    replica: int
    dp: int
    tp: TpGroup
    dp_group: Optional[Any]  # the ranks dense gradients are summed over; None when dp·ep == 1
    pipe: PipeStage
    zero: int = 0  # the placement's `zero`: 1 → a dp chunk of the optimizer state, 3 → of the weights too
    dp_ranks: tuple[int, ...] = ()  # global rank of each replica of this rank's (stage, TP rank)
    ep: EpGroup = EpGroup()
    expert_dp_group: Optional[Any] = None  # the ranks this rank's experts' gradients are summed over

    @property
    def shards(self) -> int:
        """How many ways a batch is split: dp replicas times ep data-parallel EP ranks."""
        return self.dp * self.ep.size

    @property
    def shard(self) -> int:
        return self.replica * self.ep.size + self.ep.rank

    @property
    def contributes(self) -> bool:
        """Whether this rank writes its replica's outputs (last stage, TP rank 0)."""
        return self.pipe.is_last and self.tp.rank == 0

    def rows(self, batch: int, offset: int = 0) -> slice:
        """This rank's shard's contiguous share of `batch` rows starting at `offset` (its
        replica's rows, split again over the EP ranks): `shards` need not divide the
        batch, so the first batch % shards take one row more (the split pp_layer_range
        makes of layers). Losses are sums over the global token count, so uneven shares
        still sum to the global mean."""
        lo, hi = pp_layer_range(batch, self.shards, self.shard)
        return slice(offset + lo, offset + hi)


# seconds a collective of the RL loop waits for its peers before it fails (torch's default
# is 30 minutes on gloo, 10 on NCCL): a peer that stalls without raising (a deadlock, a hung
# device) then ends the job as a failure does; NEREUS_COLLECTIVE_TIMEOUT_S
COLLECTIVE_TIMEOUT_S = 600.0


def collective_timeout() -> timedelta:
    """The RL loop's collective timeout: NEREUS_COLLECTIVE_TIMEOUT_S, else COLLECTIVE_TIMEOUT_S."""
    return timedelta(seconds=env_number("NEREUS_COLLECTIVE_TIMEOUT_S", COLLECTIVE_TIMEOUT_S, 1.0, float))


class Groups:
    """Process groups by rank tuple, created collectively and cached (each with the loop's
    collective timeout: a group's default would be torch's, not the default group's)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, ...], Any] = {}

    def _group(self, ranks: tuple[int, ...]):
        if len(ranks) == 1:
            return None
        if ranks not in self._cache:
            self._cache[ranks] = dist.new_group(list(ranks), timeout=collective_timeout()) \
                if dist.is_initialized() else None
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
        ep, tp = p.ep, p.tp

        def gpu(r: int, s: int, e: int, t: int) -> int:
            return p.gpu_of(r, s, e * tp + t)

        grid = [(r, s, e, t) for r in range(p.dp) for s in range(p.pp) for e in range(ep) for t in range(tp)]
        tp_groups = {(r, s, e): tuple(gpu(r, s, e, t) for t in range(tp))
                     for r in range(p.dp) for s in range(p.pp) for e in range(ep)}
        dp_groups = {(s, t): tuple(gpu(r, s, e, t) for r in range(p.dp) for e in range(ep))
                     for s in range(p.pp) for t in range(tp)}
        ep_groups = {(r, s, t): tuple(gpu(r, s, e, t) for e in range(ep))
                     for r in range(p.dp) for s in range(p.pp) for t in range(tp)} if ep > 1 else {}
        expert_dp = {(s, e, t): tuple(gpu(r, s, e, t) for r in range(p.dp))
                     for s in range(p.pp) for e in range(ep) for t in range(tp)} if ep > 1 else {}
        # every rank creates the same groups in the same order (new_group is collective)
        made = {ranks: self._group(ranks) for ranks in
                [*tp_groups.values(), *dp_groups.values(), *ep_groups.values(), *expert_dp.values()]}
        for r, s, e, t in grid:
            if gpu(r, s, e, t) != me:
                continue
            pipe = PipeStage(s, p.pp, pp_layer_range(layers, p.pp, s),
                             prev=gpu(r, s - 1, e, t) if s > 0 else None,
                             next=gpu(r, s + 1, e, t) if s < p.pp - 1 else None,
                             first=gpu(r, 0, e, t), last=gpu(r, p.pp - 1, e, t))
            ranks = tp_groups[(r, s, e)]
            role = Role(r, p.dp, TpGroup(tp, t, made[ranks], ranks), made[dp_groups[(s, t)]], pipe,
                        p.zero, dp_groups[(s, t)])  # zero with ep > 1 is refused by the IR
            if ep > 1:
                ep_ranks = ep_groups[(r, s, t)]
                role = replace(role, ep=EpGroup(ep, e, made[ep_ranks], ep_ranks),
                               expert_dp_group=made[expert_dp[(s, e, t)]])
            return role
        return None


def runnable(module: Module, plan: Plan, world: int) -> bool:
    """Whether this loop can compute with `plan` on `world` processes (no groups made)."""
    for placement in plan.placements:
        if max(placement.gpus) >= world:
            return False
    return True
