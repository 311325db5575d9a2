"""Command-line entry points: `nereusc` (the compiler) and `nereus` (runtime tools).

Each command lives in its own module under `nereus/cli/` and is registered in
`_NEREUSC_COMMANDS` / `_NEREUS_COMMANDS` by (name, module, attribute); modules are
imported only when their command runs, so `nereusc --help` never imports torch.

`nereusc FILE ...` (no command name) means `nereusc compile FILE ...`.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

_NEREUSC_COMMANDS = {
    "compile": ("nereus.cli.compile", "compile_command", "Parse, check and compile every transition (default)."),
    "check": ("nereus.cli.check", "check_command", "Parse and validate a .nir file and check every plan's memory."),
    "fmt": ("nereus.cli.fmt", "fmt_command", "Print a .nir file in canonical form."),
    "search": ("nereus.cli.search", "search_command", "Print the fastest plans that fit a .nir file's workload."),
    "verify": ("nereus.cli.verify", "verify_command", "Replay a JSON rank program and prove it correct."),
}

_NEREUS_COMMANDS = {
    "simulate": ("nereus.cli.simulate", "simulate_command", "Replay a drift trace under several policies."),
    "train": ("nereus.cli.train", "train_command", "Run the bundled PPO/GRPO loop under torchrun."),
    "bench": ("nereus.cli.bench", "bench_command", "Run a benchmark script."),
    "export": ("nereus.cli.export", "export_command", "Write a training run's model as a Hugging Face checkpoint."),
}


class _LazyGroup(click.Group):
    """A click group whose commands are imported on first use."""

    def __init__(self, *args, lazy: dict, default: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._lazy = lazy
        self._default = default
        self._helping = False  # the command line asks for help: do not require the runtime extras

    def list_commands(self, ctx):
        return sorted(set(self._lazy) | set(super().list_commands(ctx)))

    def get_command(self, ctx, name):
        if name in self._lazy:
            from nereus.cli.errors import report_error
            from nereus.cli.extras import COMMAND_NEEDS, MissingDependency, require
            from nereus.ir.diagnostics import NereusError

            module, attribute, help_text = self._lazy[name]
            helping = ctx.resilient_parsing or self._helping or "--help" in sys.argv
            try:
                if not helping:  # help needs no runtime: the command modules import it lazily
                    require(COMMAND_NEEDS.get(name, ()), f"`{ctx.info_name} {name}`")
                return getattr(importlib.import_module(module), attribute)
            except MissingDependency as error:
                report_error(error, as_json=False)
            except (ImportError, AttributeError) as error:
                if helping:
                    return click.Command(name, help=f"{help_text} (unavailable: {error})", short_help=help_text)
                report_error(NereusError(f"command '{name}' is unavailable: {error}",
                                         hint="install nereus[runtime]: pip install 'nereus[runtime]'"), as_json=False)
        return super().get_command(ctx, name)

    def resolve_command(self, ctx, args):
        self._helping = any(arg in ("--help", "-h") for arg in args)
        if args and args[0] not in self._lazy and not args[0].startswith("-"):
            self._near_command(ctx, args[0])
        # `nereusc plan.nir` → `nereusc compile plan.nir`
        if self._default and args and args[0] not in self._lazy and not args[0].startswith("-"):
            args = [self._default, *args]
        return super().resolve_command(ctx, args)

    def _near_command(self, ctx, word: str) -> None:
        """A usage error with a did-you-mean for a word close to a command name (`nereusc
        chek`); where a bare word means a file (`nereusc FILE`), only for a word that is
        no existing path and has no '.' or '/' (a file name is left to the command)."""
        import difflib

        if self._default and (os.path.exists(word) or "." in word or os.sep in word or "/" in word):
            return
        near = difflib.get_close_matches(word, list(self._lazy), n=1, cutoff=0.6)
        if near:
            ctx.fail(f"No such command '{word}'. Did you mean '{near[0]}'?")

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click's main; with `--json` on the command line, a usage error (an unknown
        option, a value of the wrong kind) is the same JSON error object on stdout as any
        other error (nereus.cli.errors), not click's usage text: a script that asked for
        JSON reads JSON. Exit 2 either way, as click exits."""
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode or "--json" not in argv:
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        try:
            # non-standalone: click returns ctx.exit's code (no command returns a value)
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as done:  # --help, --version
            sys.exit(done.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except click.ClickException as error:
            import json

            where = error.ctx.command_path if getattr(error, "ctx", None) is not None else (prog_name or self.name)
            kind = "UsageError" if isinstance(error, click.UsageError) else type(error).__name__
            click.echo(json.dumps({"error": {"file": None, "line": None, "col": None, "type": kind,
                                             "message": error.format_message(), "hint": f"see `{where} --help`"}}))
            sys.exit(error.exit_code)
        sys.exit(code if isinstance(code, int) else 0)

    def format_commands(self, ctx, formatter):
        rows = [(name, self._lazy[name][2]) for name in sorted(self._lazy)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=_LazyGroup, lazy=_NEREUSC_COMMANDS, default="compile",
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nereus")
def nereusc():
    """The Nereus compiler: plans (.nir) in, transition programs out.

    \b
    nereusc plan.nir                       check every plan, compile every transition
    nereusc plan.nir --emit json -o p.json write the rank program of a transition
    nereusc check plan.nir                 parse, validate, memory feasibility
    nereusc fmt plan.nir                   canonical print
    nereusc search plan.nir --top 3        the fastest plans that fit, as .nir
    nereusc verify p.json                  prove a program correct
    """


@click.group(cls=_LazyGroup, lazy=_NEREUS_COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="nereus")
def nereus():
    """Nereus runtime tools: simulate drift traces, train, benchmark."""


def traceback_requested() -> bool:
    return "--traceback" in sys.argv or os.environ.get("NEREUS_TRACEBACK") == "1"
