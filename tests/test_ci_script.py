""".ci/run: it runs README's test command verbatim, and a failure of any part of it (the
install as much as the tests) fails the run before the vLLM step. Under `set -e` bash does
not stop at a failed command that is not the last of an `&&` list, so a failed install once
went on to the vLLM tests and could end the run with their exit status."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _readme_test_command() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    return [b for b in re.findall(r"```bash\n(.*?)\n```", text, re.S) if "pytest" in b][0].strip()


def test_ci_runs_readmes_test_command_verbatim():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    lines = ci.split("# --- README's test command, verbatim ---\n")[1].split("\n# ---")[0].splitlines()
    assert [line.split(" || exit")[0] for line in lines] == [_readme_test_command()]


def _fake_repo(tmp_path, install_status: int, test_status: int) -> subprocess.CompletedProcess:
    """.ci/run in a copy whose python3 makes a fake virtual environment: its pip returns
    `install_status` for the install, its python `test_status` for pytest; .ci/vllm.sh
    only says that it ran."""
    repo, bin_dir = tmp_path / "repo", tmp_path / "bin"
    (repo / ".ci").mkdir(parents=True)
    bin_dir.mkdir()
    shutil.copy(os.path.join(ROOT, ".ci", "run"), repo / ".ci" / "run")
    (repo / ".ci" / "vllm.sh").write_text("echo VLLM-STEP-RAN\n")
    activate = (f"pip() {{ echo pip \"$@\"; return {install_status}; }}\n"
                f"python() {{ if [ \"$2\" = pytest ]; then echo PYTEST-RAN; return {test_status}; fi; }}\n")
    python3 = bin_dir / "python3"
    python3.write_text(f"#!/bin/sh\nmkdir -p .ci-venv/bin && cat > .ci-venv/bin/activate <<'EOF'\n{activate}EOF\n")
    python3.chmod(python3.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["bash", str(repo / ".ci" / "run")], capture_output=True, text=True, env=env, timeout=60)


def test_a_failed_install_fails_the_run_before_the_tests_and_the_vllm_step(tmp_path):
    done = _fake_repo(tmp_path, install_status=3, test_status=0)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "PYTEST-RAN" not in done.stdout and "VLLM-STEP-RAN" not in done.stdout


def test_failed_tests_fail_the_run_and_passing_ones_go_on_to_the_vllm_step(tmp_path):
    failed = _fake_repo(tmp_path / "a", install_status=0, test_status=1)
    assert failed.returncode == 1 and "PYTEST-RAN" in failed.stdout and "VLLM-STEP-RAN" not in failed.stdout
    passed = _fake_repo(tmp_path / "b", install_status=0, test_status=0)
    assert passed.returncode == 0 and "PYTEST-RAN" in passed.stdout and "VLLM-STEP-RAN" in passed.stdout


def test_ci_installs_triton_so_that_the_interpreter_tests_run(tmp_path):
    """README's CPU test command leaves Triton out (the `test` extra does not need it: the
    pack-kernel tests skip without it); CI installs the `gpu` extra before it, so that
    they run there."""
    done = _fake_repo(tmp_path, install_status=0, test_status=0)
    lines = done.stdout.splitlines()
    gpu = [i for i, line in enumerate(lines) if line.startswith("pip install") and ".[gpu]" in line]
    assert gpu and gpu[0] < lines.index("PYTEST-RAN"), done.stdout
