"""strict_json: the text of a JSON program → the value, refusing what JSON readers read differently.

    loads(text, file) -> value        # ProgramError at file:line:col on a duplicate key, NaN, Infinity
    locate(text, path) -> index       # where the value at `path` (keys and list indices) starts
    line_col(text, index), json_path(path)

Input: the text of a program file (or any JSON text) and its name for locations. Output:
the value `json.loads` gives. Refused, as a `ProgramError` located at the offending token:
a key written twice in one object (Python's json keeps the last value, other readers the
first, or refuse: a program whose first `tp` was wrong verified with the second), and
`NaN`, `Infinity`, `-Infinity` (not JSON; Python reads them as floats). Types are not this
module's business: which fields are integers or flags is the verifier's schema
(nereus.passes.verify_fields), whose errors carry a `path` that `locate` turns into a
position. Invariant: the value returned is the one every conforming JSON reader gets.

Speed (a 256-GPU program is 157 MB): one pass of json's C scanner, with an `object_hook`
that sums the keys each object keeps. Every key in the text ends in `"`, optional
whitespace and `:`, so counting those matches (C speed) bounds the number of keys written
from above; the objects keep the keys written minus the duplicates. Equal counts prove
there is none. Otherwise (a duplicate, or a string that holds `":`) `_first_problem`
re-parses only the values whose two counts differ, descending to the first duplicate;
only a failing or unusual file pays for it.
"""

from __future__ import annotations

import json
import re
from json.decoder import scanstring

from .diagnostics import ProgramError
from .model import Location

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SPACED_KEY_END = re.compile(r'"[ \t\n\r]+:')  # `"key" :`; the common `"key":` is counted by str.count
_CONSTANTS = ("NaN", "Infinity", "-Infinity")
_PLAIN = json.JSONDecoder()


class _NotJson(Exception):
    """A NaN / Infinity literal met by the C scanner (parse_constant)."""


def _refuse(literal: str):
    raise _NotJson(literal)


def _key_bound(text: str, start: int = 0, end: int | None = None) -> int:
    """An upper bound of the keys written in text[start:end]: the matches of `"` ws* `:`."""
    end = len(text) if end is None else end
    return text.count('":', start, end) + len(_SPACED_KEY_END.findall(text, start, end))


def line_col(text: str, index: int) -> tuple[int, int]:
    """1-based line and column (in characters) of text[index]."""
    return text.count("\n", 0, index) + 1, index - (text.rfind("\n", 0, index) + 1) + 1


def json_path(path: tuple) -> str:
    """`units.before[0].tp` for ("units", "before", 0, "tp"); "the top level" for ()."""
    out = ""
    for step in path:
        if isinstance(step, int):
            out += f"[{step}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", step):
            out += f".{step}" if out else step
        else:
            out += f"[{json.dumps(step)}]"
    return out or "the top level"


def loads(text: str, file: str):
    """The JSON value of `text` (module docstring); json.JSONDecodeError, ValueError and
    RecursionError pass through as json.loads raises them."""
    kept = [0]

    def count(obj: dict) -> dict:
        kept[0] += len(obj)
        return obj

    try:
        value = json.loads(text, object_hook=count, parse_constant=_refuse)
    except _NotJson:
        value = None
    else:
        if kept[0] == _key_bound(text):
            return value
    problem = _first_problem(text)
    if problem is None and value is not None:  # only strings holding `":` made the counts differ
        return value
    if problem is None:
        raise ProgramError(f"{file} is not JSON: a NaN or Infinity literal", hint="JSON has no NaN or infinity")
    message, index, hint = problem
    line, column = line_col(text, index)
    raise ProgramError(message, loc=Location(file, line, column), hint=hint)


def _skip(text: str, i: int) -> int:
    return _WHITESPACE.match(text, i).end()


def _first_problem(text: str):
    """(message, index, hint) of the first duplicate key or NaN / Infinity in document
    order, or None. Text before the first NaN is JSON (the C scanner read it)."""
    kept = [0]

    def count(obj: dict) -> dict:
        kept[0] += len(obj)
        return obj

    counting = json.JSONDecoder(object_hook=count, parse_constant=_refuse)

    def clean_end(i: int):
        """End of the value at i when it holds no duplicate and no constant, else None."""
        kept[0] = 0
        try:
            _, end = counting.raw_decode(text, i)
        except _NotJson:
            return None
        return end if kept[0] == _key_bound(text, i, end) else None

    def visit(i: int, path: tuple, known_unclean: bool = False):
        """(problem or None, end of the value at i)."""
        end = None if known_unclean else clean_end(i)
        if end is not None:
            return None, end
        if text[i] == "{":
            seen: dict = {}
            j = _skip(text, i + 1)
            while text[j] != "}":
                key, after = scanstring(text, j + 1)
                if key in seen:
                    first = line_col(text, seen[key])
                    return (f"duplicate key {key[:60]!r} in {json_path(path)} (first at line {first[0]}, "
                            f"column {first[1]})", j,
                            "JSON readers disagree on which of the two values counts (Python's keeps the last, "
                            "others the first): write each key once"), None
                seen[key] = j
                j = _skip(text, _skip(text, after) + 1)  # past the colon
                problem, j = visit(j, path + (key,))
                if problem is not None:
                    return problem, None
                j = _skip(text, j)
                if text[j] == ",":
                    j = _skip(text, j + 1)
            return None, j + 1
        if text[i] == "[":
            j, n = _skip(text, i + 1), 0
            while text[j] != "]":
                problem, j = visit(j, path + (n,))
                if problem is not None:
                    return problem, None
                j, n = _skip(text, j), n + 1
                if text[j] == ",":
                    j = _skip(text, j + 1)
            return None, j + 1
        literal = next((c for c in _CONSTANTS if text.startswith(c, i)), None)
        if literal is not None:
            return (f"{literal} is not a JSON number (at {json_path(path)})", i,
                    "JSON has no NaN or infinity; a program's numbers are integers"), None
        return None, _PLAIN.raw_decode(text, i)[1]  # a string holding `":`

    return visit(_skip(text, 0), (), known_unclean=True)[0]


def locate(text: str, path: tuple):
    """Index in `text` where the value at `path` starts (for a key written twice, the last
    one's: the value json.loads keeps), or None when the path is not in the text."""
    i = _skip(text, 0)
    try:
        for step in path:
            if text[i] == "{" and isinstance(step, str):
                found, j = None, _skip(text, i + 1)
                while text[j] != "}":
                    key, after = scanstring(text, j + 1)
                    j = _skip(text, _skip(text, after) + 1)
                    if key == step:
                        found = j
                    j = _skip(text, _PLAIN.raw_decode(text, j)[1])
                    if text[j] == ",":
                        j = _skip(text, j + 1)
                if found is None:
                    return None
                i = found
            elif text[i] == "[" and isinstance(step, int) and step >= 0:
                j = _skip(text, i + 1)
                for _ in range(step):
                    if text[j] == "]":
                        return None
                    j = _skip(text, _PLAIN.raw_decode(text, j)[1])
                    if text[j] == ",":
                        j = _skip(text, j + 1)
                if text[j] == "]":
                    return None
                i = j
            else:
                return None
    except (IndexError, ValueError):  # text that is not JSON past where it was read
        return None
    return i
