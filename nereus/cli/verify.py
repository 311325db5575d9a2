"""`nereusc verify PROGRAM.json [--json]`: replay a rank program symbolically and prove it correct.

Exit 0 with a one-line report when every check of `nereus.passes.verify` holds; exit 2 with
`error: round K, op I (kind): ...` and a hint on the first violation.
"""

from __future__ import annotations

import json

import click

from nereus.cli.errors import reports_errors, traceback_option
from nereus.ir.diagnostics import ProgramError


@click.command("verify")
@click.argument("program", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@traceback_option
@reports_errors
def verify_command(program: str, as_json: bool, traceback: bool) -> None:
    """Prove PROGRAM (JSON v1) correct: exact writes, no read after free, memory within capacity."""
    from nereus.passes.verify import verify_program

    try:
        if program == "-":
            data = json.load(click.get_text_stream("stdin"))
        else:
            with open(program, encoding="utf-8") as handle:
                data = json.load(handle)
    except json.JSONDecodeError as error:
        raise ProgramError(f"{program} is not JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    report = verify_program(data)
    if as_json:
        click.echo(json.dumps({"ok": True, "rounds": report.rounds, "ops": report.ops, "segments": report.segments,
                               "bytes_moved": report.bytes_moved, "worst_gpu": report.worst_gpu,
                               "worst_fraction": report.worst_fraction}))
    else:
        click.echo(f"{program}: {report}")
