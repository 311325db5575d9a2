"""The rank program (JSON program v1, docs/program.md) as read back: the third IR level.

    program_from_json(data) -> JsonProgram      # header and required fields checked

Emitting a program is a backend's job (nereus.backends.json_program); reading one is
shared by the verifier (nereus.passes.verify) and the runtime, so it lives with the IR.
Imports neither torch nor triton."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .diagnostics import ProgramError

FORMAT, VERSION = "nereus-program", 1
REQUIRED_FIELDS = ("transition", "gpus", "tensors", "units", "resident_bytes", "rounds")


@dataclass(frozen=True)
class JsonProgram:
    """A program read back from JSON; `data` is the v1 dict."""

    data: dict

    def to_json(self) -> dict:
        return self.data


def program_from_json(data: dict) -> JsonProgram:
    """Check the header and required top-level fields of a v1 dict; raise ProgramError."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProgramError("not a Nereus program: 'format' must be \"nereus-program\"",
                           hint="produce one with `nereusc FILE --transition S1:S2 --emit json -o program.json`",
                           path=("format",) if isinstance(data, dict) and "format" in data else None)
    version = data.get("version")
    if type(version) is not int or version != VERSION:  # not True, not 1.0: the integer 1
        raise ProgramError(f"unsupported program version {json.dumps(version)}; this compiler reads version 1",
                           hint="`\"version\": 1`, an integer (a program of a later version needs a later nereusc)",
                           path=("version",) if "version" in data else None)
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
