"""verify_fields: every field of JSON program v1 and v2 with its JSON type → type errors and warnings.

Input: a program dict (docs/program.md). Output: `check_fields` raises a `ProgramError`
on the first known field whose value has another JSON type than FIELDS gives (its `path`
set, so that `nereusc verify` reports `file:line:col`), and returns one warning per
unknown field, naming where it is and the known field it is closest to. Invariant: a
program the emitter writes (whole or one rank's part) passes with no warning; after it,
every known field of the program has its JSON type exactly (an integer is an int, not a
bool and not a float: `true == 1` and `2.0 == 2` in Python, so a later `!=` cannot tell).

Box bounds are the one exception: `check_box` (verify_header) reads every bound of every
box anyway, exactly typed, and its errors carry their path too; checking them here as well
cost a 256-GPU program a second pass over 1.8 million boxes. Version 2's ranges (`at`,
`indices`: RANGED, known only in a version 2 program) are few and checked here.

Why unknown fields are warnings, not errors: v1 grows by optional fields (`nodes`, `zero`
and `dp` came later), so a reader must accept fields it does not know; but a misspelled
optional field (`capacity_byte`) silently falls back to its default and changes what is
proven, which a warning makes visible.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass

from nereus.ir.diagnostics import ProgramError

from .memory_model import KINDS as MEMORY_MODELS


@dataclass(frozen=True)
class Field:
    """A field's JSON type: int (an integer), bool, str, list or dict; `items` is what a
    list holds or a dict maps to — a type, RANGES (lists of integers), or a kind of FIELDS
    (an object of known fields)."""

    json: type
    items: object = None
    choices: tuple = ()  # the values a string may take, named in its type error


RANGES = "ranges"  # a list of integer lists: v2's [lo, hi] or [lo, hi, step] ranges
_OP = {"op": Field(str), "id": Field(int), "index": Field(int), "round": Field(int)}
_UNITS = {"src_unit": Field(str), "dst_unit": Field(str)}  # per op in the compact form, else per segment
_MOVES = {**_OP, **_UNITS, "segments": Field(list, "segment")}
FIELDS: dict[str, dict[str, Field]] = {
    "top": {"format": Field(str), "version": Field(int), "transition": Field(dict, "transition"),
            "gpus": Field(list, "gpus"), "nodes": Field(list, "nodes"), "tensors": Field(list, "tensors"),
            "units": Field(dict, "units"), "resident_bytes": Field(dict, int), "untouched": Field(list, str),
            "memory_model": Field(str, choices=MEMORY_MODELS), "rounds": Field(list, "round"), "rank": Field(int),
            "peers": Field(list, int), "quant": Field(dict), "delta": Field(dict)},  # quant, delta: verify_codec
    "transition": {"from": Field(str), "to": Field(str)},
    "gpus": {"id": Field(int), "node": Field(int), "mem_bytes": Field(int), "capacity_bytes": Field(int)},
    "nodes": {"id": Field(int), "host_mem_bytes": Field(int)},
    "tensors": {"name": Field(str), "shape": Field(list, int), "dtype": Field(str)},
    "units": {"before": Field(list, "unit"), "after": Field(list, "unit")},
    "unit": {"id": Field(str), "model_stage": Field(str), "replica": Field(int), "gpus": Field(list, int),
             "tp": Field(int), "pp": Field(int), "ep": Field(int), "dp": Field(int), "zero": Field(int),
             "offload": Field(bool), "mesh": Field(list, list), "shards": Field(list, "shard")},  # mesh: header
    "shard": {"gpu": Field(int), "tensor": Field(str), "boxes": Field(list, list)},  # bounds: check_box
    "round": {"ops": Field(list, "op")},  # "op": the kind its `op` field names
    "alloc": {**_OP, "gpu": Field(int), "unit": Field(str), "bytes": Field(int)},
    "free": {**_OP, "gpu": Field(int), "unit": Field(str), "bytes": Field(int)},
    "stage_out": {**_OP, "gpu": Field(int), "unit": Field(str), "bytes": Field(int)},
    "keep": {**_MOVES, "gpu": Field(int)},
    "copy": {**_MOVES, "gpu": Field(int), "bytes": Field(int)},
    "send": {**_MOVES, "src": Field(int), "dst": Field(int), "bytes": Field(int), "encoding": Field(str)},
    # weight-sync codec programs (verify_codec.py checks its entries)
    "amax": {**_OP, "src": Field(int), "dst": Field(int), "entries": Field(list), "bytes": Field(int)},
    "segment": {"tensor": Field(str), "box": Field(list), **_UNITS},  # bounds: check_box
}
# version 2 (docs/program.md, "Version 2: ranges"): tensor families and their ranges
RANGED = {"tensors": {"indices": Field(list, RANGES)}, "shard": {"at": Field(list, RANGES)},
          "segment": {"at": Field(list, RANGES)}}
PART_FIELDS = ("rank", "peers")  # one rank's part only (docs/program.md, "Rank programs")
CODEC_FIELDS = ("quant", "delta")  # a weight-sync codec program's (docs/program.md), proven by verify_codec
MAX_WARNINGS = 20


def _fields(kind: str, ranged: bool) -> dict[str, Field]:
    """The fields of `kind` in a program of version 2 (`ranged`) or 1."""
    return {**FIELDS[kind], **RANGED.get(kind, {})} if ranged else FIELDS[kind]


def header_fields(ranged: bool = True) -> tuple[str, ...]:
    """Every field of a whole program's header, as paths: `gpus[].mem_bytes`,
    `units.before[].shards[].boxes`, `resident_bytes{}` (a map's values); with `ranged`,
    version 2's too (`tensors[].indices`). What the header states about the world;
    `nereusc verify --against` compares each with the plans."""
    out: list[str] = []

    def fields(kind: str, prefix: str) -> None:
        for key, field in _fields(kind, ranged).items():
            if kind == "top" and key in ("rounds", *PART_FIELDS, *CODEC_FIELDS):
                continue
            path = f"{prefix}{key}"
            out.append(path)
            if isinstance(field.items, str) and field.items != RANGES:
                fields(field.items, path + ("[]." if field.json is list else "."))
            elif field.json is dict and field.items is not None:
                out.append(path + "{}")
            elif field.json is list and field.items not in (None, RANGES):
                out.append(path + "[]")

    fields("top", "")
    return tuple(out)


# per version (ranged: 2), kind -> field -> (JSON type, items): what the walk reads
_NAMES = {int: "an integer", bool: "true or false", str: "a string", list: "a list", dict: "an object"}


def _wanted(field: Field) -> str:
    return f"one of {', '.join(map(repr, field.choices))}" if field.choices else _NAMES[field.json]


_SPECS = {ranged: {kind: {key: (f.json, f.items, _wanted(f)) for key, f in _fields(kind, ranged).items()}
                   for kind in FIELDS} for ranged in (False, True)}


class _Mistyped(Exception):
    """A value of another JSON type; `path` grows as the exception leaves each container."""

    def __init__(self, path: tuple, value, want: str):
        super().__init__()
        self.path, self.value, self.want = path, value, want


def check_fields(data: dict) -> list[str]:
    """Raise ProgramError on the first mistyped known field of `data` (module docstring);
    return the warnings for unknown fields (at most MAX_WARNINGS, then a count)."""
    unknown: list = []
    try:
        _check(data, "top", unknown, _SPECS[data.get("version") == 2])
    except _Mistyped as mistyped:
        raise _type_error(data, mistyped) from None
    return unknown_fields(data) if unknown else []


def _check(obj: dict, kind: str, unknown: list, specs: dict) -> None:
    spec = specs[kind]
    for key, value in obj.items():
        want = spec.get(key)
        if want is None:
            unknown.append(key)
            continue
        json_type, items, wanted = want
        if type(value) is not json_type:
            raise _Mistyped((key,), value, wanted)
        if items is None:
            continue
        try:
            if type(items) is str:
                if items == RANGES:
                    for i, entry in enumerate(value):
                        if type(entry) is not list:
                            raise _Mistyped((i,), entry, _NAMES[list])
                        for j, bound in enumerate(entry):
                            if type(bound) is not int:
                                raise _Mistyped((i, j), bound, _NAMES[int])
                    continue
                if json_type is dict:
                    _check(value, items, unknown, specs)
                    continue
                for i, entry in enumerate(value):
                    if type(entry) is not dict:
                        raise _Mistyped((i,), entry, _NAMES[dict])
                    entry_kind = items
                    if items == "op":
                        entry_kind = entry.get("op")
                        if "op" in entry and type(entry_kind) is not str:
                            raise _Mistyped((i, "op"), entry_kind, _NAMES[str])
                        if entry_kind not in _OP_KINDS:
                            continue  # the replay names a missing or unknown op
                    try:
                        _check(entry, entry_kind, unknown, specs)
                    except _Mistyped as mistyped:
                        mistyped.path = (i,) + mistyped.path
                        raise
            elif json_type is dict:
                for k, v in value.items():
                    if type(v) is not items:
                        raise _Mistyped((k,), v, _NAMES[items])
            else:
                for i, entry in enumerate(value):
                    if type(entry) is not items:
                        raise _Mistyped((i,), entry, _NAMES[items])
        except _Mistyped as mistyped:
            mistyped.path = (key,) + mistyped.path
            raise


_OP_KINDS = frozenset(("alloc", "free", "stage_out", "keep", "copy", "send", "amax"))


def json_text(value, width: int = 40) -> str:
    """`value` as JSON writes it (true, 2.0, NaN), cut to `width` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= width else f"{text[:width - 12]}... ({len(text)} characters)"


def where_of(data: dict, path: tuple) -> tuple[str, tuple]:
    """The verifier's name for the object at the start of `path` (`header field 'units.after'
    (unit critic.training/2)`, `round 0, op 3 (send), segment 5`) and the rest of the path."""
    def get(obj, step):
        ok = isinstance(obj, dict) and step in obj or isinstance(obj, list) and isinstance(step, int) \
            and 0 <= step < len(obj)
        return obj[step] if ok else None

    head = path[0] if path else None
    if head == "rounds" and len(path) >= 2:
        where, rest = f"round {path[1]}", path[2:]
        if len(rest) >= 2 and rest[0] == "ops":
            op = get(get(get(get(data, "rounds"), path[1]), "ops"), rest[1])
            where += f", op {rest[1]} ({op.get('op') if isinstance(op, dict) else None})"
            rest = rest[2:]
            if len(rest) >= 2 and rest[0] == "segments":
                where, rest = where + f", segment {rest[1]}", rest[2:]
        return where, rest
    if head == "units" and len(path) >= 2:
        where, rest = f"header field 'units.{path[1]}'", path[2:]
        if rest:
            unit = get(get(get(data, "units"), path[1]), rest[0])
            uid = unit.get("id") if isinstance(unit, dict) else None
            where += f" (unit {uid})" if isinstance(uid, str) else f" (entry {rest[0]})"
            rest = rest[1:]
            if len(rest) >= 2 and rest[0] == "shards":
                where, rest = where + f", shard {rest[1]}", rest[2:]
        return where, rest
    if head == "resident_bytes" and len(path) >= 2:
        return f"header field 'resident_bytes' (GPU {path[1]})", path[2:]
    if head in ("gpus", "nodes", "tensors", "untouched", "peers") and len(path) >= 2:
        return f"header field '{head}' (entry {path[1]})", path[2:]
    return (f"header field '{head}'", path[1:]) if head is not None else ("the program", ())


def _type_error(data: dict, mistyped: _Mistyped) -> ProgramError:
    where, rest = where_of(data, mistyped.path)
    last = max((i for i, step in enumerate(rest) if isinstance(step, str)), default=None)
    indices = "".join(f"[{i}]" for i in rest[(last + 1 if last is not None else 0):])
    subject = f"'{rest[last]}'{indices}" if last is not None else f"entry {indices}"
    prefix = f"{where}: {subject}" if rest else where
    return ProgramError(f"{prefix} must be {mistyped.want}, not {json_text(mistyped.value)}",
                        hint="docs/program.md gives each field's type: a program writes its numbers as integers "
                             "(not 2.0, not true) and its flags as true or false",
                        path=mistyped.path)


def unknown_fields(data) -> list[str]:
    """Messages for the fields of `data` outside FIELDS (at most MAX_WARNINGS, then a count)."""
    out: list[str] = []
    ranged = isinstance(data, dict) and data.get("version") == 2

    def check(obj, kind: str, where: str) -> None:
        if not isinstance(obj, dict):
            return
        known = _fields(kind, ranged)
        for key in obj:
            if key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1)
                out.append(f"{where}: unknown field {str(key)[:60]!r}"
                           + (f" (did you mean {close[0]!r}?)" if close else "") + ": ignored")

    def items(value):
        return value if isinstance(value, list) else []

    check(data, "top", "the program")
    if not isinstance(data, dict):
        return out
    check(data.get("transition"), "transition", "header field 'transition'")
    for field in ("gpus", "nodes", "tensors"):
        for i, entry in enumerate(items(data.get(field))):
            check(entry, field, f"header field '{field}' (entry {i})")
    units = data.get("units")
    check(units, "units", "header field 'units'")
    for side in ("before", "after"):
        for i, unit in enumerate(items(units.get(side) if isinstance(units, dict) else None)):
            where = f"header field 'units.{side}' (unit {unit.get('id', i) if isinstance(unit, dict) else i})"
            check(unit, "unit", where)
            for j, shard in enumerate(items(unit.get("shards") if isinstance(unit, dict) else None)):
                check(shard, "shard", f"{where}, shard {j}")
    for k, rnd in enumerate(items(data.get("rounds"))):
        check(rnd, "round", f"round {k}")
        for i, op in enumerate(items(rnd.get("ops") if isinstance(rnd, dict) else None)):
            kind = op.get("op") if isinstance(op, dict) else None
            if kind in _OP_KINDS:
                check(op, kind, f"round {k}, op {i} ({kind})")
                for s in items(op.get("segments")):
                    check(s, "segment", f"round {k}, op {i} ({kind}), a segment")
    if len(out) > MAX_WARNINGS:
        out = out[:MAX_WARNINGS] + [f"... and {len(out) - MAX_WARNINGS} more unknown fields"]
    return out
