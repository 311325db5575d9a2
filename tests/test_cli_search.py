"""`nereusc search`: the printed blocks are .nir that `nereusc check` accepts with the same
memory, --top/--gpus/--from/--json, and located errors with exit 2."""

import json
import pathlib
import re

import pytest
from click.testing import CliRunner

from nereus.cli import nereusc
from nereus.ir.units import human_bytes

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = ROOT / "tests" / "controller" / "small.nir"
PPO = ROOT / "examples" / "ppo-8b.nir"


def run(*args):
    return CliRunner().invoke(nereusc, [str(a) for a in args], catch_exceptions=False)


def test_printed_plans_paste_into_the_file_and_check_reports_the_same_memory(tmp_path):
    result = run("search", SMALL, "--top", "4")
    assert result.exit_code == 0, result.output
    names = re.findall(r"^plan (\w+) \{", result.stdout, re.M)
    assert names == ["best1", "best2", "best3", "best4"]
    pasted = tmp_path / "pasted.nir"
    pasted.write_text(SMALL.read_text() + "\n" + result.stdout)  # the whole output is .nir
    check = run("check", pasted, "--json")
    assert check.exit_code == 0, check.output
    reports = {r["plan"]: r for r in json.loads(check.stdout)["plans"]}
    times = [float(t) for t in re.findall(r"^# best\d: predicted ([\d.]+) s/step", result.stdout, re.M)]
    assert times == sorted(times) and len(times) == 4
    for name in names:
        report = reports[name]
        assert report["feasible"]
        shown = re.search(rf"^# worst GPU (\d+): (.+?) of (.+?) usable in (\w+)", result.stdout.split(f"plan {name} ")[0]
                          .rsplit(f"# {name}:", 1)[1], re.M)
        assert shown.group(2) == human_bytes(report["worst"]["bytes"]), name
        assert int(shown.group(1)) == report["worst"]["gpu"] and shown.group(4) == report["worst"]["stage"]


def test_json_is_one_object_whose_memory_is_the_check_figure(tmp_path):
    result = run("search", SMALL, "--top", "2", "--gpus", "4", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["gpus"] == 4 and len(out["plans"]) == 2 and out["from"] is None
    first = out["plans"][0]
    assert first["predicted_step_s"] == pytest.approx(sum(first["stage_seconds"].values()))
    assert set(first["stage_seconds"]) == {"generation", "inference", "training"}
    assert "on 0..3" in first["nir"]
    pasted = tmp_path / "p.nir"
    pasted.write_text(SMALL.read_text() + "\n" + "\n\n".join(p["nir"] for p in out["plans"]) + "\n")
    reports = {r["plan"]: r for r in json.loads(run("check", pasted, "--json").stdout)["plans"]}
    for plan in out["plans"]:
        assert reports[plan["name"]]["worst"]["bytes"] == plan["memory"]["used_bytes"]


def test_from_adds_the_compiled_transition_and_its_payback():
    out = json.loads(run("search", PPO, "--from", "S1", "--top", "2", "--json").stdout)
    assert out["from"]["plan"] == "S1" and out["from"]["fits"]
    for plan in out["plans"]:
        move = plan["transition"]
        assert move["how"] == "compiled" and move["seconds"] > 0
        gain = out["from"]["predicted_step_s"] - plan["predicted_step_s"]
        assert move["gain_s_per_step"] == pytest.approx(gain)
        if gain > 0:
            assert move["payback_steps"] >= 1
            assert (move["payback_steps"] - 1) * gain < move["seconds"] <= move["payback_steps"] * gain
    text = run("search", PPO, "--from", "S1", "--top", "1").stdout
    assert re.search(r"^# from S1: transition [\d.]+ s \(compiled\); saves [\d.]+ s/step: pays back in \d+ steps?$",
                     text, re.M), text


def test_from_a_plan_on_more_gpus_is_a_forced_move_and_says_why():
    out = json.loads(run("search", PPO, "--from", "S1", "--gpus", "8", "--top", "1", "--json").stdout)
    assert out["from"]["fits"] is False and out["from"]["why_not"] == "it uses GPUs beyond 0..7"
    assert out["plans"][0]["transition"]["payback_steps"] == 0
    assert out["plans"][0]["transition"]["gain_s_per_step"] is None


def test_more_gpus_than_the_cluster_adds_nodes_and_says_so():
    result = run("search", SMALL, "--gpus", "16", "--top", "1")
    assert result.exit_code == 0, result.output
    assert "on 0..15" in result.stdout and "set `nodes 4` to check these plans" in result.stdout


def test_names_do_not_clash_with_the_files_plans(tmp_path):
    path = tmp_path / "named.nir"
    path.write_text(SMALL.read_text().replace("plan S1 {", "plan best1 {"))
    result = run("search", path, "--top", "2")
    assert result.exit_code == 0, result.output
    assert re.findall(r"^plan (\w+) \{", result.stdout, re.M) == ["best_1", "best_2"]
    one = run("search", path, "--top", "1")
    assert re.findall(r"^plan (\w+) \{", one.stdout, re.M) == ["best_1"]


@pytest.mark.parametrize("args, where", [
    (["--gpus", "6"], "--gpus"),
    (["--gpus", "0"], "--gpus"),
    (["--top", "0"], "--top"),
    (["--from", "S7"], "--from"),
])
def test_bad_options_exit_2_naming_the_option(args, where):
    result = run("search", SMALL, *args)
    assert result.exit_code == 2 and where in result.output and "Traceback" not in result.output
    as_json = run("search", SMALL, *args, "--json")
    assert as_json.exit_code == 2


def test_nothing_fits_is_an_error_at_the_workload(tmp_path):
    path = tmp_path / "huge.nir"
    path.write_text(SMALL.read_text().replace("response 1024", "response 4000000"))
    result = run("search", path)
    assert result.exit_code == 2
    assert re.search(r"huge\.nir:\d+:\d+: error: no plan of the search space fits workload ppo", result.output)
    assert "hint:" in result.output and "--waves" in result.output
    as_json = run("search", path, "--json")
    assert as_json.exit_code == 2 and json.loads(as_json.stdout)["error"]["line"] is not None


def test_a_syntax_error_is_located(tmp_path):
    path = tmp_path / "bad.nir"
    path.write_text(SMALL.read_text().replace("batch 64", "batch 64 64"))
    result = run("search", path)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert re.search(r"bad\.nir:\d+:\d+: error", result.output), result.output


def test_waves_find_plans_the_check_refuses_and_say_so(tmp_path):
    """Generation in KV-cache waves: plans exist where none fits all sequences at once; each
    says that `nereusc check` refuses it (and it does)."""
    busy = ("--set", "workload.batch=2048", "--set", "workload.response=4096")
    assert run("search", SMALL, *busy).exit_code == 2
    result = run("search", SMALL, *busy, "--waves", "--top", "1")
    assert result.exit_code == 0, result.output
    assert re.search(r"# [\d.]+ s in \d+ waves$", result.stdout, re.M)
    assert "`nereusc check` sizes the KV cache" in result.stdout
    pasted = tmp_path / "waves.nir"
    pasted.write_text(SMALL.read_text().replace("batch 64 ", "batch 2048 ").replace("response 1024", "response 4096")
                      + "\n" + result.stdout)
    assert run("check", pasted, "--plan", "best1").exit_code == 2


def test_the_example_in_docs_cli_is_what_the_command_prints(monkeypatch):
    text = (ROOT / "docs" / "cli.md").read_text()
    block = re.search(r"```\n\$ nereusc search (.*?)\n(.*?)```", text, re.S)
    monkeypatch.chdir(ROOT)
    result = run("search", *block.group(1).split())
    assert result.exit_code == 0, result.output
    assert result.stdout == block.group(2)
