"""How commands report user errors: `file:line:col: error: ...`, a caret, a hint; exit 2."""

from __future__ import annotations

import functools
import sys

import click

from nereus.ir.diagnostics import NereusError


def reports_errors(function):
    """Decorate a click callback so that a NereusError prints its formatted text to stderr
    and exits with code 2; `--traceback` (or NEREUS_TRACEBACK=1) re-raises instead."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        from nereus.cli import traceback_requested

        try:
            return function(*args, **kwargs)
        except NereusError as error:
            if traceback_requested():
                raise
            click.echo(error.format(), err=True)
            sys.exit(2)
        except OSError as error:
            if traceback_requested():
                raise
            click.echo(f"error: {error.strerror or error}: {error.filename or ''}".rstrip(": "), err=True)
            sys.exit(2)

    return wrapper


traceback_option = click.option("--traceback", is_flag=True, hidden=False,
                                help="Show a Python traceback on errors (for bug reports).")
