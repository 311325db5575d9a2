"""nereusc compile / verify end to end on a small .nir file (parser, passes, backends)."""

import json
import shutil
import subprocess

import pytest
from click.testing import CliRunner

from nereus.cli import nereusc

SOURCE = """
cluster small {
  nodes 2
  gpus_per_node 4
  gpu { mem 1GB  flops 100TFLOPS  hbm 1TB/s }
  intra 100GB/s
  inter 10GB/s
  host_mem 16GB
}
model actor  = llama { layers 4 hidden 64 heads 8 kv_heads 2 ffn 128 vocab 256 }
model critic = llama { layers 4 hidden 64 heads 8 kv_heads 2 ffn 128 vocab 256 head value }
workload ppo {
  batch 8  prompt 16  response 16  microbatch 1
  generation: actor
  training:   actor, critic
}
plan A {
  actor.generation  dp 2 tp 4       on 0..7
  actor.training    dp 2 tp 2 pp 2  on 0..7
  critic.training   dp 1 tp 2 pp 2  on 4..7
}
plan B = A {
  actor.generation  dp 4 tp 2       on 7, 6, 5, 4, 3, 2, 1, 0
  critic.training   dp 2 tp 2       on 0..3
}
transition A -> B
transition B -> A
"""


@pytest.fixture()
def nir(tmp_path):
    path = tmp_path / "small.nir"
    path.write_text(SOURCE)
    return path


def test_default_checks_plans_and_summarises_every_transition(nir):
    result = CliRunner().invoke(nereusc, [str(nir)])
    assert result.exit_code == 0, result.output
    assert "transition A -> B" in result.output and "transition B -> A" in result.output
    assert "critic.training" in result.output and "lower bound" in result.output


def test_emit_json_then_verify(nir, tmp_path):
    out = tmp_path / "p.json"
    runner = CliRunner()
    result = runner.invoke(nereusc, [str(nir), "--transition", "A->B", "--emit", "json", "-o", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["format"] == "nereus-program" and data["transition"] == {"from": "A", "to": "B"}
    ok = runner.invoke(nereusc, ["verify", str(out)])
    assert ok.exit_code == 0 and "ok:" in ok.output
    data["rounds"][0]["ops"][0]["bytes"] += 1
    out.write_text(json.dumps(data))
    bad = runner.invoke(nereusc, ["verify", str(out)])
    assert bad.exit_code == 2 and "round 0, op 0 (alloc)" in bad.output


def test_emit_needs_one_transition(nir):
    result = CliRunner().invoke(nereusc, [str(nir), "--emit", "json"])
    assert result.exit_code == 2 and "--transition" in result.output


def test_emit_text_and_summary_json(nir):
    runner = CliRunner()
    text = runner.invoke(nereusc, [str(nir), "--transition", "A->B", "--emit", "text"])
    assert text.exit_code == 0 and text.output.startswith("transition A -> B") and "round 0" in text.output
    summary = runner.invoke(nereusc, [str(nir), "--emit", "summary", "--json"])
    data = json.loads(summary.output)
    assert [t["transition"] for t in data["transitions"]] == ["A -> B", "B -> A"]


def test_time_passes_and_pipeline(nir):
    result = CliRunner().invoke(nereusc, [str(nir), "--transition", "A->B", "--emit", "summary", "--time-passes",
                                          "--print-after-all", "--pipeline", "diff,dag,resources,fusion{bucket=1MiB},lower,cost"])
    assert result.exit_code == 0, result.output
    assert "time A -> B: diff" in result.output and "after fusion:" in result.output


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz not installed")
def test_emit_dot_renders(nir, tmp_path):
    result = CliRunner().invoke(nereusc, [str(nir), "--transition", "A->B", "--emit", "dot"])
    assert result.exit_code == 0 and result.output.startswith("digraph")
    svg = subprocess.run(["dot", "-Tsvg"], input=result.output, capture_output=True, text=True, check=True)
    assert "<svg" in svg.stdout


def test_emit_dag_lists_records_in_stable_order(nir):
    runner = CliRunner()
    first = runner.invoke(nereusc, [str(nir), "--transition", "A->B", "--emit", "dag"])
    second = runner.invoke(nereusc, [str(nir), "--transition", "A->B", "--emit", "dag"])
    assert first.exit_code == 0, first.output
    assert first.output == second.output and first.output.startswith("dag A -> B")
    assert "actor.generation: dp 2 tp 4 pp 1 on 0..7 -> dp 4 tp 2 pp 1 on 7, 6, 5, 4, 3, 2, 1, 0" in first.output


def test_the_dag_header_shows_what_moves(tmp_path):
    """A swap of GPUs printed `dp 1 tp 1 pp 1 -> dp 1 tp 1 pp 1`, a zero or offload change
    nothing: the header names the GPUs, zero and offload."""
    import pathlib

    swap = pathlib.Path(__file__).parents[1] / "data" / "swap-staging.nir"
    result = CliRunner().invoke(nereusc, [str(swap), "--transition", "A->B", "--emit", "dag"])
    assert result.exit_code == 0, result.output
    assert "actor.training: dp 1 tp 1 pp 1 on 0 -> dp 1 tp 1 pp 1 on 1" in result.output
    text = swap.read_text().replace("actor.training dp 1 on 1\n  critic", "actor.training dp 1 on 0  zero 1\n  critic")
    text = text.replace("critic.training dp 1 on 0\n}", "critic.training dp 1 on 1  offload\n}", 1)
    (tmp_path / "z.nir").write_text(text)
    result = CliRunner().invoke(nereusc, [str(tmp_path / "z.nir"), "--transition", "A->B", "--emit", "dag"])
    assert result.exit_code == 0, result.output
    assert "actor.training: dp 1 tp 1 pp 1 on 0 -> dp 1 tp 1 pp 1 on 0 zero 1" in result.output
    assert "critic.training: dp 1 tp 1 pp 1 on 1 -> dp 1 tp 1 pp 1 on 1 offload" in result.output


TIGHT = """
cluster c { nodes 2 gpus_per_node 4 gpu { mem 3.2GB flops 300TFLOPS hbm 2TB/s } intra 300GB/s inter 25GB/s host_mem 64GB }
model actor = llama { layers 8 hidden 1024 heads 16 kv_heads 2 ffn 4096 vocab 32000 }
workload w { batch 8 prompt 16 response 16 microbatch 1 recompute full training: actor }
plan A { actor.training dp 8 on 0..7 }
plan B { actor.training dp 1 tp 8 on 7..0 }
"""


def test_a_pipeline_without_resources_does_not_emit_a_program_that_cannot_run(tmp_path):
    """Without the `resources` pass nothing schedules the transition within memory: a
    program past the GPUs' usable memory is an error (exit 2), and no file is written."""
    path = tmp_path / "tight.nir"
    path.write_text(TIGHT)
    out = tmp_path / "x.json"
    runner = CliRunner()
    done = runner.invoke(nereusc, [str(path), "--transition", "B:A", "--pipeline", "diff,dag,lower",
                                   "--emit", "json", "-o", str(out)])
    assert done.exit_code == 2 and not out.exists()
    assert "error: transition B -> A needs 6.9 GiB on GPU 0 in round 0, 232.5% of its usable memory" in done.output
    shown = runner.invoke(nereusc, [str(path), "--transition", "B:A", "--pipeline", "diff,dag,lower"])
    assert shown.exit_code == 2 and "peak memory 6.9 GiB of 3.0 GiB usable" in shown.output
    fine = runner.invoke(nereusc, [str(path), "--transition", "B:A", "--emit", "json", "-o", str(out)])
    assert fine.exit_code == 0 and out.exists()


def test_a_transition_from_a_plan_to_itself_is_an_error(tmp_path):
    """As `transition A -> A` in a file (it compiled an empty program, exit 0)."""
    path = tmp_path / "t.nir"
    path.write_text(TIGHT)
    done = CliRunner().invoke(nereusc, [str(path), "--transition", "A:A", "--emit", "json"])
    assert done.exit_code == 2
    assert "error: --transition from plan A to itself" in done.output


@pytest.mark.parametrize("command", [["check"], [], ["verify"]])
def test_a_folder_given_as_the_file_is_a_json_error_with_json(tmp_path, command):
    """`--json` promises one JSON object on stdout for every error, a folder too."""
    folder = tmp_path / "plans.nir"
    folder.mkdir()
    done = CliRunner().invoke(nereusc, [*command, str(folder), "--json"])
    assert done.exit_code == 2
    error = json.loads(done.stdout)["error"]
    assert (error["file"], error["type"], error["message"]) == (str(folder), "IsADirectoryError", "Is a directory")


@pytest.mark.parametrize("pipeline, emit, stage", [
    ("diff", ["--emit", "text"], "lower"),
    ("diff", ["--emit", "dot"], "lower"),
    ("diff", ["--emit", "json"], "lower"),
    ("diff,dag", ["--emit", "json", "--rank", "0"], "lower"),
    ("diff", ["--emit", "dag"], "dag"),
])
def test_an_emit_level_the_pipeline_stops_before_is_an_error(nir, pipeline, emit, stage):
    """Every emit level needs its IR: asking for one past the last pass of --pipeline is
    the user's error (exit 2, JSON with --json), never a traceback."""
    runner = CliRunner()
    for extra in ([], ["--json"]):
        result = runner.invoke(nereusc, [str(nir), "--transition", "A:B", "--pipeline", pipeline, *emit, *extra])
        assert result.exit_code == 2, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
        message = f"the pipeline stopped before '{stage}'"
        if extra:
            assert json.loads(result.stdout)["error"]["message"].startswith(message)
        else:
            assert message in result.output
