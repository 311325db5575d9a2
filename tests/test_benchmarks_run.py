"""benchmarks/run.py, the benchmarks' one harness: its list names every script of
benchmarks/ (and only scripts that exist), and a benchmark whose last stdout line is not
one JSON object, or that fails, is reported as an error. Tiny stand-in scripts, no real
benchmark runs."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
import textwrap

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def _load():
    spec = importlib.util.spec_from_file_location("benchmarks_run", BENCH / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while the class is made
    spec.loader.exec_module(module)
    return module


run = _load()


def test_the_list_names_every_benchmark_and_each_exists(capsys):
    assert run.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == [b.name for b in run.BENCHMARKS] and len(set(listed)) == len(listed)
    for bench in run.BENCHMARKS:
        assert (BENCH / bench.path).is_file(), bench.path
        assert bench.launch in ("python", "torchrun", "bash") and bench.machine and bench.what


def test_every_script_of_benchmarks_is_listed_or_a_helper():
    """A script added to benchmarks/ is either a benchmark of the list or named a helper;
    one removed leaves no entry behind (the test above)."""
    scripts = {str(p.relative_to(BENCH)) for pattern in ("*.py", "*.sh", "multi_gpu/*.py", "multi_gpu/*.sh")
               for p in BENCH.glob(pattern)}
    known = {b.path for b in run.BENCHMARKS} | set(run.HELPERS)
    assert scripts - known == set(), "scripts neither listed in benchmarks/run.py nor named helpers"
    assert set(run.HELPERS) <= scripts


def _stand_in(tmp_path, body: str):
    script = tmp_path / "stand_in.py"
    script.write_text(textwrap.dedent(body))
    return [run.Benchmark("stand_in", str(script), "CPU", "a stand-in")]


@pytest.mark.parametrize("body, message, status", [
    ("print('progress'); print('done: 3 cases')", "its last stdout line is not JSON: 'done: 3 cases'", 1),
    ("import json; print(json.dumps([1, 2]))", "its last stdout line is JSON but not one object", 1),
    ("import sys; print('{\"name\": \"x\"}'); sys.exit(3)", "exited with status 3", 3),
    ("pass", "printed nothing on stdout", 1),
])
def test_a_benchmark_without_a_json_result_is_an_error(tmp_path, capsys, body, message, status):
    out = tmp_path / "out"
    assert run.main(["--out", str(out), "stand_in"], benchmarks=_stand_in(tmp_path, body)) == status
    err = capsys.readouterr().err
    assert err.startswith("error: benchmark stand_in: ") and message in err
    assert not out.exists()


def test_a_benchmark_result_is_echoed_and_kept_with_its_run(tmp_path, capsys):
    body = """
        import json, sys
        print("case a: 1.5 s")
        print(json.dumps({"name": "stand_in", "args": sys.argv[1:]}))
        print()
    """
    out = tmp_path / "out"
    assert run.main(["--out", str(out), "stand_in", "--layers", "2"], benchmarks=_stand_in(tmp_path, body)) == 0
    assert capsys.readouterr().out.startswith("case a: 1.5 s\n")
    assert json.loads((out / "stand_in.json").read_text()) == {"name": "stand_in", "args": ["--layers", "2"]}
    meta = json.loads((out / "stand_in.run.json").read_text())
    assert meta["benchmark"] == "stand_in" and meta["exit_status"] == 0 and meta["command"][-2:] == ["--layers", "2"]


def test_an_unknown_name_is_a_usage_error(capsys):
    assert run.main(["no_such_benchmark"]) == 2
    assert "no benchmark named 'no_such_benchmark'; choose one of: calibrate_cost" in capsys.readouterr().err


def test_nereus_bench_lists_and_runs_through_the_harness():
    """`nereus bench` is run.py's list (one list: multi_gpu/ scripts included, run.py itself
    not), and an unknown name is refused before anything starts."""
    from click.testing import CliRunner

    from nereus.cli import nereus

    listed = CliRunner().invoke(nereus, ["bench"])
    assert listed.exit_code == 0
    assert [line.split()[0] for line in listed.output.splitlines()] == [b.name for b in run.BENCHMARKS]
    unknown = CliRunner().invoke(nereus, ["bench", "run"])
    assert unknown.exit_code == 2 and "no benchmark named 'run'" in unknown.output
