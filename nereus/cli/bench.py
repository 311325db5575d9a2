"""`nereus bench NAME [ARGS]...`: run a script of the repository's `benchmarks/` folder."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import click

import nereus
from nereus.cli.errors import reports_errors, traceback_option
from nereus.ir.diagnostics import NereusError


def benchmarks_dir() -> pathlib.Path:
    return pathlib.Path(nereus.__file__).resolve().parent.parent / "benchmarks"


def available() -> list[str]:
    folder = benchmarks_dir()
    return sorted(p.stem for p in folder.glob("*.py")) if folder.is_dir() else []


# no eager --help here: `nereus bench NAME --help` is the script's help (its options),
# `nereus bench --help` this command's
@click.command("bench", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                          "help_option_names": []})
@click.argument("name", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@traceback_option
@reports_errors
@click.pass_context
def bench_command(ctx, name, args, traceback):
    """Run benchmark NAME (a script in benchmarks/, e.g. plan_scale) with ARGS.

    Without NAME, list the benchmarks. Each prints one JSON object as its last stdout
    line. `nereus bench NAME --help` shows the benchmark's own options. Benchmarks ship
    with the source tree: use an editable install (pip install -e .).
    """
    if name in ("--help", "-h"):
        click.echo(ctx.get_help())
        return
    names = available()
    if not names:
        raise NereusError(f"no benchmarks found in {benchmarks_dir()}",
                          hint="benchmarks ship with the source tree: run from a checkout installed with pip install -e .")
    if name is None:
        click.echo("\n".join(names))
        return
    if name not in names:
        raise NereusError(f"no benchmark named {name!r}", hint=f"choose one of: {', '.join(names)}")
    from nereus.cli.extras import require, script_needs

    script = benchmarks_dir() / f"{name}.py"
    require(script_needs(script.read_text(encoding="utf-8")), f"`nereus bench {name}`")
    sys.exit(subprocess.call([sys.executable, str(script), *args]))
