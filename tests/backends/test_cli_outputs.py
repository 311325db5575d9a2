"""What nereusc prints around its results (issue 43, "the second hour"): empty allocs and
frees folded in `--emit text`, summary columns as wide as their widest cell, a bad
`--pipeline` before any output, a word on stderr when `-o` writes a file, did-you-mean
for a misspelled command, progress of a long `verify` on stderr only."""

from __future__ import annotations

import json
import os
import re

from click.testing import CliRunner

from nereus.cli import nereus, nereusc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCALE_UP = os.path.join(ROOT, "examples", "scale-up-8b.nir")
SMALL = os.path.join(ROOT, "examples", "embed-cpu.nir")


def test_emit_text_folds_the_empty_allocs_and_frees_of_a_round():
    """scale-up-8b's 16-GPU change listed 112 `alloc ... 0 B` lines (and 112 frees) before
    the first that allocates anything."""
    result = CliRunner().invoke(nereusc, [SCALE_UP, "--emit", "text"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line.endswith(" 0 B")]
    assert "  alloc     112 units of 0 B (kept in place: nothing to allocate), not listed" in lines
    assert "  free      112 units of 0 B (kept in place: nothing to free), not listed" in lines
    assert len(lines) < 360  # 578 with every empty one listed


def test_summary_columns_are_as_wide_as_their_widest_cell():
    from nereus.cli.compile import summary_text

    result = CliRunner().invoke(nereusc, [SCALE_UP, "--emit", "summary", "--json"])
    summary = json.loads(result.stdout)["transitions"][0]
    stages = list(summary["stages"].values())
    stages[0]["primitives"] = ["split(a)", "merge(b)", "destroy(c)", "extend(d)", "create(e)"]  # a long cell
    stages[0]["unchanged"] = False
    rows = [line for line in summary_text(summary).splitlines() if line.startswith("  ") and " alloc " in line]
    assert len(rows) > 1
    assert len({line.index(" alloc ") for line in rows}) == 1, "\n".join(rows)


def test_a_bad_pipeline_is_reported_before_any_output():
    result = CliRunner().invoke(nereusc, [SMALL, "--pipeline", "diff,dagg"])
    assert result.exit_code == 2
    assert result.stdout == "", result.stdout
    assert "unknown pass 'dagg'" in result.stderr and "did you mean 'dag'" in result.stderr


def test_writing_a_file_says_where_and_how_much_on_stderr(tmp_path):
    out = tmp_path / "p.json"
    result = CliRunner().invoke(nereusc, [SMALL, "--emit", "json", "--transition", "S1:S2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    size = out.stat().st_size
    from nereus.ir.units import human_bytes

    assert result.stderr == f"wrote {out} ({human_bytes(size)})\n"


def test_a_misspelled_command_gets_a_did_you_mean():
    result = CliRunner().invoke(nereusc, ["chek", SMALL])
    assert result.exit_code == 2
    assert "No such command 'chek'" in result.stderr and "Did you mean 'check'?" in result.stderr
    result = CliRunner().invoke(nereus, ["simulat", "x.json"])
    assert result.exit_code == 2 and "Did you mean 'simulate'?" in result.stderr
    # a file name is still a file name (`nereusc FILE` compiles it)
    result = CliRunner().invoke(nereusc, ["check.nir"])
    assert "Did you mean" not in result.output


def test_verify_reports_progress_on_stderr_once_it_runs_long(tmp_path):
    """A large program verified for 12-25 s in silence: after a few seconds (or on a
    terminal) stderr says how far it is; stdout stays the report (or the JSON object)."""
    from nereus.cli.progress import StderrProgress

    clock = iter([0.0, 1.0, 2.0, 3.2, 4.0, 6.0, 6.1]).__next__
    lines = []
    progress = StderrProgress("verify", after=3.0, every=2.0, clock=clock, echo=lines.append, tty=False)
    for done in range(1, 7):
        progress("round", done, 6)
    assert lines == ["  verify: round 3/6 (3 s)", "  verify: round 5/6 (6 s)", "  verify: round 6/6 (6 s)"]
    on_terminal = []
    progress = StderrProgress("verify", after=3.0, every=2.0, clock=iter([0.0, 0.1, 0.2]).__next__,
                              echo=on_terminal.append, tty=True)
    progress("round", 1, 2)
    progress("round", 2, 2)
    assert on_terminal == ["  verify: round 1/2 (0 s)", "  verify: round 2/2 (0 s)"]


def test_verify_calls_its_progress_once_per_round(tmp_path):
    from nereus.passes.verify import verify_program

    out = tmp_path / "p.json"
    assert CliRunner().invoke(nereusc, [SMALL, "--emit", "json", "--transition", "S1:S2", "-o", str(out)]).exit_code == 0
    program = json.loads(out.read_text())
    calls = []
    verify_program(program, progress=lambda phase, done, total: calls.append((phase, done, total)))
    rounds = len(program["rounds"])
    assert calls == [("round", k + 1, rounds) for k in range(rounds)]
    result = CliRunner().invoke(nereusc, ["verify", str(out), "--json"])
    assert json.loads(result.stdout)["ok"] is True and re.fullmatch(r"\{.*\}\n", result.stdout)
