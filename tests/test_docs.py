"""The project's docs stand alone: no reference to files outside the repository; the
language reference covers every construct; docs/api.md's example runs as printed; the
index lists every page; docs/cli.md lists every option of every command and prints what
the commands print."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    env.pop("NEREUS_TRACEBACK", None)
    return env


def test_no_reference_to_files_outside_the_repository():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    offenders = []
    for name in listed:
        path = ROOT / name
        if path.suffix in (".py", ".md", ".lark", ".nir", ".toml", ".sh", ".txt") and path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            if re.search(r"\b(DESIGN|MODELS)\.md\b", text) and name != "tests/test_docs.py":
                offenders.append(name)
    assert offenders == []


def test_language_reference_covers_every_construct_and_rule():
    text = (ROOT / "docs" / "ir.md").read_text()
    for heading in ("### cluster", "### model", "### workload", "### plan", "### transition",
                    "## Values and units", "### Ranges", "## GPU sets and the mesh order",
                    "## Rules the compiler enforces", "## The memory model"):
        assert heading in text
    from nereus.ir.build import CLUSTER_KEYS, GPU_KEYS, MODEL_KEYS, PLACEMENT_KEYS, WORKLOAD_KEYS
    from nereus.ir.units import FLOPS_UNITS, RATE_UNITS, SIZE_UNITS

    for key in [*CLUSTER_KEYS, *GPU_KEYS, *MODEL_KEYS, *WORKLOAD_KEYS, *PLACEMENT_KEYS]:
        assert f"`{key}" in text, key
    for unit in [*SIZE_UNITS, *RATE_UNITS, *FLOPS_UNITS]:
        assert f"`{unit}`" in text, unit


def test_api_example_runs_as_printed(monkeypatch, capsys):
    text = (ROOT / "docs" / "api.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    monkeypatch.chdir(ROOT)
    exec(compile(code, "docs/api.md", "exec"), {})
    assert capsys.readouterr().out.splitlines()[-1].startswith("ok: ")


# -- docs/README.md: the index --------------------------------------------------------

def test_the_index_lists_every_page_and_every_link_resolves():
    index = (ROOT / "docs" / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)\)", index)
    assert all((ROOT / "docs" / link).resolve().is_file() for link in links), links
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages - set(links) == set(), "docs/ pages the index does not list"


# -- docs/cli.md: every command, every option ----------------------------------------

def _commands() -> list:
    """(program, name, click command) of every command of `nereusc` and `nereus`."""
    import importlib

    from nereus.cli import _NEREUS_COMMANDS, _NEREUSC_COMMANDS

    out = []
    for program, table in (("nereusc", _NEREUSC_COMMANDS), ("nereus", _NEREUS_COMMANDS)):
        for name, (module, attribute, _) in sorted(table.items()):
            out.append((program, name, getattr(importlib.import_module(module), attribute)))
    return out


def _section(text: str, heading: str) -> str:
    """The text of the `## ` section whose heading starts with `heading`, up to the next one."""
    match = re.search(rf"^{re.escape(heading)}[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no section {heading!r}"
    return match.group(1)


def _option_rows(section: str) -> dict:
    """{flag: its table row} for the option tables of a section (rows whose first cell
    starts with a flag, e.g. | `-o`, `--output FILE` | ...)."""
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `-"):
            first = line.split(" | ", 1)[0]
            for flag in re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", first):
                rows[flag] = line
    return rows


def test_the_cli_reference_documents_every_option_of_every_command():
    import click

    text = (ROOT / "docs" / "cli.md").read_text()
    for program, name, command in _commands():
        section = _section(text, f"## `{program} {name}`")
        rows = _option_rows(section)
        flags = set()
        for param in command.params:
            if not isinstance(param, click.Option) or param.name == "help":
                continue
            for flag in param.opts + param.secondary_opts:
                flags.add(flag)
                assert flag in rows, f"`{program} {name}` has {flag}, which docs/cli.md does not list"
            row = rows[param.opts[0]]
            if isinstance(param.type, click.Choice):
                for choice in param.type.choices:
                    assert choice in row, f"{program} {name} {param.opts[0]}: choice {choice} undocumented"
            default = param.default  # click's UNSET sentinel, None, () or "": no default to state
            if not param.is_flag and isinstance(default, (int, float, str)) and default != "":
                assert str(param.default) in row, f"{program} {name} {param.opts[0]}: default {param.default}"
        assert set(rows) - flags == set(), f"docs/cli.md lists options `{program} {name}` does not have"


def test_the_cli_reference_check_fails_on_an_undocumented_option(monkeypatch):
    # the check above must see a new option: add one to a command and run it
    import click

    from nereus.cli.check import check_command

    monkeypatch.setattr(check_command, "params", check_command.params + [click.Option(["--shiny"], is_flag=True)])
    with pytest.raises(AssertionError, match="--shiny"):
        test_the_cli_reference_documents_every_option_of_every_command()


def test_the_cli_examples_are_what_the_commands_print():
    # `$ nereusc ...` blocks (search's has its own test, tests/test_cli_search.py)
    text = (ROOT / "docs" / "cli.md").read_text()
    examples = re.findall(r"```\n\$ (nereusc (?!search)[^\n]*)\n(.*?)```", text, re.S)
    assert examples
    for command, printed in examples:
        result = subprocess.run([sys.executable, "-m", "nereus.cli", *command.split()[1:]], cwd=ROOT,
                                capture_output=True, text=True, env=_env())
        assert result.returncode == 0, result.stderr
        assert result.stdout == printed, command


# -- docs/runtime.md and docs/multi-node.md --------------------------------------------

def _public(cls) -> set:
    """The public methods and properties `cls` defines or inherits from Nereus classes."""
    return {name for klass in cls.__mro__ if klass.__module__.startswith("nereus.")
            for name, value in vars(klass).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, (property, classmethod)))}


def test_the_runtime_reference_covers_the_public_api():
    pytest.importorskip("torch")
    import dataclasses
    import inspect

    import nereus.runtime as nr
    from nereus.runtime.vllm_engine import VllmGeneration
    from nereus.runtime.vllm_sync import SyncResult, WeightSync

    text = (ROOT / "docs" / "runtime.md").read_text()
    for cls in (nr.Runtime, WeightSync, VllmGeneration):
        for name in _public(cls) - {"to_json"}:
            assert re.search(rf"`(\w+\.)?{name}[`(]", text), f"{cls.__name__}.{name} is not in docs/runtime.md"
        for name in inspect.signature(cls.__init__).parameters:
            if name not in ("self", "engine_options"):
                assert f"`{name}" in text or f" {name}=" in text, f"{cls.__name__}({name}=) is not documented"
    for cls in (nr.TransitionReport, SyncResult, nr.Failure):
        for field in dataclasses.fields(cls):
            assert f"`{field.name}`" in text or f"{field.name}," in text or f"{field.name})" in text, \
                f"{cls.__name__}.{field.name} is not in docs/runtime.md"
    for name in nr.__all__:
        assert f"`{name}" in text, f"nereus.runtime.{name} is not in docs/runtime.md"


def test_every_variable_the_runtime_and_launcher_read_is_on_their_page():
    from test_env_vars_documented import READS

    # (what reads them, the page, its section that must name them)
    for folders, page, heading in (((ROOT / "nereus" / "runtime",), "runtime.md", "## Environment variables"),
                                   ((ROOT / "nereus" / "cli" / "launch.py", ROOT / "nereus" / "rl"),
                                    "multi-node.md", "## Timeouts and injected faults")):
        read = set()
        for folder in folders:
            for path in ([folder] if folder.is_file() else folder.rglob("*.py")):
                read |= {a or b for a, b in READS.findall(path.read_text())}
        assert read, page
        text = _section((ROOT / "docs" / page).read_text(), heading)
        assert {name for name in read if f"`{name}`" not in text} == set(), page


def _python_blocks(page: str) -> list:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S)


def _readme_section(heading: str, language: str) -> list:
    from test_readme import README, blocks

    return [body for head, lang, body in blocks(README.read_text()) if head == heading and lang == language]


def _torchrun(script: pathlib.Path, nproc: int = 2) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(script)]
    result = subprocess.run(command, cwd=ROOT, env={**_env(), "OMP_NUM_THREADS": "1"}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.multiprocess
def test_the_runtime_examples_run_under_torchrun(tmp_path):
    pytest.importorskip("torch")
    embed, sync = _python_blocks("runtime.md")
    readme = _readme_section("Embedding the runtime", "python")
    if readme:  # README runs its copy (tests/test_readme.py): the two must not drift apart
        assert readme == [embed]
    else:
        (tmp_path / "embed.py").write_text(embed)
        out = _torchrun(tmp_path / "embed.py")
        assert all(f"rank {r}: S1 -> S2 in" in out for r in (0, 1)), out
    (tmp_path / "sync.py").write_text(sync)
    out = _torchrun(tmp_path / "sync.py")
    for rank in (0, 1):
        for plan in ("S1", "S2"):
            assert re.search(rf"rank {rank}: sync in {plan}: \d+ KiB sent, \d+ KiB kept in place", out), out


def test_the_cluster_page_launch_lines_are_the_tested_ones(tmp_path):
    text = (ROOT / "docs" / "multi-node.md").read_text()
    bash = re.findall(r"```bash\n(.*?)```", text, re.S)
    (line,) = [b.strip() for b in bash if b.startswith("torchrun --nnodes")]
    (script,) = [b for b in bash if b.startswith("#!/bin/bash")]
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "srun torchrun" in script and "--rdzv-endpoint" in script
    readme = [b.strip() for b in _readme_section("Running on a cluster", "bash")]
    if readme:  # README's copies run as two agents on one host (tests/test_readme.py)
        assert line in readme and script.strip() in readme
    else:  # the page's line, with runtime.md's opening example as its embed.py
        pytest.importorskip("torch")
        from test_readme import two_agents

        embed = tmp_path / "embed.py"
        embed.write_text(_python_blocks("runtime.md")[0])
        two_agents(line, embed)
