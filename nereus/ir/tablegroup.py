"""Group a tensor table's names for printing: `model.layers.{0..31}.mlp.experts.{0..127}.w`.

Input: a `tensors` model's TensorDecls. Output: (name pattern, shape) pairs whose patterns,
expanded as the parser expands them (nereus.ir.table.expand_name), give every tensor
exactly once. Tensors are grouped where they share a shape and their names differ only
in whole numbers at the same places that run without gaps; numbers written with a
leading zero (`layer.01`) are text, not numbers. Tables are sets (the parser sorts them),
so printing then parsing gives the same table.
"""

from __future__ import annotations

import re
from typing import Iterable

from .model import TensorDecl

_NUMBER = re.compile(r"0|[1-9][0-9]*")
_SPLIT = re.compile(r"([0-9]+)")


def _parts(name: str) -> tuple:
    """Text and numbers of a name, alternating; a number is a (lo, hi) range of one."""
    out = []
    for i, part in enumerate(_SPLIT.split(name)):
        if i % 2 and _NUMBER.fullmatch(part):
            out.append((int(part), int(part)))
        elif out and isinstance(out[-1], str):
            out[-1] += part
        else:
            out.append(part)
    return tuple(out)


def _merge(items: list[tuple[tuple, tuple]], position: int) -> list[tuple[tuple, tuple]]:
    """Merge items (parts, shape) that differ only at `position`, where they hold single
    numbers, into runs of consecutive numbers."""
    buckets: dict[tuple, list] = {}
    rest = []
    for parts, shape in items:
        value = parts[position] if position < len(parts) else None
        if not isinstance(value, tuple) or value[0] != value[1]:
            rest.append((parts, shape))
            continue
        key = (parts[:position], parts[position + 1:], shape)
        buckets.setdefault(key, []).append(value[0])
    out = list(rest)
    for (head, tail, shape), numbers in buckets.items():
        numbers.sort()
        start = prev = numbers[0]
        for n in numbers[1:] + [None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            out.append((head + ((start, prev),) + tail, shape))
            if n is not None:
                start = prev = n
    return out


def _text(parts: tuple) -> str:
    return "".join(p if isinstance(p, str) else (str(p[0]) if p[0] == p[1] else f"{{{p[0]}..{p[1]}}}")
                   for p in parts)


def grouped_names(tensors: Iterable[TensorDecl]) -> list[tuple[str, tuple[int, ...]]]:
    """(pattern, shape) lines for `tensors`, in the order of each group's first tensor."""
    items = [(_parts(t.name), t.shape) for t in tensors]
    width = max((len(parts) for parts, _ in items), default=0)
    for position in reversed(range(width)):  # innermost numbers first (experts within layers)
        items = _merge(items, position)
    from .table import natural_key

    items.sort(key=lambda item: natural_key(_text(tuple((p[0], p[0]) if isinstance(p, tuple) else p
                                                         for p in item[0]))))
    return [(_text(parts), shape) for parts, shape in items]
