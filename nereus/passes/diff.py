"""diff: (plan S, plan S*) → per model-stage list of EMU primitives.

Input: a validated `Module` and two of its plans. Output: a `Diff` holding, for every
model-stage, whether it is unchanged and the `Primitive`s (Split / Merge / Extend /
Destroy) that turn S's units into S*'s. Invariant: every after-unit is either kept (same
tp, pp and GPU list as some before-unit) or produced by exactly one Split, Merge or
Extend; every before-unit not kept ends in a Split, Merge or Destroy.

The primitives describe the structure of the move (summary, docs, controller); the bytes
each new unit needs are computed by box intersection of layouts in `dag`, so the data
movement is exact whatever the decomposition. Rules (docs/passes.md has an example each):

  - kept: an after-unit whose (tp, pp, ep, GPU list) equals a before-unit's: no primitive.
  - same unit shape (tp, pp, ep unchanged): leftover after-units are Extended from live
    replicas; leftover before-units are Destroyed (a moved replica = Extend + Destroy).
  - smaller units (tp·pp·ep shrinks by k): each leftover before-unit Splits into k pieces;
    pieces beyond the after-units needed are Destroyed, missing ones Extended.
  - larger units (tp·pp·ep grows by k): groups of k leftover before-units Merge into one
    after-unit; when there are too few, Extend first (paper Figure 5: Extend then Merge
    raises TP at constant DP); extra before-units are Destroyed.
  - shapes not multiples of each other (e.g. tp 4 pp 1 → tp 2 pp 3): Split every leftover
    before-unit to single GPUs, then Merge into the after-units.
  - ZeRO (`zero 1` on either side): the optimizer state is one object split over the dp
    replicas, not a copy per replica. When its partition changes (dp, zero, or a kept unit
    changing replica index), one Repartition over all replicas of both sides says so: the
    DAG then moves each chunk from the replica that holds it, about the optimizer state
    once in total, instead of a full copy into every new replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from nereus.ir.model import Module, Placement

SPLIT, MERGE, EXTEND, DESTROY, REPARTITION = "split", "merge", "extend", "destroy", "repartition"


@dataclass(frozen=True)
class Primitive:
    """One EMU primitive of a model-stage. `before`/`after` are replica indices in S / S*."""

    kind: str
    model_stage: str
    before: tuple[int | str, ...]  # "+i": a temporary replica made by an Extend
    after: tuple[int | str, ...]

    def __str__(self) -> str:
        b = ",".join(map(str, self.before)) or "-"
        a = ",".join(map(str, self.after)) or "-"
        return f"{self.kind}({self.model_stage} [{b}] -> [{a}])"


@dataclass(frozen=True)
class StageDiff:
    model_stage: str
    before: Placement
    after: Placement
    kept: tuple[tuple[int, int], ...]  # (before replica, after replica) kept in place
    primitives: tuple[Primitive, ...]

    @property
    def unchanged(self) -> bool:
        if self.before.layout is not None or self.after.layout is not None:
            return self.before.gpus == self.after.gpus and self.before.layout == self.after.layout \
                and self.before.offload == self.after.offload
        # quant too: the weight sync quantizes into a `quant fp8` generation layout even where
        # the mesh equals the training one (a plan change of quant alone keeps every shard)
        return self.before.gpus == self.after.gpus and (
            self.before.dp, self.before.tp, self.before.pp, self.before.ep, self.before.offload, self.before.zero,
            self.before.quant) == (
            self.after.dp, self.after.tp, self.after.pp, self.after.ep, self.after.offload, self.after.zero,
            self.after.quant)


@dataclass(frozen=True)
class Diff:
    source: str
    target: str
    stages: tuple[StageDiff, ...]

    def changed(self) -> tuple[StageDiff, ...]:
        return tuple(s for s in self.stages if not s.unchanged)


def diff_plans(module: Module, source: str, target: str) -> Diff:
    """Diff every model-stage of `source` against `target` (workload order)."""
    before_plan, after_plan = module.plan(source), module.plan(target)
    stages = []
    for before in before_plan.placements:
        after = after_plan.placement(before.model_stage)
        stages.append(diff_stage(before, after))
    return Diff(source, target, tuple(stages))


def diff_stage(before: Placement, after: Placement) -> StageDiff:
    """The primitives turning `before`'s units into `after`'s (rules in the module docstring)."""
    name = str(before.model_stage)
    if before.layout is not None or after.layout is not None:
        return _mesh_diff(name, before, after)
    same_shape = (before.tp, before.pp, before.ep) == (after.tp, after.pp, after.ep)
    kept: list[tuple[int, int]] = []
    if same_shape:
        by_gpus = {before.replica_gpus(r): r for r in range(before.dp)}
        for a in range(after.dp):
            r = by_gpus.get(after.replica_gpus(a))
            if r is not None:
                kept.append((r, a))
    kept_b = {b for b, _ in kept}
    kept_a = {a for _, a in kept}
    left_b = [r for r in range(before.dp) if r not in kept_b]
    left_a = [r for r in range(after.dp) if r not in kept_a]
    prims: list[Primitive] = []
    size_b, size_a = before.tp * before.pp * before.ep, after.tp * after.pp * after.ep

    def extend(targets):
        if targets:
            sources = tuple(range(before.dp))
            prims.append(Primitive(EXTEND, name, sources, tuple(targets)))

    def destroy(victims):
        if victims:
            prims.append(Primitive(DESTROY, name, tuple(victims), ()))

    if same_shape:
        extend(left_a)
        destroy(left_b)
    elif size_b > size_a and size_b % size_a == 0:
        k = size_b // size_a
        queue = list(left_a)
        for b in left_b:
            take, queue = queue[:k], queue[k:]
            if take:
                prims.append(Primitive(SPLIT, name, (b,), tuple(take)))
            else:
                destroy([b])
        extend(queue)
    elif size_a > size_b and size_a % size_b == 0:
        k = size_a // size_b
        missing = max(0, k * len(left_a) - len(left_b))
        extra = [f"+{i}" for i in range(missing)]  # temporary replicas, merged right away
        if extra:
            prims.append(Primitive(EXTEND, name, tuple(range(before.dp)), tuple(extra)))
        pool = list(left_b) + extra
        for a in left_a:
            take, pool = pool[:k], pool[k:]
            prims.append(Primitive(MERGE, name, tuple(take), (a,)))
        destroy(pool)
    else:
        if left_b:
            prims.append(Primitive(SPLIT, name, tuple(left_b), ()))
        for a in left_a:
            prims.append(Primitive(MERGE, name, (), (a,)))
    if (before.zero or after.zero) and ((before.dp, before.zero) != (after.dp, after.zero)
                                        or any(b != a for b, a in kept) or left_b or left_a):
        prims.append(Primitive(REPARTITION, name, tuple(range(before.dp)), tuple(range(after.dp))))
    return StageDiff(name, before, after, tuple(kept), tuple(prims))


def _mesh_diff(name: str, before: Placement, after: Placement) -> StageDiff:
    """A mesh layout's single unit: kept when nothing changes, else repartitioned."""
    if before.gpus == after.gpus and before.layout == after.layout and before.offload == after.offload:
        return StageDiff(name, before, after, ((0, 0),), ())
    return StageDiff(name, before, after, (), (Primitive(REPARTITION, name, (0,), (0,)),))
