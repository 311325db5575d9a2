"""How every command reports a user error: text with a caret on stderr, or with --json one
JSON object on stdout; exit 2 with or without --traceback; bytes in one human unit."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BAD = """cluster c {
  nodes 1
  gpus_per_node 2
  gpu { mem 80GB flops 989TFLOPS hbm 3.35TB/s }
  intra 900GB/s
  inter 25GB/s
  host_mem 1TB
}
model m = llama { layers 4 hidden 256 heads 8 kv_heads 2 ffn 512 vocab 1024 }
workload w {
  batch 256 prompt 16 response 16 microbatch 3
  training: m
}
plan A { m.training dp 2 on 0..1 }
"""


def nereusc(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    env.pop("NEREUS_TRACEBACK", None)
    return subprocess.run([sys.executable, "-m", "nereus.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True)


@pytest.fixture()
def bad(tmp_path):
    path = tmp_path / "bad.nir"
    path.write_text(BAD)
    return path


EXPECTED = {"file": None, "line": 11, "col": 46, "type": "SemanticError",
            "message": "microbatch 3 must divide batch (256)",
            "hint": "a step runs batch / microbatch whole microbatches; microbatches that divide 256: "
                    "1, 2, 4, 8, 16, 32, 64, 128, ..."}


@pytest.mark.parametrize("command", [["check"], ["compile"], ["search"], []], ids=["check", "compile", "search", "default"])
def test_json_error_is_one_object_on_stdout(bad, command):
    result = nereusc(*command, bad, "--json")
    assert result.returncode == 2
    assert json.loads(result.stdout) == {"error": {**EXPECTED, "file": str(bad)}}
    assert "Traceback" not in result.stderr


def test_text_error_keeps_stdout_empty(bad):
    result = nereusc("check", bad)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"{bad}:11:46: error: microbatch 3 must divide batch (256)\n")


def test_traceback_prints_the_traceback_and_still_exits_2(bad):
    result = nereusc("check", bad, "--traceback")
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.rstrip().endswith("hint: a step runs batch / microbatch whole microbatches; "
                                           "microbatches that divide 256: 1, 2, 4, 8, 16, 32, 64, 128, ...")


def test_traceback_does_not_repeat_the_message(bad):
    """The traceback ends with the error's type; its message (for `nereus train`, a rank's
    own traceback) is printed once, below it."""
    result = nereusc("check", bad, "--traceback")
    assert result.stderr.count("microbatch 3 must divide batch (256)") == 1
    assert "SemanticError (the error below)" in result.stderr


def test_missing_file_with_json(tmp_path):
    result = nereusc("check", tmp_path / "nope.nir", "--json")
    assert result.returncode == 2
    error = json.loads(result.stdout)["error"]
    assert error["file"] == str(tmp_path / "nope.nir") and error["line"] is None
    assert error["message"].startswith("No such file or directory")


def test_verify_json_error(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    result = nereusc("verify", path, "--json")
    assert result.returncode == 2
    error = json.loads(result.stdout)["error"]
    assert error["message"].startswith(f"{path} is not JSON")


def test_unknown_plan_with_json_is_a_json_error():
    result = nereusc("check", EXAMPLES / "ppo-8b.nir", "--plan", "S9", "--json")
    assert result.returncode == 2
    assert json.loads(result.stdout)["error"]["message"] == f"no plan named 'S9' in {EXAMPLES / 'ppo-8b.nir'}"


def test_infeasible_plan_says_bytes_in_one_unit():
    text = nereusc("check", EXAMPLES / "infeasible-70b-8gpu.nir")
    assert text.returncode == 2
    assert "GiB" in text.stderr and " bytes" not in text.stderr + text.stdout
    assert " GB" not in text.stdout and " TB" not in text.stdout
    exact = json.loads(nereusc("check", EXAMPLES / "infeasible-70b-8gpu.nir", "--json").stdout)
    assert isinstance(exact["plans"][0]["worst"]["bytes"], int)  # exact bytes only inside --json


def test_summary_uses_binary_units():
    result = nereusc(EXAMPLES / "ppo-8b.nir", "--transition", "S1:S2", "--emit", "summary")
    assert result.returncode == 0, result.stderr
    assert "GiB" in result.stdout and not any(f" {unit} " in result.stdout for unit in ("GB", "TB", "MB"))


@pytest.mark.parametrize("args, message", [
    (["check", "--json", "--bogus"], "No such option '--bogus'"),
    (["compile", "--json", "--emit", "yaml"], "Invalid value for '--emit'"),
    (["runtime", "simulate", "--json", "--margin", "many"], "Invalid value for '--margin'"),
], ids=["unknown-option", "bad-choice", "bad-number"])
def test_usage_errors_with_json_are_json_errors(bad, args, message):
    """A script that asked for --json reads JSON on stdout, also when click refuses the
    command line itself (an unknown option, a value of the wrong kind)."""
    result = nereusc(*args, bad)
    assert result.returncode == 2
    error = json.loads(result.stdout)["error"]
    assert error["type"] == "UsageError" and error["message"].startswith(message)
    assert error["hint"].startswith("see `") and "--help`" in error["hint"]
    assert result.stderr == ""


def test_usage_errors_without_json_keep_clicks_text(bad):
    result = nereusc("check", "--bogus", bad)
    assert result.returncode == 2 and result.stdout == ""
    assert "No such option '--bogus'" in result.stderr and "Usage:" in result.stderr


def test_emit_summary_checks_every_plan_and_says_when_there_is_no_transition(tmp_path):
    """--emit summary on a file whose plan does not fit exits 2 as the default command does
    (it printed nothing and exited 0); with no transition declared it says so."""
    infeasible = EXAMPLES / "infeasible-70b-8gpu.nir"
    result = nereusc(infeasible, "--emit", "summary", "--json")
    assert result.returncode == 2
    assert "plan tight does not fit" in json.loads(result.stdout)["error"]["message"]
    result = nereusc(infeasible, "--emit", "summary")
    assert result.returncode == 2 and "error: plan tight does not fit" in result.stderr
    fits = tmp_path / "fits.nir"
    fits.write_text(infeasible.read_text().replace("layers 80", "layers 8"))
    result = nereusc(fits, "--emit", "summary", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout) == {"transitions": []}
    result = nereusc(fits, "--emit", "summary")
    assert result.returncode == 0 and result.stdout == ""
    assert "declares no transition" in result.stderr


def test_an_infeasible_transition_keeps_the_report_and_the_other_transitions():
    """One transition that cannot be scheduled replaced the whole --json report with a bare
    error without a location; the plan table and the feasible transition A -> C were lost."""
    plan = ROOT / "tests" / "data" / "swap-staging.nir"
    result = nereusc(plan, "--set", "cluster.host_mem=1KB", "--json")
    assert result.returncode == 2, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert [p["plan"] for p in report["plans"]] == ["A", "B", "C"]
    assert [t["transition"] for t in report["transitions"]] == ["A -> C"]
    error = report["error"]
    assert (error["file"], error["line"]) == (str(plan), 29) and "transition A -> B cannot break" in error["message"]
    result = nereusc(plan, "--set", "cluster.host_mem=1KB")
    assert result.returncode == 2
    assert "transition A -> C:" in result.stdout
    assert f"{plan}:29:12: error: transition A -> B cannot break a memory cycle" in result.stderr


def test_a_pipeline_error_is_said_once_and_summary_checks_only_the_plans_it_summarizes(tmp_path):
    plan = ROOT / "tests" / "data" / "swap-staging.nir"
    result = nereusc(plan, "--pipeline", "diff,dag,resources,fusion{bucket=0},lower")
    assert result.returncode == 2 and result.stderr.count("bucket=0") == 1, result.stderr
    assert result.stderr.startswith("error: option bucket=0")  # the command line's, no file line
    text = plan.read_text() + "plan Tiny = A {\n  actor.training dp 1 tp 1 pp 1 on 0\n  critic.training dp 1 on 0\n}\n"
    (tmp_path / "more.nir").write_text(text)
    result = nereusc(tmp_path / "more.nir", "--transition", "A:C", "--emit", "summary")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "transition A -> C" in result.stdout


def test_python_dash_m_usage_lines_say_how_to_run_it_again():
    """`python -m nereus.cli runtime train --help` printed `python -m nereus.cli train`,
    which runs the compiler."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    out = subprocess.run([sys.executable, "-m", "nereus.cli", "runtime", "train", "--help"], env=env,
                         capture_output=True, text=True).stdout
    assert out.startswith("Usage: python -m nereus.cli runtime train [OPTIONS] [PLAN_FILE]")  # optional: --resume
    out = subprocess.run([sys.executable, "-m", "nereus.cli", "check", "--help"], env=env,
                         capture_output=True, text=True).stdout
    assert out.startswith("Usage: python -m nereus.cli check [OPTIONS] FILE")


def test_traceback_shows_what_an_error_was_raised_from(monkeypatch, capsys):
    from nereus.cli.errors import report_error
    from nereus.ir.diagnostics import NereusError

    monkeypatch.setattr(sys, "argv", ["nereusc", "--traceback"])
    try:
        try:
            {}["missing"]
        except KeyError as cause:
            raise NereusError("the outer error") from cause
    except NereusError as error:
        with pytest.raises(SystemExit):
            report_error(error, as_json=False)
    err = capsys.readouterr().err
    assert "KeyError: 'missing'" in err and "raised from the one above" in err
    assert err.count("error: the outer error") == 1
