"""`nereusc verify PROGRAM.json [--against FILE.nir] [--json]`: prove a rank program correct.

Exit 0 with a one-line report when every check of `nereus.passes.verify` holds; exit 2 with
`error: round K, op I (kind): ...` (or `header field '...'`) and a hint on the first
violation or malformed field. `--against` also re-derives from the plans of FILE.nir
everything the program states about the world (units, layouts, GPU capacities, resident
bytes, offload flags, nodes and host memory) and rejects any difference.
"""

from __future__ import annotations

import json

import click

from nereus.cli.errors import reports_errors, traceback_option
from nereus.ir.diagnostics import ProgramError


# a program file that is not (whole, UTF-8) JSON: truncated, another encoding, not a program
_REEMIT = "write it again: `nereusc FILE --transition S1:S2 --emit json -o PROGRAM.json` (UTF-8 JSON)"


@click.command("verify")
@click.argument("program", type=click.Path(allow_dash=True))
@click.option("--against", "against", type=click.Path(dir_okay=False), default=None, metavar="FILE.nir",
              help="Check the program's header (layouts, capacities, resident bytes, offload, host memory)"
                   " against the plans of FILE.nir.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a value of FILE.nir, as `nereusc --set` does (with --against).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@traceback_option
@reports_errors
def verify_command(program: str, against: str | None, overrides: tuple, as_json: bool, traceback: bool) -> None:
    """Prove PROGRAM (JSON v1) correct: exact writes, no read after free, memory within capacity."""
    from nereus.passes.verify import verify_program

    try:
        if program == "-":
            data = json.loads(click.get_text_stream("stdin").read().lstrip("\ufeff"))  # a byte-order mark too
        else:
            with open(program, encoding="utf-8-sig") as handle:  # a byte-order mark some editors write
                data = json.load(handle)
    except json.JSONDecodeError as error:
        raise ProgramError(f"{program} is not JSON: {error.msg} at line {error.lineno} column {error.colno}",
                           hint=_REEMIT) from None
    except UnicodeDecodeError as error:
        raise ProgramError(f"{program} is not UTF-8 text: {error.reason} at byte {error.start}",
                           hint=_REEMIT) from None
    except (ValueError, RecursionError) as error:  # an integer of >4300 digits, nesting deeper than Python's stack
        raise ProgramError(f"{program} is not JSON a program can be: {str(error) or type(error).__name__}",
                           hint=_REEMIT) from None
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
    report = verify_program(data, against=module, progress=StderrProgress("verify", after=3.0))
    if as_json:
        click.echo(json.dumps({"ok": True, "rounds": report.rounds, "ops": report.ops, "segments": report.segments,
                               "bytes_moved": report.bytes_moved, "worst_gpu": report.worst_gpu,
                               "worst_fraction": report.worst_fraction, "against": against,
                               "warnings": list(report.warnings)}))
    else:
        for warning in report.warnings:  # a misspelled optional field falls back to its default
            click.echo(f"{program}: warning: {warning}", err=True)
        click.echo(f"{program}: {report}" + (f" (header matches {against})" if against else ""))
