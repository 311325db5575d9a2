"""`nereusc check` on the bundled examples, and errors without tracebacks."""

import json
import pathlib

import pytest
from click.testing import CliRunner

from nereus.cli import nereusc

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
INFEASIBLE = {"infeasible-70b-8gpu.nir"}


def run(*args):
    return CliRunner().invoke(nereusc, list(args), catch_exceptions=False)


@pytest.mark.parametrize("path", sorted(EXAMPLES.rglob("*.nir")), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_every_example_checks(path):
    result = run("check", str(path))
    if path.name in INFEASIBLE:
        assert result.exit_code == 2
    else:
        assert result.exit_code == 0, result.output
        assert "NO" not in result.output


def test_infeasible_example_names_gpu_stage_and_contributor():
    result = run("check", str(EXAMPLES / "infeasible-70b-8gpu.nir"))
    assert result.exit_code == 2
    # 16 B/param x 70,553,706,496 / 8 = 141,107,412,992 B of training state on each GPU
    assert "infeasible-70b-8gpu.nir:22:6: error: plan tight does not fit: GPU 0 needs" in result.output
    assert "in training but has 131.3 GiB" in result.output
    assert "hint: the largest contributor is actor.training optimizer" in result.output
    assert "Traceback" not in result.output


def test_check_json_reports_every_plan():
    result = run("check", str(EXAMPLES / "ppo-8b.nir"), "--json")
    assert result.exit_code == 0
    report = json.loads(result.output.strip().splitlines()[-1])
    assert [p["plan"] for p in report["plans"]] == ["S1", "S2", "S3"]
    assert report["feasible"] is True


def test_override_can_make_a_plan_infeasible():
    # responses 32x longer: training activations (s = 66,560 tokens) no longer fit
    result = run("check", str(EXAMPLES / "ppo-8b.nir"), "--set", "workload.response=65536", "--plan", "S1")
    assert result.exit_code == 2
    assert "plan S1 does not fit" in result.output


def test_missing_file_is_an_error_not_a_traceback():
    result = run("check", "does-not-exist.nir")
    assert result.exit_code == 2
    assert "Traceback" not in result.output


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.nir")), ids=lambda p: p.name)
def test_examples_are_in_canonical_form(path):
    # `nereusc fmt --check` exits 1 when formatting would change the file
    assert run("fmt", "--check", str(path)).exit_code == 0


def test_default_command_checks_then_compiles_every_transition():
    result = run(str(EXAMPLES / "ppo-8b.nir"))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"{EXAMPLES / 'ppo-8b.nir'}: cluster h200: 64 GPUs (8 x 8")
    assert any(line.startswith("transition S1 -> S2:") for line in lines)
    assert any(line.startswith("transition S2 -> S3:") for line in lines)


def test_default_command_exits_2_on_an_infeasible_plan():
    result = run(str(EXAMPLES / "infeasible-70b-8gpu.nir"), "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout.strip().splitlines()[-1])["feasible"] is False


def test_the_readme_tour_of_the_ir_compiles(tmp_path):
    readme = (EXAMPLES.parent / "README.md").read_text()
    start = readme.index("```\n", readme.index("### 1. Write plans and compile them")) + 4
    tour = tmp_path / "tour.nir"
    tour.write_text(readme[start:readme.index("```", start)])
    result = run(str(tour))
    assert result.exit_code == 0, result.output
    assert "transition S1 -> S2:" in result.output


def test_unknown_plan_in_transition_option_fails_before_any_output():
    result = run(str(EXAMPLES / "ppo-8b.nir"), "--transition", "S1->S9")
    assert result.exit_code == 2
    assert result.stdout == ""
    assert f"error: --transition names no plan 'S9' of {EXAMPLES / 'ppo-8b.nir'}\nhint: plans: S1, S2, S3" in result.output


def test_check_json_on_an_infeasible_plan_is_one_object_with_the_error():
    """docs/cli.md: with --json the error is one JSON object on stdout. For a plan that does
    not fit that object is the report, with the first infeasible plan's error object."""
    import subprocess
    import sys

    path = EXAMPLES / "infeasible-70b-8gpu.nir"
    result = subprocess.run([sys.executable, "-m", "nereus.cli", "check", str(path), "--json"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr == ""
    report = json.loads(result.stdout)
    assert report["feasible"] is False
    error = report["error"]
    assert (error["file"], error["line"], error["col"], error["type"]) == (str(path), 22, 6, "InfeasibleError")
    assert error["message"].startswith("plan tight does not fit: GPU 0 needs")
    assert error["hint"].startswith("the largest contributor is actor.training optimizer")
