"""`.nir` source → validated Module: the front end's entry points.

    parse_source(text, file)   syntax (syntax.py) → meaning (build.py) → rules (validate.py)
    parse_file(path)           the same for a file on disk

Every error is a NereusError carrying the source text, so `error.format()` quotes the
offending line with a caret.
"""

from __future__ import annotations

import os

from .build import build_module
from .diagnostics import NereusError, ParseError
from .model import Location, Module
from .syntax import parse_syntax
from .validate import validate_module


def parse_source(text: str, file: str = "<input>") -> Module:
    """Input: the text of a `.nir` file and its name (for locations). Output: the Module.
    Invariant: every rule of docs/ir.md holds for the result; otherwise a ParseError or
    SemanticError at the offending token is raised."""
    try:
        module = build_module(parse_syntax(text, file), file)
        validate_module(module)
    except NereusError as error:
        raise error.with_source(text) from None
    return module


def parse_file(path: str | os.PathLike) -> Module:
    """Read and parse a `.nir` file. Raises OSError when it cannot be read (the CLI reports
    it) and ParseError when it is not UTF-8."""
    file = os.fspath(path)
    with open(file, "rb") as handle:
        data = handle.read()
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark is not part of the text
    except UnicodeDecodeError as error:
        before = data[: error.start]
        line = before.count(b"\n") + 1
        column = len(before[before.rfind(b"\n") + 1 :].decode("utf-8", "replace")) + 1
        shown = before.decode("utf-8", "replace")
        raise ParseError(f"the file is not UTF-8 text: byte 0x{data[error.start]:02x} cannot be decoded",
                         Location(file, line, column), "save the file as UTF-8",
                         source=shown + "\n" if shown.count("\n") < line else shown) from None
    return parse_source(text, file)
