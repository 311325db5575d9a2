"""The rank program (JSON program v1, docs/program.md) as read back: the third IR level.

    program_from_json(data) -> JsonProgram      # header and required fields checked

Emitting a program is a backend's job (nereus.backends.json_program); reading one is
shared by the verifier (nereus.passes.verify) and the runtime, so it lives with the IR.
Imports neither torch nor triton."""

from __future__ import annotations

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
                           hint="produce one with `nereusc FILE --transition S1:S2 --emit json -o program.json`")
    if data.get("version") != VERSION:
        raise ProgramError(f"unsupported program version {data.get('version')!r}; this compiler reads version 1")
    for key in REQUIRED_FIELDS:
        if key not in data:
            raise ProgramError(f"program lacks the required field '{key}'")
    return JsonProgram(data)
