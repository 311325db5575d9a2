"""How commands report user errors: `file:line:col: error: ...`, a caret, a hint; exit 2.

With `--json` the same error is one JSON object on stdout instead, so that a script reading
stdout always gets JSON:

    {"error": {"file": "bad.nir", "line": 11, "col": 44, "type": "SemanticError",
               "message": "microbatch 3 must divide batch (256)", "hint": "..."}}

`--traceback` (or NEREUS_TRACEBACK=1) prints the Python traceback in addition, for bug
reports; the exit code stays 2 because the error is still the user's.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback as traceback_module

import click

from nereus.ir.diagnostics import NereusError


def error_json(error: Exception) -> dict:
    """The fields of a user error: where (file, line, col; None when unknown), what, and the hint."""
    if isinstance(error, NereusError):
        loc = error.loc
        return {"file": loc.file if loc else None, "line": loc.line if loc else None,
                "col": loc.column if loc else None, "type": type(error).__name__,
                "message": error.message, "hint": error.hint}
    filename = getattr(error, "filename", None)
    return {"file": None if filename is None else str(filename), "line": None, "col": None,
            "type": type(error).__name__, "message": getattr(error, "strerror", None) or str(error), "hint": None}


def _error_text(error: Exception) -> str:
    if isinstance(error, NereusError):
        return error.format()
    return f"error: {error.strerror or error}: {error.filename or ''}".rstrip(": ")


def report_error(error: Exception, as_json: bool) -> None:
    """Print `error` the way every command does (see the module docstring); exit 2."""
    from nereus.cli import traceback_requested

    if traceback_requested():
        chained = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        if chained is not None:  # what it was raised from (e.g. a transition's abort): whole
            traceback_module.print_exception(type(chained), chained, chained.__traceback__, file=sys.stderr)
            print("\nThe error below was raised from the one above:\n", file=sys.stderr)
        # the frames and the type only: the message follows once (for `nereus train` it
        # holds the failing rank's own traceback, which print_exception would repeat)
        print("Traceback (most recent call last):", file=sys.stderr)
        traceback_module.print_tb(error.__traceback__, file=sys.stderr)
        print(f"{type(error).__name__} (the error below)", file=sys.stderr)
    if as_json:
        click.echo(json.dumps({"error": error_json(error)}))
    else:
        click.echo(_error_text(error), err=True)
    sys.exit(2)


def reports_errors(function):
    """Decorate a click callback so that a NereusError or an OSError (a file that cannot be
    read or written) is reported by `report_error`: text on stderr, or JSON on stdout when
    the command was given `--json`; exit 2."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except BrokenPipeError:  # the reader stopped early (`nereusc ... | head`): no error to report
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's documented recipe
            sys.exit(1)
        except (NereusError, OSError) as error:
            report_error(error, bool(kwargs.get("as_json")))

    return wrapper


traceback_option = click.option("--traceback", is_flag=True, hidden=False,
                                help="Also print a Python traceback on errors (for bug reports); still exits 2.")
