"""Fail fast: a transition into or out of a plan that does not fit is refused before any
pass runs, with `nereusc check`'s wording, in about the time the check takes."""

import pathlib
import time

import pytest
from click.testing import CliRunner

from nereus.cli import nereusc
from nereus.ir import parse_file, parse_source
from nereus.ir.diagnostics import InfeasibleError
from nereus.passes import compile_transition

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"

# the infeasible example with a second plan that fits (70B training over 32 GPUs)
SOURCE = (EXAMPLES / "infeasible-70b-8gpu.nir").read_text().replace("nodes 1", "nodes 4") + """
plan roomy {
  actor.generation  dp 4 tp 8       on 0..31
  actor.training    dp 1 tp 8 pp 4  on 0..31
}
transition roomy -> tight
"""


def _run(*args):
    return CliRunner().invoke(nereusc, list(args), catch_exceptions=False)


@pytest.mark.parametrize("source,target", [("roomy", "tight"), ("tight", "roomy")])
def test_compile_refuses_a_plan_that_does_not_fit(source, target):
    module = parse_source(SOURCE, "two.nir")
    with pytest.raises(InfeasibleError) as info:
        compile_transition(module, source, target)
    assert "plan tight does not fit: GPU 0 needs" in info.value.message
    assert "hint" not in info.value.message and "largest contributor is actor.training optimizer" in info.value.hint
    assert info.value.loc is not None and info.value.loc.line == module.plan("tight").loc.line


def test_compile_fails_in_about_the_time_of_check():
    from nereus.passes.feasibility import check_plan

    module = parse_file(str(EXAMPLES / "grpo-70b-1024.nir"))
    # S2 with training squeezed into one pipeline stage: 16 B/param / 8 does not fit
    text = (EXAMPLES / "grpo-70b-1024.nir").read_text().replace(
        "actor.training    dp 8  tp 8 pp 16  on 0..1023", "actor.training    dp 128 tp 8  on 0..1023")
    module = parse_source(text, "grpo.nir")
    start = time.perf_counter()
    check_plan(module, "S1"), check_plan(module, "S2")
    check_s = time.perf_counter() - start
    start = time.perf_counter()
    with pytest.raises(InfeasibleError):
        compile_transition(module, "S1", "S2")
    assert time.perf_counter() - start < 3 * check_s + 1.0  # the check, not the passes


def test_cli_transition_into_an_infeasible_plan_exits_2_with_the_check_message(tmp_path):
    path = tmp_path / "two.nir"
    path.write_text(SOURCE)
    check = _run("check", str(path), "--plan", "tight")
    result = _run(str(path), "--transition", "roomy->tight", "--emit", "json")
    assert result.exit_code == 2
    assert "Traceback" not in result.output and '"rounds"' not in result.output
    error = [line for line in check.output.splitlines() if "error:" in line]
    assert error and error[0] in result.output  # same wording, same location
    assert "hint: the largest contributor is actor.training optimizer" in result.output


def test_cli_default_mode_reports_once_and_skips_the_transition(tmp_path):
    path = tmp_path / "two.nir"
    path.write_text(SOURCE)
    result = _run(str(path))
    assert result.exit_code == 2
    assert result.output.count("plan tight does not fit") == 1
    assert "transition roomy -> tight:" not in result.output


def test_check_fit_false_leaves_it_to_the_scheduler():
    module = parse_source(SOURCE, "two.nir")
    # the passes run: the scheduler finds no memory-safe order and says so in its own words
    with pytest.raises(InfeasibleError) as info:
        compile_transition(module, "roomy", "tight", check_fit=False)
    assert "transition roomy -> tight cannot fit" in info.value.message
    assert "does not fit: GPU" not in info.value.message
