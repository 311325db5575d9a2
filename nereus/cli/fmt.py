"""`nereusc fmt FILE [--set K=V ...] [-o OUT] [--check]`: print a .nir file in canonical form.

Without -o the canonical text goes to stdout. Comments are kept, next to the declaration,
key or placement they annotate (nereus.ir.comments). `--check` writes nothing: it exits 0 when
the file is already canonical and 1 (with a unified diff on stdout) when it is not.
FILE `-` reads standard input.
"""

from __future__ import annotations

import difflib
import sys

import click

from nereus.cli.errors import reports_errors, traceback_option


@click.command("fmt")
@click.argument("file", type=click.Path(allow_dash=True))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a workload or cluster value, e.g. workload.response=8192 (repeatable).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True, allow_dash=True),
              help="Write the canonical text here instead of stdout.")
@click.option("--check", is_flag=True, help="Exit 1 and show a diff if FILE is not in canonical form.")
@traceback_option
@reports_errors
def fmt_command(file: str, overrides: tuple[str, ...], output: str | None, check: bool, traceback: bool) -> None:
    """Print FILE (a .nir plan) in canonical form."""
    from nereus.ir import format_source
    from nereus.ir.diagnostics import ParseError

    if file == "-":
        text, name = sys.stdin.read(), "<stdin>"
    else:
        with open(file, "rb") as handle:
            data = handle.read()
        try:
            text = data.decode("utf-8-sig")  # a leading byte-order mark is not part of the text
        except UnicodeDecodeError:
            from nereus.ir import parse_file

            parse_file(file)  # raises the located "not UTF-8" ParseError
            raise ParseError(f"{file} is not UTF-8 text") from None
        name = file
    canonical = format_source(text, name, overrides)
    if check:
        if text == canonical:
            return
        diff = difflib.unified_diff(text.splitlines(keepends=True), canonical.splitlines(keepends=True),
                                    f"{name}", f"{name} (canonical)")
        click.echo("".join(diff), nl=False)
        click.echo(f"{name} is not in canonical form; `nereusc fmt {name} -o {name}` rewrites it", err=True)
        sys.exit(1)
    if output is None or output == "-":
        click.echo(canonical, nl=False)
    else:
        with open(output, "w", encoding="utf-8") as handle:
            handle.write(canonical)
