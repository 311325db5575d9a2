"""`nereusc verify PROGRAM.json [--against FILE.nir] [--json]`: prove a rank program correct.

Exit 0 with a one-line report when every check of `nereus.passes.verify` holds; exit 2 with
`error: round K, op I (kind): ...` (or `header field '...'`) and a hint on the first
violation or malformed field. The file is read strictly (nereus.ir.strict_json): a key
written twice in one object, NaN or Infinity is an error at `file:line:col`; so is a value
of the wrong JSON type (`"dp": 2.0`, `"zero": true`), whose path the verifier's error
carries. `--against` also re-derives from the plans of FILE.nir every header field (units
and every field of each, layouts, GPU capacities, resident bytes, nodes and host memory)
and rejects any difference in value or type.
"""

from __future__ import annotations

import json
import sys

import click

from nereus.cli.errors import reports_errors, traceback_option
from nereus.ir.diagnostics import ProgramError
from nereus.ir.model import Location


# a program file that is not (whole, UTF-8) JSON: truncated, another encoding, not a program
_REEMIT = "write it again: `nereusc FILE --transition S1:S2 --emit json -o PROGRAM.json` (UTF-8 JSON)"


def _placed(error: ProgramError, program: str, text: str | None) -> ProgramError:
    """`error` with `file:line:col` where it names a value of the program (`error.path`)."""
    from nereus.ir import strict_json

    if error.path is None or error.loc is not None:
        return error
    if text is None:
        try:
            with open(program, encoding="utf-8-sig") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError):
            return error
    index = strict_json.locate(text, error.path)
    if index is not None:
        line, column = strict_json.line_col(text, index)
        error.loc = Location("<stdin>" if program == "-" else program, line, column)
    return error


@click.command("verify")
@click.argument("program", type=click.Path(allow_dash=True))
@click.option("--against", "against", type=click.Path(dir_okay=False), default=None, metavar="FILE.nir",
              help="Check every header field of the program (units and layouts, capacities, resident bytes,"
                   " offload, nodes and host memory), value and JSON type, against the plans of FILE.nir.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a value of FILE.nir, as `nereusc --set` does (with --against).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@traceback_option
@reports_errors
def verify_command(program: str, against: str | None, overrides: tuple, as_json: bool, traceback: bool) -> None:
    """Prove PROGRAM (JSON v1) correct: exact writes, no read after free, memory within capacity."""
    from nereus.ir import strict_json
    from nereus.passes.verify import verify_program

    name = "<stdin>" if program == "-" else program
    try:
        if program == "-":
            # as a file is read: UTF-8 whatever the locale, a byte-order mark dropped
            text = sys.stdin.buffer.read().decode("utf-8-sig")
        else:
            with open(program, encoding="utf-8-sig") as handle:  # a byte-order mark some editors write
                text = handle.read()
        # strictly: a key written twice, NaN or Infinity is an error at its position
        data = strict_json.loads(text, name)
    except json.JSONDecodeError as error:
        raise ProgramError(f"{program} is not JSON: {error.msg} at line {error.lineno} column {error.colno}",
                           hint=_REEMIT) from None
    except UnicodeDecodeError as error:
        raise ProgramError(f"{program} is not UTF-8 text: {error.reason} at byte {error.start}",
                           hint=_REEMIT) from None
    except (ValueError, RecursionError) as error:  # an integer of >4300 digits, nesting deeper than Python's stack
        raise ProgramError(f"{program} is not JSON a program can be: {str(error) or type(error).__name__}",
                           hint=_REEMIT) from None
    if program != "-":
        text = None  # a 256-GPU program's text is 157 MB: read again only to place an error
    module = None
    if against is not None:
        from nereus.cli.check import load_module

        module = load_module(against, overrides)
    elif overrides:
        raise click.UsageError("--set needs --against FILE.nir")
    moves = data.get("transition") if isinstance(data, dict) else None
    if module is not None and isinstance(moves, dict) and moves.get("from") == moves.get("to") is not None:
        # the runtime accepts an empty program of a plan to itself (transition to the plan it
        # is in); a file that claims one is worth a word
        raise ProgramError(f"header field 'transition' ({moves['from']} -> {moves['to']}): a transition from "
                           f"plan {moves['from']} to itself", hint="a program moves state between two different plans")
    from nereus.cli.progress import StderrProgress

    # a large program takes 12-25 s: after 3 s (at once on a terminal) stderr says how far
    try:
        report = verify_program(data, against=module, progress=StderrProgress("verify", after=3.0))
    except ProgramError as error:
        raise _placed(error, program, text) from None
    if as_json:
        click.echo(json.dumps({"ok": True, "rounds": report.rounds, "ops": report.ops, "segments": report.segments,
                               "bytes_moved": report.bytes_moved, "worst_gpu": report.worst_gpu,
                               "worst_fraction": report.worst_fraction, "against": against,
                               "warnings": list(report.warnings)}))
    else:
        for warning in report.warnings:  # a misspelled optional field falls back to its default
            click.echo(f"{program}: warning: {warning}", err=True)
        click.echo(f"{program}: {report}" + (f" (header matches {against})" if against else ""))
