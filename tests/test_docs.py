"""The project's docs stand alone: no reference to files outside the repository; the
language reference covers every construct; docs/api.md's example runs as printed; the
index lists every page; docs/cli.md lists every option of every command and prints what
the commands print."""

import os
import pathlib
import random
import re
import shlex
import socket
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


def _heading_anchors(path: pathlib.Path) -> set:
    """The anchors GitHub gives the headings of a Markdown file: lower case, punctuation
    dropped, spaces as hyphens, a repeated one suffixed -1, -2, ..."""
    anchors, seen = set(), {}
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} (.*)$", text, re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def broken_links(pages: list, root: pathlib.Path = ROOT) -> list:
    """(page, link) of every relative link of `pages` whose file is missing or whose
    #anchor names no heading of a Markdown file (links inside code blocks are not links)."""
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", link):  # https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _heading_anchors(target)):
                broken.append((str(page.relative_to(root)), link))
    return broken


def test_every_relative_link_of_readme_and_the_docs_resolves():
    assert broken_links([ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]) == []


def test_the_link_check_sees_a_missing_page_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top: the `x` part\n\n[a](page.md#top-the-x-part) [b](gone.md) [c](#nowhere)\n"
                    "```\n[d](also-gone.md)\n```\n")
    assert broken_links([page], root=tmp_path) == [("page.md", "gone.md"), ("page.md", "#nowhere")]


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
    from test_readme import EMBED_HEADING, check_embed_ranks

    embed, sync = _python_blocks("runtime.md")
    readme = _readme_section(EMBED_HEADING, "python")
    if readme:  # README runs its copy (tests/test_readme.py): the two must not drift apart
        assert readme == [embed]
    else:
        (tmp_path / "embed.py").write_text(embed)
        check_embed_ranks(_torchrun(tmp_path / "embed.py"))
    (tmp_path / "sync.py").write_text(sync)
    out = _torchrun(tmp_path / "sync.py")
    for rank in (0, 1):
        for plan in ("S1", "S2"):
            assert re.search(rf"rank {rank}: sync in {plan}: \d+ KiB sent, \d+ KiB kept in place", out), out


def _port_outside_ephemeral_range() -> int:
    """A port that is free now and that no other process's connect() or bind(0) can take
    before the head agent binds it: outside the kernel's ephemeral range. (The port of
    bind(0) is in that range, where the gloo connections of tests running beside this one
    take theirs: a port chosen that way can be gone seconds later.)"""
    try:
        low, high = map(int, pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999
    # below the range where there is room (a range can start at 1024), else above it
    outside = range(max(1024, low // 2), low) if low > 2048 else range(high + 1, 65536)
    rng = random.Random(os.getpid())
    for _ in range(100 if outside else 0):
        port = rng.choice(outside)
        with socket.socket() as s:
            try:
                s.bind(("", port))  # (the store's server listens on every address)
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port outside the ephemeral range {low}-{high}")


def two_agents(line: str, script: pathlib.Path) -> None:
    """Run the 2-node torchrun `line` as two agents on this host (rendezvous on 127.0.0.1)
    with `script` as its embed.py, and check both ranks' lines."""
    assert "--nnodes 2 --nproc-per-node 1" in line
    torchrun = f"{shlex.quote(sys.executable)} -m torch.distributed.run"
    command = (line.replace("torchrun", torchrun, 1).replace("29500", str(_port_outside_ephemeral_range()))
               .replace("embed.py", shlex.quote(str(script))))
    env = {**_env(), "HEAD_NODE": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(command, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = []
    for agent in agents:
        out, err = agent.communicate(timeout=600)
        assert agent.returncode == 0, err[-3000:]
        outputs.append(out)
    from test_readme import check_embed_ranks

    check_embed_ranks("".join(outputs))


def _cluster_page_bash() -> list:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "multi-node.md").read_text(), re.S)


def test_the_cluster_page_slurm_script_is_valid_shell():
    (script,) = [b for b in _cluster_page_bash() if b.startswith("#!/bin/bash")]
    assert "#SBATCH --nodes=" in script and "srun torchrun" in script and "--rdzv-endpoint" in script
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.multiprocess
def test_the_cluster_page_launch_line_runs_as_two_agents(tmp_path):
    # the page's line, with runtime.md's opening example as its embed.py
    pytest.importorskip("torch")
    (line,) = [b.strip() for b in _cluster_page_bash() if b.startswith("torchrun --nnodes")]
    embed = tmp_path / "embed.py"
    embed.write_text(_python_blocks("runtime.md")[0])
    two_agents(line, embed)
