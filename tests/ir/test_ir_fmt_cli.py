"""`nereusc fmt`: canonical print, -o, --check, --set, errors (exit 2), and parse_file's
file-level errors (missing file, not UTF-8)."""

from pathlib import Path

import pytest
from click.testing import CliRunner

import nereus.ir as ir
from nereus.cli import nereusc

GOLDEN = Path(__file__).parent / "golden"


def _run(*args, input=None):
    return CliRunner().invoke(nereusc, ["fmt", *map(str, args)], input=input)


def test_prints_canonical_text():
    result = _run(GOLDEN / "sample.nir")
    assert result.exit_code == 0, result.output
    assert result.stdout == (GOLDEN / "sample.formatted.nir").read_text()


def test_output_file_and_check(tmp_path):
    out = tmp_path / "out.nir"
    assert _run(GOLDEN / "sample.nir", "-o", out).exit_code == 0
    assert out.read_text() == (GOLDEN / "sample.formatted.nir").read_text()
    assert _run(out, "--check").exit_code == 0
    not_canonical = _run(GOLDEN / "sample.nir", "--check")
    assert not_canonical.exit_code == 1
    assert "+plan S3 = S2 { }" not in not_canonical.stdout  # unchanged lines are context, not diff
    assert "-cluster   lab{nodes 4 gpus_per_node 4" in not_canonical.stdout
    assert "+cluster lab {" in not_canonical.stdout
    assert "is not in canonical form" in not_canonical.stderr


def test_set_overrides_and_stdin():
    text = (GOLDEN / "sample.canonical.nir").read_text()
    result = _run("-", "--set", "workload.response=8192", "--set", "cluster.reserve=10%", input=text)
    assert result.exit_code == 0, result.output
    assert "response 8192" in result.stdout and "reserve 10%" in result.stdout
    assert "response 4096" not in result.stdout


def test_errors_exit_2_with_located_text(tmp_path):
    bad = tmp_path / "bad.nir"
    bad.write_text((GOLDEN / "sample.canonical.nir").read_text().replace("dp 16 ", "dp 15 "))
    result = _run(bad)
    assert result.exit_code == 2
    assert result.stderr == (
        f"{bad}:28:41: error: the GPU set of critic.inference has 16 GPUs, but dp x tp x pp = 15 x 1 x 1 = 15\n"
        "   28 |   critic.inference  dp 15            on 15..0\n"
        "      |                                         ^^^^^\n"
        "hint: give 15 GPUs (e.g. on 0..14) or change dp to 16\n")
    assert "Traceback" not in result.output
    bad_set = _run(GOLDEN / "sample.nir", "--set", "workload.batch=0")
    assert bad_set.exit_code == 2
    assert bad_set.stderr.startswith("<--set>:1:16: error: batch must be at least 1, found 0")


def test_missing_file_exit_2(tmp_path):
    result = _run(tmp_path / "nope.nir")
    assert result.exit_code == 2
    assert "No such file or directory" in result.stderr


def test_not_utf8(tmp_path):
    path = tmp_path / "latin1.nir"
    path.write_bytes(b"cluster c {\n  nodes 2 # caf\xe9\n}\n")
    with pytest.raises(ir.ParseError) as caught:
        ir.parse_file(path)
    assert caught.value.format() == (
        f"{path}:2:16: error: the file is not UTF-8 text: byte 0xe9 cannot be decoded\n"
        "    2 |   nodes 2 # caf\n"
        "      |                ^\n"
        "hint: save the file as UTF-8")
    result = _run(path)
    assert result.exit_code == 2 and f"{path}:2:16: error: the file is not UTF-8 text" in result.stderr


def test_parse_file_missing_raises_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        ir.parse_file(tmp_path / "nope.nir")


def test_front_end_imports_neither_torch_nor_triton():
    import os
    import subprocess
    import sys

    code = ("import sys, nereus.ir as ir, nereus.cli.fmt\n"
            f"ir.format_source(open({str(GOLDEN / 'sample.nir')!r}).read())\n"
            "print(sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))")
    root = str(Path(__file__).parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={"PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
                              "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
