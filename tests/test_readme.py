"""README's code blocks run as printed: the `nereusc` lines, the sample output (compared
exactly; `NEREUS_UPDATE_README=1` rewrites it from the CLI), the embedding snippet under
torchrun with 2 gloo processes, the multi-node line as two torchrun agents on one host, and
the Slurm script's shell syntax."""

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
README = ROOT / "README.md"
NEREUSC = f"{shlex.quote(sys.executable)} -m nereus.cli"
TORCHRUN = f"{shlex.quote(sys.executable)} -m torch.distributed.run"
SAMPLE = "$ nereusc examples/ppo-8b.nir\n"


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))), "OMP_NUM_THREADS": "1"}
    env.pop("NEREUS_TRACEBACK", None)
    return env


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(section heading, language, body) of every fenced block, in order."""
    out, heading = [], ""
    for match in re.finditer(r"^(## [^\n]*)$|^```(\w*)\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
        if match.group(1):
            heading = match.group(1)[3:]
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


def test_sample_output_is_what_the_cli_prints():
    text = README.read_text()
    start = text.index(SAMPLE) + len(SAMPLE)
    end = text.index("```", start)
    printed = subprocess.run(f"{NEREUSC} examples/ppo-8b.nir", shell=True, cwd=ROOT, env=_env(),
                             capture_output=True, text=True, timeout=600)
    assert printed.returncode == 0, printed.stderr
    if os.environ.get("NEREUS_UPDATE_README") == "1":
        README.write_text(text[:start] + printed.stdout + text[end:])
        return
    assert text[start:end] == printed.stdout


def _snippet(tmp_path) -> pathlib.Path:
    (code,) = _section("Embedding the runtime", "python")
    path = tmp_path / "embed.py"
    path.write_text(code)
    return path


def _check_ranks(outputs: str, world: int) -> None:
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
    _check_ranks(result.stdout, 2)


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
    command = (line.replace("torchrun", TORCHRUN, 1).replace("29500", str(_port_outside_ephemeral_range()))
               .replace("embed.py", shlex.quote(str(script))))
    env = {**_env(), "HEAD_NODE": "127.0.0.1"}
    agents = [subprocess.Popen(command, shell=True, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = []
    for agent in agents:
        out, err = agent.communicate(timeout=600)
        assert agent.returncode == 0, err[-3000:]
        outputs.append(out)
    _check_ranks("".join(outputs), 2)


@pytest.mark.multiprocess
def test_two_torchrun_agents_play_two_nodes(tmp_path):
    (line,) = [b.strip() for b in _section("Running on a cluster", "bash") if b.startswith("torchrun --nnodes")]
    two_agents(line, _snippet(tmp_path))


def test_slurm_script_is_valid_shell():
    (script,) = [b for b in _section("Running on a cluster", "bash") if b.startswith("#!/bin/bash")]
    assert "#SBATCH --nodes=" in script and "srun torchrun" in script and "--rdzv-endpoint" in script
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
