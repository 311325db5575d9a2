"""README's code blocks run as printed: the `nereusc` lines, the sample outputs (each
`$ nereusc ...` block compared exactly with what the command prints;
`NEREUS_UPDATE_README=1` rewrites them from the CLI) and the embedding snippet under
torchrun with 2 gloo processes. (The multi-node launch lines are docs/multi-node.md's,
run by tests/test_docs.py.)"""

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
NEREUSC = f"{shlex.quote(sys.executable)} -m nereus.cli"
TORCHRUN = f"{shlex.quote(sys.executable)} -m torch.distributed.run"
# a sample: a fenced block without a language whose first line is `$ nereusc ...`
SAMPLE = re.compile(r"^```\n\$ (nereusc [^\n]*)\n", re.MULTILINE)
EMBED_HEADING = "3. Embed the runtime"


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))), "OMP_NUM_THREADS": "1"}
    env.pop("NEREUS_TRACEBACK", None)
    return env


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(heading of the nearest `##` or `###` section, language, body) of every fenced
    block, in order."""
    out, heading = [], ""
    for match in re.finditer(r"^(###? [^\n]*)$|^```(\w*)\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
        if match.group(1):
            heading = match.group(1).split(" ", 1)[1]
        else:
            out.append((heading, match.group(2), match.group(3)))
    return out


def _section(heading: str, language: str) -> list[str]:
    return [body for head, lang, body in blocks(README.read_text()) if head == heading and lang == language]


def nereusc_lines(text: str) -> list[tuple[str, int]]:
    """The `nereusc ...` commands of README's bash blocks with their expected exit status
    (0, or N when the line's comment says `exit N`)."""
    lines = []
    for _, language, body in blocks(text):
        if language != "bash":
            continue
        for line in body.splitlines():
            command, _, comment = line.partition("#")
            for part in command.split("&&"):
                part = part.strip()
                if part.startswith("nereusc "):
                    expected = re.search(r"\bexit (\d+)", comment)
                    lines.append((part, int(expected.group(1)) if expected else 0))
    return lines


def test_readme_lists_nereusc_lines():
    commands = [c for c, _ in nereusc_lines(README.read_text())]
    assert "nereusc examples/ppo-8b.nir" in commands
    assert any("--transition S1:S2" in c for c in commands)


def test_nereusc_lines_run_as_printed(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for command, expected in nereusc_lines(README.read_text()):
        result = subprocess.run(NEREUSC + command[len("nereusc"):], shell=True, cwd=tmp_path, env=_env(),
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == expected, (command, result.stderr[-2000:])
        assert "Traceback" not in result.stderr, command
    assert sorted(p.name for p in tmp_path.iterdir()) == ["examples", "program.json", "scale-up.dot"]


def samples(text: str) -> list[tuple[str, int, int]]:
    """(command, start, end) of every sample block: text[start:end] is what it shows printed."""
    return [(m.group(1), m.end(), text.index("```", m.end())) for m in SAMPLE.finditer(text)]


def test_sample_outputs_are_what_the_cli_prints():
    text = README.read_text()
    found = samples(text)
    assert any("examples/ppo-8b.nir" in command for command, _, _ in found)
    updated = text
    for command, start, end in reversed(found):  # from the end, so that earlier offsets hold
        printed = subprocess.run(NEREUSC + command[len("nereusc"):], shell=True, cwd=ROOT, env=_env(),
                                 capture_output=True, text=True, timeout=600)
        assert printed.returncode == 0, (command, printed.stderr)
        if os.environ.get("NEREUS_UPDATE_README") == "1":
            updated = updated[:start] + printed.stdout + updated[end:]
        else:
            assert text[start:end] == printed.stdout, command
    if updated != text:
        README.write_text(updated)


def _snippet(tmp_path) -> pathlib.Path:
    (code,) = _section(EMBED_HEADING, "python")
    path = tmp_path / "embed.py"
    path.write_text(code)
    return path


def check_embed_ranks(outputs: str, world: int = 2) -> None:
    """Every rank's line of the embedding example (README, docs/runtime.md) is in `outputs`."""
    for rank in range(world):
        # the ranks share one pipe: their lines may interleave, so no line anchors
        assert re.search(rf"rank {rank}: S1 -> S2 in [0-9.]+ ms, [0-9.]+ MiB sent, pack backend torch",
                         outputs), outputs[-3000:]


@pytest.mark.multiprocess
def test_embedding_snippet_runs_under_torchrun(tmp_path):
    text = README.read_text()
    (line,) = re.findall(r"`(torchrun --standalone [^`]*embed\.py)`", text)
    script = _snippet(tmp_path)
    command = line.replace("torchrun", TORCHRUN, 1).replace("embed.py", shlex.quote(str(script)))
    result = subprocess.run(command, shell=True, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    check_embed_ranks(result.stdout)
