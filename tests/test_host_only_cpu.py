"""benchmarks/multi_gpu/host_only.py on the CPU (the harness of the one-GPU host figures in
benchmarks/RESULTS.md): its last stdout line is one JSON object with each direction's
first and second call and the medians of every pass; `--ab-replay` reports replays off
and on, `--moe` runs plans A and B of an expert-parallel case."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "benchmarks", "multi_gpu", "host_only.py")


def _run(*args: str, extra_env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, ".."), os.environ.get("PYTHONPATH", "")]),
               **(extra_env or {}))
    return subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--repeats", "2", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=os.path.dirname(SCRIPT))


@pytest.mark.parametrize("args, passes, directions", [
    (("--shape", "tiny", "--layers", "2", "--ab-replay"), ["replay-off", "replay-on"], ["tp-dp", "dp-tp"]),
    (("--shape", "tiny", "--layers", "1", "--moe", "gen-ep2-tp2"), ["plain"], ["a-b", "b-a"]),
])
def test_host_only_reports_every_pass_and_direction(args, passes, directions):
    done = _run(*args)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(result["cold"]) == sorted(f"{c} {d}" for c in ("cold", "second") for d in directions)
    for label in passes:
        assert sorted(result[label]) == sorted(directions)
        assert all(result[label][d]["call_s"] > 0 for d in directions)


def test_the_moe_host_shape_needs_a_moe_case():
    done = _run("--shape", "host")
    assert done.returncode == 2 and "--shape host is a MoE shape: give --moe CASE too" in done.stderr


def test_cold_phases_times_the_first_calls_phase_by_phase(tmp_path):
    script = os.path.join(os.path.dirname(SCRIPT), "cold_phases.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, ".."), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "phases.json"
    done = subprocess.run([sys.executable, script, str(out), "--", "--device", "cpu", "--repeats", "1", "--shape",
                           "tiny", "--layers", "1"], capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(SCRIPT))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["name"] == "multi_gpu_host_only"
    calls = json.loads(out.read_text())
    assert [c["target"] for c in calls] == ["DP", "TP"] * 3
    lowering = "nereus.runtime.distribute:obtain_rank_part"
    # the cold calls compile and prove; the second and warm ones only execute
    assert all(calls[i]["phases"][lowering][0] == 1 for i in (0, 1))
    assert all(lowering not in c["phases"] and c["phases"]["nereus.runtime.executor:execute"][0] == 1
               for c in calls[2:])
    # (phases are rounded to 0.1 ms)
    assert all(c["s"] + 1e-4 >= c["phases"]["nereus.runtime.runtime:Runtime._transition"][1] > 0 for c in calls)


@pytest.mark.parametrize("ahead", ["on", "off"])
def test_the_first_calls_say_whether_their_part_was_lowered_ahead(ahead, monkeypatch):
    monkeypatch.setenv("NEREUS_LOWER_AHEAD", ahead)
    done = _run("--shape", "tiny", "--layers", "1", "--moe", "gen-ep2-tp2", "--wait-ahead")
    assert done.returncode == 0, done.stderr[-2000:]
    details = json.loads(done.stdout.strip().splitlines()[-1])["cold_details"]
    # each first call was lowered while the harness waited; the second calls run cached programs
    assert details["cold a-b"]["lowered_ahead"] is details["cold b-a"]["lowered_ahead"] is (ahead == "on")
    assert not any(details[k]["lowered_ahead"] for k in ("second a-b", "second b-a"))


@pytest.mark.triton
def test_each_first_call_says_which_replays_it_ran():
    """A program's first execution builds no replay, its second builds and runs them (the
    kernels forced under the interpreter): what `cold_details` reports of each call."""
    done = _run("--shape", "tiny", "--layers", "1", "--moe", "train-ep2-tp2",
                extra_env={"NEREUS_PACK_BACKEND": "triton", "TRITON_INTERPRET": "1", "NEREUS_PACK_JIT": "eager"})
    assert done.returncode == 0, done.stderr[-2000:]
    details = json.loads(done.stdout.strip().splitlines()[-1])["cold_details"]
    for direction in ("a-b", "b-a"):
        first, second = details[f"cold {direction}"], details[f"second {direction}"]
        assert (first["replays_in_plan"], first["replays_used"]) == (0, 0), details
        assert second["replays_used"] == second["replays_in_plan"] > 0, details


@pytest.mark.triton
def test_each_fallback_says_which_kernel_variants_it_lacked():
    """Under the "prepared" JIT a call that meets a kernel variant not compiled yet takes
    the torch path: `cold_details` names the variants and the caller of each fallback."""
    done = _run("--shape", "tiny", "--layers", "1", "--moe", "train-ep2-tp2",
                extra_env={"NEREUS_PACK_BACKEND": "triton", "TRITON_INTERPRET": "1", "NEREUS_PACK_JIT": "prepared"})
    assert done.returncode == 0, done.stderr[-2000:]
    details = json.loads(done.stdout.strip().splitlines()[-1])["cold_details"]
    assert sum(d["fallbacks"] for d in details.values()) > 0, details
    for d in details.values():
        assert len(d["missing"]) == d["fallbacks"], details
        assert all(t > 0 for t in d["compiles_s"]), d
        for variants, caller, _ in d["missing"]:
            assert variants and all(v[0] in ("pack", "unpack", "copy") for v in variants), d["missing"]
            assert "@" in caller


def test_profile_cold_profiles_the_direction_asked_for(tmp_path):
    path = str(tmp_path / "cold.prof")
    done = _run("--shape", "tiny", "--layers", "1", "--moe", "train-ep2-tp2", "--profile-cold", path,
                "--profile-case", "b-a")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "cold.prof").exists() and (tmp_path / "cold.prof.second").exists()
    assert json.loads(done.stdout.strip().splitlines()[-1])["profiled"] == "b-a"
    wrong = _run("--shape", "tiny", "--layers", "1", "--moe", "train-ep2-tp2", "--profile-cold", path,
                 "--profile-case", "tp-dp")
    assert wrong.returncode != 0 and "--profile-case tp-dp: the directions here are a-b, b-a" in wrong.stderr


def test_lowering_cost_times_each_phase_of_a_ranged_lowering():
    """benchmarks/lowering_cost.py: one rank's lowering phase by phase in CPU seconds; a
    MoE part's pieces are ranges, each moving a slice of many tensors."""
    script = os.path.join(HERE, "..", "benchmarks", "lowering_cost.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, ".."), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, script, "--moe", "train-ep2-tp2", "--shape", "tiny", "--layers", "2",
                           "--repeats", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["name"] == "lowering_cost" and sorted(result["cases"]) == ["a-b", "b-a"]
    for case in result["cases"].values():
        assert sorted(case["median"]) == ["compile_s", "lower_s", "part_s", "plan_s", "replays_s"]
        assert all(t >= 0 for t in case["median"].values()) and case["median"]["lower_s"] > 0
        assert 0 < case["pieces"] < case["tensors_moved"]
