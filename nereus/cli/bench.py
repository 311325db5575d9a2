"""`nereus bench NAME [ARGS]...`: run a benchmark of the repository's `benchmarks/` folder
through its harness, benchmarks/run.py (one list of benchmarks, one check of their result)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
from types import ModuleType
from typing import Optional

import click

import nereus
from nereus.cli.errors import reports_errors, traceback_option
from nereus.ir.diagnostics import NereusError


def benchmarks_dir() -> pathlib.Path:
    return pathlib.Path(nereus.__file__).resolve().parent.parent / "benchmarks"


def harness() -> Optional[ModuleType]:
    """benchmarks/run.py of this source tree, loaded by path (it imports only the standard
    library); None where the tree has no benchmarks (an installed wheel)."""
    path = benchmarks_dir() / "run.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("nereus_benchmarks_run", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks the module up while it is made
    spec.loader.exec_module(module)
    return module


def available() -> list[str]:
    found = harness()
    return [bench.name for bench in found.BENCHMARKS] if found else []


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
    """Run benchmark NAME (e.g. plan_scale, multi_gpu/reshard) with ARGS.

    Without NAME, list the benchmarks with the machine each needs. Runs `python
    benchmarks/run.py NAME ARGS`: the benchmark's last stdout line must be one JSON
    object (exit 1 otherwise; a failed benchmark's own exit status). `nereus bench NAME
    --help` shows the benchmark's own options. Benchmarks ship with the source tree: use
    an editable install (pip install -e .).
    """
    if name in ("--help", "-h"):
        click.echo(ctx.get_help())
        return
    found = harness()
    if found is None:
        raise NereusError(f"no benchmarks found in {benchmarks_dir()}",
                          hint="benchmarks ship with the source tree: run from a checkout installed with pip install -e .")
    if name is None:
        click.echo(found.listing())
        return
    names = [bench.name for bench in found.BENCHMARKS]
    if name not in names:
        raise NereusError(f"no benchmark named {name!r}", hint=f"choose one of: {', '.join(names)}")
    from nereus.cli.extras import require, script_needs

    script = benchmarks_dir() / found.find(name).path
    require(script_needs(script.read_text(encoding="utf-8")), f"`nereus bench {name}`")
    sys.exit(subprocess.call([sys.executable, str(benchmarks_dir() / "run.py"), name, *args]))
