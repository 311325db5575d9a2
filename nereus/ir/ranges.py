"""Tensor families and index ranges: the compact form of JSON program v2 (docs/program.md,
"Version 2: ranges").

A *family* is a tensor name with `{}` placeholders, one per index
(`actor/layers.{}.mlp.experts.{}.gate_up.weight#master`); its members are the names with
the placeholders replaced, left to right, by decimal integers. A *range* is one index's
members as a strided run `(lo, hi, step)` (lo, lo + step, ... < hi; JSON `[lo, hi]` for
step 1, `[lo, hi, step]` otherwise); `at` is one range per placeholder and names the
product of its ranges, expanded row-major (the last index varies fastest).

    members(at) -> iterator of index tuples       count(at) -> int
    member_name(family, index) -> str             parse_at(raw, where) -> tuple of ranges
    member_names(family, at) -> tuple of str (row-major, cached)
    runs(sorted ints) -> [(lo, hi, step), ...]    at_json(at) -> [[lo, hi(, step)], ...]
    contains(outer, inner) -> bool                member_mask(at, extents) -> int (a bitset)

Pure Python; the emitter, the verifier and the runtime share it.
"""

from __future__ import annotations

import functools
import itertools
from typing import Iterable, Iterator

from .diagnostics import ProgramError

Range = tuple[int, int, int]  # (lo, hi, step): lo, lo + step, ... < hi
PLACEHOLDER = "{}"


def placeholders(name: str) -> int:
    """How many indices the family `name` takes (0 for a plain tensor name)."""
    return name.count(PLACEHOLDER)


def member_name(family: str, index: Iterable[int]) -> str:
    """The member of `family` at `index` (one integer per placeholder)."""
    parts = family.split(PLACEHOLDER)
    out = [parts[0]]
    for value, part in zip(index, parts[1:]):
        out.append(str(value))
        out.append(part)
    return "".join(out)


@functools.lru_cache(maxsize=4096)
def member_names(family: str, at: tuple[Range, ...]) -> tuple[str, ...]:
    """Every member of `family` that `at` names, row-major (as `members` orders them):
    one printf template for the family instead of a split per member; cached, since a
    part names the same (family, at) in its shards and in the segments that move them."""
    template = family.replace("%", "%%").replace(PLACEHOLDER, "%d")
    return tuple(template % index for index in members(at))


def range_len(r: Range) -> int:
    lo, hi, step = r
    return max(0, (hi - lo + step - 1) // step)


def range_last(r: Range) -> int:
    return r[0] + (range_len(r) - 1) * r[2]


def count(at: tuple[Range, ...]) -> int:
    n = 1
    for r in at:
        n *= range_len(r)
    return n


def members(at: tuple[Range, ...]) -> Iterator[tuple[int, ...]]:
    """Every index tuple of `at`, row-major (the last range varies fastest)."""
    return itertools.product(*(range(lo, hi, step) for lo, hi, step in at))


def parse_at(raw, where: str, what: str = "'at'") -> tuple[Range, ...]:
    """`at` as JSON states it ([[lo, hi] or [lo, hi, step], ...]) checked and normalised
    (hi becomes the last member + 1); ProgramError at `where` otherwise."""
    if not isinstance(raw, list) or not raw:
        raise ProgramError(f"{where}: {what} must be a non-empty list of [lo, hi] or [lo, hi, step] ranges")
    out = []
    for r in raw:
        if (not isinstance(r, list) or len(r) not in (2, 3) or any(type(v) is not int for v in r)
                or r[0] < 0 or r[1] <= r[0] or (len(r) == 3 and r[2] < 1)):
            raise ProgramError(f"{where}: {what} range {r!r} is not [lo, hi] or [lo, hi, step] with "
                               "0 <= lo < hi and step >= 1 (integers)")
        step = r[2] if len(r) == 3 else 1
        rng = (r[0], r[1], step)
        out.append((r[0], range_last(rng) + 1, step))
    return tuple(out)


def range_json(r: Range) -> list[int]:
    lo, hi, step = r
    return [lo, hi] if step == 1 else [lo, hi, step]


def at_json(at: tuple[Range, ...]) -> list[list[int]]:
    return [range_json(r) for r in at]


def runs(values: Iterable[int]) -> list[Range]:
    """Sorted distinct integers as the fewest maximal runs, greedily from the left: a
    run continues while the step stays the same (contiguous runs preferred: a step
    other than 1 starts only where the next two gaps agree)."""
    vals = list(values)
    out: list[Range] = []
    i, n = 0, len(vals)
    while i < n:
        if i + 1 == n:
            out.append((vals[i], vals[i] + 1, 1))
            break
        step = vals[i + 1] - vals[i]
        j = i + 1
        while j + 1 < n and vals[j + 1] - vals[j] == step:
            j += 1
        if step != 1 and j == i + 1:  # two values at a gap: no run worth a step
            out.append((vals[i], vals[i] + 1, 1))
            i += 1
            continue
        out.append((vals[i], vals[j] + 1, step))
        i = j + 1
    return out


def range_contains(outer: Range, inner: Range) -> bool:
    """Whether every member of `inner` is a member of `outer`."""
    lo, _, step = outer
    first, last = inner[0], range_last(inner)
    if first < lo or last > range_last(outer) or (first - lo) % step:
        return False
    return range_len(inner) == 1 or inner[2] % step == 0


def contains(outer: tuple[Range, ...], inner: tuple[Range, ...]) -> bool:
    return len(outer) == len(inner) and all(range_contains(o, i) for o, i in zip(outer, inner))


def member_mask(at: tuple[Range, ...], extents: tuple[int, ...]) -> int:
    """The members of `at` as a bitset over the row-major index space of `extents`
    (bit i0·e1·e2… + i1·e2… + …): what the verifier intersects to prove writes disjoint."""
    if not at:
        return 1
    # the last dimension as a pattern of bits, then shifted for each outer index tuple
    lo, hi, step = at[-1]
    pattern = 0
    for i in range(lo, hi, step):
        pattern |= 1 << i
    strides = [1] * len(extents)
    for d in range(len(extents) - 2, -1, -1):
        strides[d] = strides[d + 1] * extents[d + 1]
    mask = 0
    for outer in itertools.product(*(range(lo, hi, step) for lo, hi, step in at[:-1])):
        mask |= pattern << sum(i * s for i, s in zip(outer, strides))
    return mask
