"""Errors with a source location and a one-line hint.

Every error a user can cause is a `NereusError` (or a subclass). The CLI prints
`format()` and exits with code 2; no Python traceback unless `--traceback`.

    plan.nir:12:31: error: tp 3 must divide heads (32)
       12 |   actor.training dp 8 tp 3 pp 2 on 0..47
          |                         ^
    hint: use a tp that divides 32, e.g. 2, 4 or 8
"""

from __future__ import annotations

import difflib
from typing import Optional

from .model import Location


def source_lines(text: str) -> list[str]:
    """The lines of source text as the parser counts them: LF, CRLF and a lone CR end a
    line, nothing else. (`str.splitlines` also breaks at FF, VT, FS, GS, RS, NEL, LS and
    PS, which the grammar reads as ordinary characters: in a comment, comment text.) Like
    `splitlines`, a final line end adds no empty line."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def did_you_mean(word: str, options) -> str:
    """`did you mean 'x'? ` for the closest of `options` to `word`, or ""."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'? " if close else ""


class NereusError(Exception):
    """A user-facing error. `loc` may be None for errors with no source position
    (e.g. a program file that fails verification names its round and op instead)."""

    kind = "error"

    def __init__(self, message: str, loc: Optional[Location] = None, hint: Optional[str] = None,
                 source: Optional[str] = None, width: int = 1):
        super().__init__(message)
        self.message = message
        self.loc = loc
        self.hint = hint
        self.source = source  # full text of the file, to quote the offending line
        self.width = max(1, width)

    def with_source(self, source: str) -> "NereusError":
        if self.source is None:
            self.source = source
        return self

    def format(self) -> str:
        head = f"{self.loc}: " if self.loc is not None else ""
        lines = [f"{head}{self.kind}: {self.message}"]
        if self.loc is not None and self.source is not None:
            text = source_lines(self.source)
            if 1 <= self.loc.line <= len(text):
                line = text[self.loc.line - 1].rstrip("\n").expandtabs(1)
                gutter = f"{self.loc.line:>5} | "
                lines.append(gutter + line)
                lines.append(" " * (len(gutter) - 2) + "| " + " " * (self.loc.column - 1) + "^" * self.width)
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


class ParseError(NereusError):
    """Malformed source: the text does not follow the grammar."""


class SemanticError(NereusError):
    """Well-formed source that breaks a rule (unknown name, bad GPU set, tp not dividing heads...)."""


class InfeasibleError(NereusError):
    """A plan or transition that cannot fit in memory."""


class ProgramError(NereusError):
    """A rank program (JSON) that is malformed or fails verification. `path` (keys and list
    indices, e.g. ("units", "after", 3, "dp")), when set, is the value the error is about:
    `nereusc verify` turns it into `file:line:col` (nereus.ir.strict_json.locate)."""

    def __init__(self, message: str, loc: Optional[Location] = None, hint: Optional[str] = None,
                 source: Optional[str] = None, width: int = 1, path: Optional[tuple] = None):
        super().__init__(message, loc, hint, source, width)
        self.path = path


class NereusWarning(NereusError):
    """A located warning: printed like an error (`file:line:col: warning: ...`, the source
    line, a caret, a hint), but never raised: the command reports it on stderr (in
    `--json` output, as `text()` in its "warnings" list) and goes on."""

    kind = "warning"

    def text(self) -> str:
        """One line: `file:line:col: message; hint: ...` (for JSON lists of warnings)."""
        head = f"{self.loc}: " if self.loc is not None else ""
        return f"{head}{self.message}" + (f"; hint: {self.hint}" if self.hint else "")


class SettingError(NereusError):
    """An environment variable (or option) whose value Nereus cannot use."""


def _env_text(name: str, environ=None) -> str:
    """Environment variable `name` stripped ('' when unset): what env_number and env_flag read."""
    import os

    return (os.environ if environ is None else environ).get(name, "").strip()


def env_number(name: str, default, minimum, kind=int, environ=None):
    """The value of environment variable `name` as a `kind` (int or float) of at least
    `minimum`, or `default` when unset or empty. Raises SettingError naming the variable
    for anything else (a word, nan, a value below the minimum)."""
    import math

    text = _env_text(name, environ)
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or (kind is float and not math.isfinite(value)) or value < minimum:
        what = "a whole number" if kind is int else "a finite number"
        raise SettingError(f"{name}={text!r}: must be {what} ≥ {minimum}",
                           hint=f"unset it for the default ({default}); README, \"Environment variables\"")
    return value


_FLAGS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def env_flag(name: str, default: bool, environ=None) -> bool:
    """Environment variable `name` as a switch: 1/true/yes/on or 0/false/no/off (any case),
    `default` when unset or empty. Raises SettingError naming the variable for anything
    else (`NEREUS_PAUSE_GC=maybe` meant on, `NEREUS_COPIES_AFTER=7` off)."""
    text = _env_text(name, environ)
    if not text:
        return default
    value = _FLAGS.get(text.lower())
    if value is None:
        raise SettingError(f"{name}={text!r}: must be 1 or 0 (true/false, yes/no, on/off)",
                           hint=f"unset it for the default ({int(default)}); README, \"Environment variables\"")
    return value
