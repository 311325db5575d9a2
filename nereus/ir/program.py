"""The rank program (JSON program v1 and v2, docs/program.md) as read back: the third IR level.

    program_from_json(data) -> JsonProgram      # header and required fields checked
    expand_ranges(data) -> dict                 # a v2 program as the v1 program it stands for

Version 2 adds tensor families and index ranges (nereus.ir.ranges): a tensor, shard or
segment may name a family (`{}` placeholders) with `at` ranges instead of one member;
everything else is v1. `expand_ranges` writes each out member by member, which is what
a v2 program means (tested against the v1 emission of the same compile).

Emitting a program is a backend's job (nereus.backends.json_program); reading one is
shared by the verifier (nereus.passes.verify) and the runtime, so it lives with the IR.
Imports neither torch nor triton."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .diagnostics import ProgramError

FORMAT, VERSION = "nereus-program", 2
VERSIONS = (1, 2)  # what the readers here read: v1 (every member named) and v2 (ranges)
REQUIRED_FIELDS = ("transition", "gpus", "tensors", "units", "resident_bytes", "rounds")


@dataclass(frozen=True)
class JsonProgram:
    """A program read back from JSON; `data` is the v1 or v2 dict."""

    data: dict

    def to_json(self) -> dict:
        return self.data


def program_from_json(data: dict) -> JsonProgram:
    """Check the header and required top-level fields of a v1 or v2 dict; raise ProgramError."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProgramError("not a Nereus program: 'format' must be \"nereus-program\"",
                           hint="produce one with `nereusc FILE --transition S1:S2 --emit json -o program.json`",
                           path=("format",) if isinstance(data, dict) and "format" in data else None)
    version = data.get("version")
    if type(version) is not int or version not in VERSIONS:  # not True, not 1.0: the integer 1 or 2
        raise ProgramError(f"unsupported program version {json.dumps(version)}; this compiler reads versions 1 and 2",
                           hint="`\"version\": 1` or `2`, an integer (a program of a later version needs a later "
                                "nereusc)", path=("version",) if "version" in data else None)
    for key in REQUIRED_FIELDS:
        if key not in data:
            raise ProgramError(f"program lacks the required field '{key}'",
                               hint="docs/program.md, \"Top level\", lists the fields; `nereusc FILE --emit json` "
                                    "writes whole programs")
    transition = data["transition"]
    if not isinstance(transition, dict) or not all(isinstance(transition.get(k), str) for k in ("from", "to")):
        wrong = next((k for k in ("from", "to") if k in transition and not isinstance(transition[k], str)), None) \
            if isinstance(transition, dict) else None
        raise ProgramError("header field 'transition' must be {\"from\": PLAN, \"to\": PLAN}",
                           hint="docs/program.md lists every field and its type",
                           path=("transition",) + ((wrong,) if wrong else ()))
    return JsonProgram(data)


def compact_segment_units(op: dict) -> dict:
    """`op` with its segments' `src_unit` and `dst_unit` stated once at the op level when
    every segment names the same pair (rank programs, docs/program.md: a fused op repeats
    them per layer and tensor otherwise). A new dict; `op` is not modified."""
    segments = op.get("segments")
    if not segments or "src_unit" in op:
        return op
    src, dst = segments[0].get("src_unit"), segments[0].get("dst_unit")
    if src is None or any(s.get("src_unit") != src or s.get("dst_unit") != dst for s in segments):
        return op
    return dict(op, src_unit=src, dst_unit=dst,
                segments=[{k: v for k, v in s.items() if k not in ("src_unit", "dst_unit")} for s in segments])


def expand_segment_units(data: dict) -> dict:
    """The program with every segment naming its `src_unit` and `dst_unit` (the inverse of
    `compact_segment_units` for each op; whole programs come expanded already and are
    returned as they are). Readers that look at segments call this first."""
    if not any("src_unit" in op for rnd in data.get("rounds", ()) for op in rnd.get("ops", ())):
        return data
    rounds = []
    for rnd in data["rounds"]:
        ops = []
        for op in rnd["ops"]:
            if "src_unit" in op and "segments" in op:
                units = {"src_unit": op["src_unit"], "dst_unit": op["dst_unit"]}
                op = {k: v for k, v in op.items() if k not in units}
                op["segments"] = [dict(units, **s) for s in op["segments"]]
            ops.append(op)
        rounds.append(dict(rnd, ops=ops))
    return dict(data, rounds=rounds)


def is_ranged(data: dict) -> bool:
    """Whether `data` is a version-2 program (families and ranges may occur)."""
    return isinstance(data, dict) and data.get("version") == 2


def expand_ranges(data: dict) -> dict:
    """The v1 program a v2 program stands for: every family member named, every ranged
    shard and segment written out member by member, row-major (docs/program.md, "Version
    2"); a v1 program is returned as it is. Raises ProgramError on a malformed range.
    For readers that only know v1; the verifier and the runtime read ranges as they are."""
    from .ranges import member_name, members, parse_at

    if not is_ranged(data):
        return data

    def expand_entry(entry: dict, where: str, key: str) -> list:
        if "at" not in entry:
            return [entry]
        at = parse_at(entry["at"], where)
        base = {k: v for k, v in entry.items() if k != "at"}
        return [dict(base, **{key: member_name(entry[key], idx)}) for idx in members(at)]

    tensors = []
    for t in data.get("tensors", ()):
        if "indices" not in t:
            tensors.append(t)
            continue
        base = {k: v for k, v in t.items() if k != "indices"}
        for idx in members(parse_at(t["indices"], f"header field 'tensors' ({t.get('name')})", "'indices'")):
            tensors.append(dict(base, name=member_name(t["name"], idx)))
    units = {}
    for side, listed in data.get("units", {}).items():
        units[side] = [dict(u, shards=[s for shard in u.get("shards", ())
                                       for s in expand_entry(shard, f"header field 'units.{side}' ({u.get('id')})",
                                                             "tensor")])
                       for u in listed]
    rounds = []
    for k, rnd in enumerate(data.get("rounds", ())):
        ops = []
        for i, op in enumerate(rnd.get("ops", ())):
            if "segments" in op:
                op = dict(op, segments=[s for seg in op["segments"]
                                        for s in expand_entry(seg, f"round {k}, op {i}", "tensor")])
            ops.append(op)
        rounds.append(dict(rnd, ops=ops))
    return dict(data, version=1, tensors=tensors, units=units, rounds=rounds)
