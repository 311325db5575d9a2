"""`--transition S1:S2`: the shell-safe spelling, accepted unquoted beside the quoted 'S1->S2'."""

import json
import os
import re
import pathlib
import subprocess
import sys

import pytest
from click.testing import CliRunner

from nereus.cli import nereusc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PPO = ROOT / "examples" / "ppo-8b.nir"


def test_unquoted_colon_form_works_through_a_real_shell(tmp_path):
    # `S1->S2` unquoted would be `S1-` plus a redirect into a file named `S2`
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    command = f"{sys.executable} -m nereus.cli {PPO} --transition S1:S2 --emit json -o program.json"
    result = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["program.json"]
    assert json.loads((tmp_path / "program.json").read_text())["transition"] == {"from": "S1", "to": "S2"}


@pytest.mark.parametrize("spelling", ["S1:S2", "S1->S2", " S1 : S2 ", "S1 -> S2"])
def test_both_spellings_compile_the_same_transition(spelling):
    result = CliRunner().invoke(nereusc, [str(PPO), "--transition", spelling, "--emit", "summary"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("transition S1 -> S2:")


def test_a_malformed_transition_says_the_shell_safe_form():
    result = CliRunner().invoke(nereusc, [str(PPO), "--transition", "S1-"])
    assert result.exit_code == 2
    assert result.output == ("error: --transition 'S1-' is not of the form S1:S2\n"
                             "hint: write --transition S1:S2 (or quote the arrow: --transition 'S1->S2')\n")


def test_hints_and_docs_use_the_shell_safe_form():
    # an unquoted `--transition A->B` in a command a user copies is the redirect trap
    trap = re.compile(r"--transition\s+[\w.-]+->")
    texts = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("examples/**/*.md"), *ROOT.glob("examples/**/*.py"),
             *ROOT.glob("nereus/**/*.py"), *ROOT.glob("benchmarks/**/*.py")]
    offenders = [str(path.relative_to(ROOT)) for path in texts if trap.search(path.read_text())]
    assert offenders == []
