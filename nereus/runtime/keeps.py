"""Which keeps hand an after-shard over in place, range by range (pure Python, no torch).

A keep op (docs/program.md) gives an after-unit a before-unit's shard on the same GPU.
Where every element of an after-shard comes from keeps of one source shard with the very
same boxes, the runtime reuses the source tensor (`Alias`) instead of copying it; the
other keeps are copies. Input: the program (v1 or v2), this GPU, both sides' shard
entries (pieces.shard_entries). Output: `aliasable`'s verdict per (after-unit, tensor or
family), and per keep op the aliases and the segments left to copy (`keep_aliases`).
Invariant: a family whose keeps all name one `at` from one unit, held in one entry with
the same boxes on both sides, is decided once for all its members (`ALL`); any other is
decided member by member, as a v1 program names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nereus.ir.ranges import member_name, member_names, members, parse_at

from .boxes import as_box, box_numel
from .pieces import ELEMENT_BYTES, holding, member_runs, segment_units


@dataclass(frozen=True)
class Alias:
    """After-shards that reuse before-shards' tensors in place (keep): each of `tensors`
    (one, or the members of a v2 range)."""

    tensors: tuple
    src_unit: str
    dst_unit: str

    @property
    def tensor(self) -> str:
        """The tensor of a one-tensor alias (see pieces.single_tensor_pieces)."""
        if len(self.tensors) != 1:
            raise ValueError(f"an alias of {len(self.tensors)} tensors has no single tensor")
        return self.tensors[0]


def _member_indices(name: str, raw_at, where: str) -> list:
    """[(index or None, member name)] of a segment's members, row-major."""
    if raw_at is None:
        return [(None, name)]
    return [(index, member_name(name, index)) for index in members(parse_at(raw_at, where))]


def aliasable(program: dict, gpu: int, before: dict, after: dict) -> dict:
    """{(dst_unit, tensor or family): ALL or a set of member names}: the after-shards on
    `gpu` produced only by keeps from one source shard with the very same boxes (every
    element covered); those reuse the source tensor in place. ALL: every member the
    family's keeps name (they all keep the same `at` from one unit, one entry each side:
    decided once); otherwise member by member."""
    producers: dict = {}
    for r, rnd in enumerate(program["rounds"]):
        for k, op in enumerate(rnd["ops"]):
            kind = op["op"]
            if (kind in ("keep", "copy") and op["gpu"] == gpu) or (kind == "send" and op["dst"] == gpu):
                for seg in op["segments"]:
                    src_unit, dst_unit = segment_units(seg, op)
                    producers.setdefault((dst_unit, seg["tensor"]), []).append(
                        (kind, src_unit, seg.get("at"), as_box(seg["box"]), f"round {r}, op {k} ({kind})"))
    out: dict = {}
    for (dst_unit, name), segs in producers.items():
        if all(s[0] != "keep" for s in segs):  # copied or received only: nothing aliases
            continue
        kind, src_unit, raw_at, _, where = segs[0]
        if all(s[0] == "keep" and s[1] == src_unit and s[2] == raw_at for s in segs):
            at = parse_at(raw_at, where) if raw_at is not None else None
            runs = member_runs(name, at, before.get((src_unit, gpu, name)), after.get((dst_unit, gpu, name)))
            if not isinstance(runs, str) and len(runs) == 1:
                _, src_boxes, dst_boxes = runs[0]
                covered = sum(box_numel(s[3]) for s in segs)
                if src_boxes == dst_boxes and covered == sum(box_numel(b) for b in dst_boxes):
                    out[(dst_unit, name)] = ALL
                continue
        # member by member, as a v1 program names them
        per_member: dict = {}
        for kind, src_unit, raw_at, box, where in segs:
            for index, member in _member_indices(name, raw_at, where):
                per_member.setdefault((index, member), []).append((kind, src_unit, box))
        ok = set()
        for (index, member), found in per_member.items():
            srcs = {s for _, s, _ in found}
            if any(kind != "keep" for kind, _, _ in found) or len(srcs) != 1:
                continue
            src_boxes = _boxes_of(before.get((next(iter(srcs)), gpu, name)), index)
            dst_boxes = _boxes_of(after.get((dst_unit, gpu, name)), index)
            covered = sum(box_numel(box) for _, _, box in found)
            if src_boxes is not None and src_boxes == dst_boxes and covered == sum(box_numel(b) for b in dst_boxes):
                ok.add(member)
        if ok:
            out[(dst_unit, name)] = ok
    return out


ALL = "all"  # aliasable: every member of the family's keeps


def _boxes_of(found: Optional[list], index) -> Optional[tuple]:
    """The boxes of the entry of `found` ([(at or None, boxes)]) holding member `index`
    (None: the plain tensor), or None."""
    if not found:
        return None
    if index is None:
        return next((b for a, b in found if a is None), None)
    return holding(found, index)


def keep_aliases(op: dict, alias_ok: dict, tensors: dict, aliases: list, aliased: dict, where: str) -> tuple:
    """A keep op's segments that alias in place, as Alias entries added to `aliases` (a
    member once: `aliased` holds dst_unit → the members aliased so far), and (the
    segments left to copy, the bytes the aliased ones keep)."""
    rest, kept = [], 0
    for seg in op["segments"]:
        src_unit, dst_unit = segment_units(seg, op)
        name = seg["tensor"]
        ok = alias_ok.get((dst_unit, name))
        if not ok:
            rest.append(seg)
            continue
        raw_at = seg.get("at")
        if ok is ALL:
            names = member_names(name, parse_at(raw_at, where)) if raw_at is not None else (name,)
            left = []
        else:  # member by member: the members that alias; the others are copied
            pairs = _member_indices(name, raw_at, where)
            names = tuple(member for _, member in pairs if member in ok)
            left = [dict(seg, at=[[i, i + 1] for i in index]) if index is not None else seg
                    for index, member in pairs if member not in ok]
        rest += left
        kept += box_numel(as_box(seg["box"])) * len(names) * ELEMENT_BYTES[tensors[name]["dtype"]]
        seen = aliased.setdefault(dst_unit, set())
        if not seen.isdisjoint(names):  # named by an earlier keep (another box of the same shard)
            names = tuple(n for n in names if n not in seen)
        if names:
            seen.update(names)
            aliases.append(Alias(names, src_unit, dst_unit))
    return rest, kept
