"""Every header field of a whole program, as the code enumerates them
(`verify_fields.header_fields()`), is checked against the plans with its exact type
(issue 41): for each field, a program with the field's value changed and programs with a
value of another JSON type in its place (`true` and 2.0 for an integer, 0 for a flag, 1 for
a string, "x" for a list, [] for an object) are refused by `verify_program(..., against=module)`
with a message that names the field. `"zero": true` and `"dp": 2.0` passed before."""

from __future__ import annotations

import copy
import re

import pytest

from nereus.ir.diagnostics import ProgramError
from nereus.passes.verify import verify_program
from nereus.passes.verify_fields import CODEC_FIELDS, FIELDS, PART_FIELDS, header_fields
from nereus.passes.verify_world import COMPARED, STATED

HEADER = header_fields()


def _concrete(value, parts: list, path: tuple = ()):
    """The first path in `value` that the pattern's parts (keys, "[]" any entry, "{}" any
    key) reach, or None."""
    if not parts:
        return path
    head, rest = parts[0], parts[1:]
    if head in ("[]", "{}"):
        entries = enumerate(value) if head == "[]" and isinstance(value, list) else \
            value.items() if head == "{}" and isinstance(value, dict) else ()
        return next((found for step, entry in entries
                     if (found := _concrete(entry, rest, path + (step,))) is not None), None)
    if isinstance(value, dict) and head in value:
        return _concrete(value[head], rest, path + (head,))
    return None


def _parts(field: str) -> list:
    """`units.before[].gpus[]` -> ["units", "before", "[]", "gpus", "[]"]."""
    return re.findall(r"[a-z_]+|\[\]|\{\}", field)


def _at(value, path):
    for step in path:
        value = value[step]
    return value


def _mutants(value) -> list:
    """(what, new value): one of the same type and another value, then others of another type."""
    if type(value) is bool:
        return [("value", not value), ("type", int(value))]
    if type(value) is int:
        return [("value", value + 1), ("type", True), ("type", float(value))]
    if type(value) is str:
        return [("value", value + "x"), ("type", 1)]
    if type(value) is list:
        return [("value", value[:-1] if len(value) > 1 else value + value), ("type", "x")]
    if type(value) is dict:
        return [("value", dict(list(value.items())[:-1])), ("type", [])]
    raise TypeError(value)


def _named(name: str, message: str) -> bool:
    """`name` (or its singular: "boxes" -> "box", "gpus" -> "GPU") is a word of `message`."""
    stems = {name, name[:-1] if name.endswith("s") else name, name[:-2] if name.endswith("es") else name}
    return any(re.search(rf"(?<![A-Za-z_]){re.escape(stem)}(?![A-Za-z_])", message, re.IGNORECASE) for stem in stems)


def test_the_enumeration_is_the_schema_and_every_top_level_field_is_compared():
    top = {path for path in HEADER if re.fullmatch(r"[a-z_]+", path)}
    assert top == set(FIELDS["top"]) - {"rounds", *PART_FIELDS, *CODEC_FIELDS}
    assert top == {"format", "version", *COMPARED, *STATED}  # format and version: program_from_json
    assert {"units.before[].zero", "units.after[].dp", "units.before[].ep", "units.after[].shards[].boxes[]",
            "gpus[].capacity_bytes", "resident_bytes{}", "tensors[].shape[]", "untouched[]", "units.after[].mesh",
            "tensors[].indices", "units.before[].shards[].at", "memory_model"} <= set(HEADER)


def test_the_program_holds_every_header_field(every_field_program, every_field_module):
    verify_program(every_field_program, against=every_field_module)
    missing = [path for path in HEADER if _concrete(every_field_program, _parts(path)) is None]
    assert missing == []


@pytest.mark.parametrize("field", HEADER)
def test_a_header_field_changed_in_value_or_type_is_refused_and_named(every_field_program, every_field_module, field):
    parts = _parts(field)
    path = _concrete(every_field_program, parts)
    words = [p for p in parts if p not in ("[]", "{}")]
    changed = copy.deepcopy(every_field_program)
    parent, key = _at(changed, path[:-1]), path[-1]
    for what, new in _mutants(_at(every_field_program, path)):
        parent[key] = new
        with pytest.raises(ProgramError) as caught:
            verify_program(changed, against=every_field_module)
        message = caught.value.message
        assert _named(words[-1], message) and _named(words[0], message), (field, what, new, message)
        if what == "type":
            assert caught.value.path == path, (field, new, message)  # `nereusc verify` shows its line:col
