"""`nereusc verify` reads a program's JSON strictly (issue 41): a key written twice in one
object, NaN / Infinity (not JSON), a float where an integer is required and a boolean
where a number is required are errors located in the file (`file:line:col`), never values
silently taken. Python's json keeps the last of two equal keys and reads `true` as 1 and
2.0 as 2: a program whose first `tp` was wrong, or whose `dp` was 2.0 and `zero` true,
was "ok", even against its plans."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
from click.testing import CliRunner

from nereus.cli import nereusc
from nereus.ir.diagnostics import ProgramError
from nereus.passes.verify import verify_program

NIR = pathlib.Path(__file__).parents[1] / "data" / "every-header-field.nir"


def _compact(program) -> str:
    return json.dumps(program, separators=(",", ":"))


def _verify(tmp_path, text: str, *args):
    path = tmp_path / "p.json"
    path.write_text(text)
    return path, CliRunner().invoke(nereusc, ["verify", str(path), *args])


def _line_col(text: str, index: int) -> tuple[int, int]:
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


def _zero_unit(program) -> int:
    return next(i for i, u in enumerate(program["units"]["after"]) if u.get("zero"))


def test_the_program_verifies_against_its_plans(tmp_path, every_field_program):
    path, result = _verify(tmp_path, _compact(every_field_program), "--against", str(NIR))
    assert result.exit_code == 0, result.output


# a key written twice, the first value wrong (the last is the program's own): Python kept
# the last and the program verified
DUPLICATES = {
    "format": ('"format":"nereus-program",', '"format":"other","format":"nereus-program",', "format", "the top level"),
    "unit tp": ('"tp":1,', '"tp":2,"tp":1,', "tp", "units.before[0]"),
    "gpu mem_bytes": ('"mem_bytes":1000000000,', '"mem_bytes":5,"mem_bytes":1000000000,', "mem_bytes", "gpus[0]"),
}


@pytest.mark.parametrize("case", DUPLICATES, ids=str)
def test_a_key_written_twice_is_an_error_at_its_second_occurrence(tmp_path, every_field_program, case):
    old, new, key, where = DUPLICATES[case]
    text = _compact(every_field_program).replace(old, new, 1)
    second = text.index(new) + new.index(f'"{key}"', 1)
    line, col = _line_col(text, second)
    path, result = _verify(tmp_path, text, "--against", str(NIR))
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"{path}:{line}:{col}: error: duplicate key '{key}' in {where}"), result.output
    assert "Traceback" not in result.output


def test_a_duplicate_in_an_indented_file_names_its_line_and_the_first(tmp_path, every_field_program):
    text = json.dumps(every_field_program, indent=1)
    old = '"zero": 1,'
    at = text.index(old)
    text = text[:at] + '"zero": 3,\n' + " " * (at - text.rfind("\n", 0, at) - 1) + text[at:]
    first = _line_col(text, at)
    line, col = _line_col(text, text.index(old, at))
    path, result = _verify(tmp_path, text)
    assert result.exit_code == 2, result.output
    unit = next(i for i, u in enumerate(every_field_program["units"]["before"]) if u.get("zero"))
    assert result.output.startswith(f"{path}:{line}:{col}: error: duplicate key 'zero' in units.before[{unit}] "
                                    f"(first at line {first[0]}, column {first[1]})"), result.output


def test_a_duplicate_key_is_a_located_json_error_object(tmp_path, every_field_program):
    text = _compact(every_field_program).replace('"untouched":[', '"untouched":[],"untouched":[', 1)
    path, result = _verify(tmp_path, text, "--json")
    assert result.exit_code == 2
    error = json.loads(result.output)["error"]
    assert (error["file"], error["line"], error["type"]) == (str(path), 1, "ProgramError")
    assert error["col"] == text.index('"untouched":[', text.index('"untouched":[') + 1) + 1
    assert error["message"].startswith("duplicate key 'untouched' in the top level") and error["hint"]


def test_equal_keys_in_different_objects_and_quotes_in_strings_are_fine(tmp_path, every_field_program):
    """Only a key twice in one object is refused; a `":` inside a string (which the fast
    check counts as a key) is no duplicate."""
    odd = copy.deepcopy(every_field_program)
    odd["note\":"] = "a\": b\" :"  # an unknown field: a warning, not an error
    path, result = _verify(tmp_path, json.dumps(odd))
    assert result.exit_code == 0, result.output
    assert "unknown field 'note\":'" in result.output


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json_and_are_located(tmp_path, every_field_program, literal):
    text = _compact(every_field_program)
    at = text.index('"bytes":', text.index('"rounds"')) + len('"bytes":')
    end = at + len(text[at:].split(",")[0].split("}")[0])
    text = text[:at] + literal + text[end:]
    line, col = _line_col(text, at)
    path, result = _verify(tmp_path, text)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"{path}:{line}:{col}: error: {literal} is not a JSON number"), result.output


# a value of the wrong JSON type where the program needs an integer or a flag: the field's
# own position
WRONG_TYPES = {
    "dp as a float": ('"zero":1,"dp":4', '"zero":1,"dp":4.0', "dp", "4.0"),
    "zero as true": ('"zero":1,"dp":4', '"zero":true,"dp":4', "zero", "true"),
    "replica as true": ('"replica":1,', '"replica":true,', "replica", "true"),
    "mem_bytes with an exponent": ('"mem_bytes":1000000000,', '"mem_bytes":1e9,', "mem_bytes", "1000000000.0"),
    "offload as 0": ('"offload":false', '"offload":0', "offload", "0"),
    "bytes as a float": ('"bytes":', None, "bytes", None),
}


@pytest.mark.parametrize("case", WRONG_TYPES, ids=str)
def test_a_value_of_the_wrong_type_is_an_error_at_its_position(tmp_path, every_field_program, case):
    old, new, key, shown = WRONG_TYPES[case]
    text = _compact(every_field_program)
    if new is None:  # the first op with bytes, written as a float
        at = text.index(old, text.index('"rounds"')) + len(old)
        number = text[at:].split(",")[0].split("}")[0]
        old, new, shown = f'"bytes":{number}', f'"bytes":{number}.0', f"{number}.0"
        at -= len('"bytes":')
    else:
        at = text.index(old)
    text = text[:at] + new + text[at + len(old):]
    line, col = _line_col(text, at + new.index(f'"{key}"') + len(key) + 3)
    path, result = _verify(tmp_path, text, "--against", str(NIR))
    assert result.exit_code == 2, result.output
    head, _, rest = result.output.partition(" error: ")
    assert head == f"{path}:{line}:{col}:", result.output
    assert f"'{key}' must be" in rest and f"not {shown}" in rest, result.output


def test_a_boolean_box_bound_is_located(tmp_path, every_field_program):
    text = _compact(every_field_program)
    at = text.index('"box":[[0,', text.index('"rounds"')) + len('"box":[[')
    text = text[:at] + "false" + text[at + 1:]
    line, col = _line_col(text, at)
    path, result = _verify(tmp_path, text)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"{path}:{line}:{col}: error: round "), result.output


@pytest.mark.parametrize("key, value", [("dp", 4.0), ("zero", True)])
def test_verify_program_against_the_plans_refuses_a_number_of_another_type(every_field_module, every_field_program,
                                                                           key, value):
    """`"dp": 2.0` and `"zero": true` equal 2 and 1 in Python: they passed `against`."""
    changed = copy.deepcopy(every_field_program)
    changed["units"]["after"][_zero_unit(every_field_program)][key] = value
    with pytest.raises(ProgramError, match=rf"header field 'units.after' \(unit critic.training/\d\): '{key}' must be"):
        verify_program(changed, against=every_field_module)
    with pytest.raises(ProgramError) as caught:
        verify_program(changed)
    assert caught.value.path == ("units", "after", _zero_unit(every_field_program), key)


def test_a_type_error_from_stdin_is_located_too(every_field_program):
    text = _compact(every_field_program).replace('"zero":1,"dp":4', '"zero":1,"dp":4.0', 1)
    result = CliRunner().invoke(nereusc, ["verify", "-"], input=text)
    assert result.exit_code == 2
    line, col = _line_col(text, text.index('"dp":4.0') + len('"dp":'))
    assert result.output.startswith(f"<stdin>:{line}:{col}: error: "), result.output


def test_the_reader_finds_a_duplicate_past_strings_that_hold_quotes_and_colons():
    """Unit test of the reader: the counts differ for the string too; the scan passes it and
    finds the duplicate after it, in a file that puts spaces before its colons."""
    from nereus.ir import strict_json

    text = '{"a" : {"b\\":" : "c\\" :d"},\n "e" : [1, {"f" : 2, "g" : 3, "f" : 4}]}'
    with pytest.raises(ProgramError) as caught:
        strict_json.loads(text, "t.json")
    at = text.rindex('"f"')
    assert (caught.value.loc.line, caught.value.loc.column) == _line_col(text, at) == (2, 31)
    assert caught.value.message == "duplicate key 'f' in e[1] (first at line 2, column 13)"
    assert strict_json.loads(text.replace('"f" : 4', '"h" : 4'), "t.json")["e"][1]["h"] == 4
    assert strict_json.locate(text, ("e", 1, "g")) == text.index("3")
    assert strict_json.locate(text, ("e", 5)) is None
