"""benchmarks/multi_gpu/run_all.sh on CPU (`--cpu 2`: gloo, tiny shapes): the scripts the
2-GPU figures of benchmarks/RESULTS.md come from run on this tree and check their own
results, so a lent GPU machine's call is not spent on a script that rotted. Also: every
method of a benchmark is reported cold and warm, timed the same way."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_run_all_on_two_cpu_ranks_passes_and_reports_cold_and_warm(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, BUDGET_S="400",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "multi_gpu", "run_all.sh"), "--cpu", "2"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["complete"] and last["passed"], done.stdout[-3000:]
    assert sorted(last["steps"]) == ["correctness_2", "dtensor_2", "failure_2", "reshard_2", "weight_sync_2"]
    folder = tmp_path / "multi_gpu"
    sync = json.loads((folder / "weight_sync_2.json").read_text())
    for case in sync["cases"]:
        for method in ("nereus", "gather_push", "bucketed"):
            assert case[f"{method}_cold_s"] > 0 and case[f"{method}_s"] > 0, (method, case)
        # nereus_s is the call barrier to barrier, as the baselines are timed: each call's time
        # holds its executor's (the slowest rank's of each), so the medians keep that order
        assert all(w > e for w, e in zip(case["nereus_times_s"], case["nereus_exec_times_s"])), case
        assert case["nereus_s"] > case["nereus_exec_s"], case
        assert case["nereus_cold_s"] > case["nereus_compile_s"] > 0, case  # the first call compiled the sync
        assert case["nereus_prepared_s"] > 0 and case["nereus_prepare_s"] > 0, case
    dtensor = json.loads((folder / "dtensor_2.json").read_text())
    assert dtensor["nereus_cold_s"] > 0 and dtensor["nereus_prepared_s"] > 0
    assert all(c["dtensor_cold_s"] > 0 and c["dtensor_s"] > 0 and c["nereus_s"] > 0 for c in dtensor["cases"].values())
    reshard = json.loads((folder / "reshard_2.json").read_text())
    assert all(c[f"{m}_cold_s"] > 0 and c[f"{m}_s"] > 0 for c in reshard["cases"] for m in ("nereus", "gather_scatter"))


def test_run_all_names_its_steps_and_refuses_an_unknown_one():
    script = os.path.join(ROOT, "benchmarks", "multi_gpu", "run_all.sh")
    shown = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "steps (--only): correctness,reshard,weight_sync,dtensor,failure" in shown.stdout
    refused = subprocess.run(["bash", script, "--cpu", "2", "--only", "reshard,sync"], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2
    assert refused.stdout.strip() == ("unknown step sync (steps: correctness,reshard,weight_sync,dtensor,failure; "
                                      "not run by default: offload,moe,variants)")
    assert "not run by default: offload,moe,variants" in shown.stdout


def test_the_steps_a_default_run_leaves_out_run_when_named(tmp_path):
    """offload_check.py, moe_reshard.py and variants.py (the second call of a 2-GPU session)
    through run_all.sh, checked and summarized like the default steps."""
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, BUDGET_S="300",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "multi_gpu", "run_all.sh"), "--cpu", "2", "--only",
                           "offload,moe,variants"], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["complete"] and last["passed"], done.stdout[-3000:]
    assert sorted(last["steps"]) == ["moe_2", "offload_2", "variants_2"]
    assert "offload_2: PASSED" in done.stdout and "moe_2: 2 x cpu" in done.stdout
    assert "variants_2: 2 x gloo" in done.stdout and "verified True" in done.stdout


def test_a_variant_that_was_not_verified_fails_the_summary(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "multi_gpu"))
    try:
        import summarize
    finally:
        sys.path.pop(0)
    good = {"name": "multi_gpu_variants", "verified": {"default": {"tp-dp": True}, "packed": {"tp-dp": True}}}
    bad = {"name": "multi_gpu_variants", "verified": {"default": {"tp-dp": True}, "packed": {"tp-dp": False}}}
    assert summarize._passed(good) and not summarize._passed(bad)
    assert summarize._passed({"passed": True, "verified": False}) and not summarize._passed({})


def _summarize():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "multi_gpu"))
    try:
        import summarize
    finally:
        sys.path.pop(0)
    return summarize


def test_the_summary_exits_1_unless_every_step_ran_and_passed(tmp_path, capsys):
    summarize = _summarize()
    (tmp_path / "failure_2.json").write_text(json.dumps({"name": "failure", "passed": True}))
    (tmp_path / "steps.txt").write_text("failure_2 rc=0, 3s\n")
    assert summarize.main([str(tmp_path)]) == 0
    (tmp_path / "steps.txt").write_text("failure_2 rc=0, 3s\ncorrectness_2 rc=1, 0s\n")  # a step that did not run
    assert summarize.main([str(tmp_path)]) == 1
    (tmp_path / "steps.txt").write_text("failure_2 rc=0, 3s\n")
    (tmp_path / "failure_2.json").write_text(json.dumps({"name": "failure", "passed": False}))
    assert summarize.main([str(tmp_path)]) == 1  # ran, and its check failed
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["complete"] and not last["passed"]


def test_the_failure_step_reads_no_error_report_of_an_earlier_run(tmp_path):
    """A `nereus train` that cannot start writes no error report; the step must not time
    the job's end from one an earlier run left in its run folder."""
    name = f"failure_stale_{os.getpid()}"
    stale = f"/tmp/nereus-{name}"
    os.makedirs(os.path.join(stale, "old"), exist_ok=True)
    with open(os.path.join(stale, "old", "error-rank1.json"), "w") as f:
        json.dump({"time": 1.0, "rank": 1}, f)
    with open(os.path.join(stale, "error-rank1.json"), "w") as f:
        json.dump({"time": 1.0, "rank": 1}, f)
    script = os.path.join(ROOT, "benchmarks", "multi_gpu", "run_all.sh")
    text = open(script).read()
    body = text[text.index("failure_step() {"):text.index("\n}\n", text.index("failure_step() {")) + 3]
    out = tmp_path / "out"
    out.mkdir()
    # a job that ends before it starts (an invalid setting): no error report of this run
    shell = f'PY={shlex.quote(sys.executable)}\nOUT_DIR={out}\nSTEPS={out}/steps.txt\nCPU_RANKS=2\n{body}\n' \
            f'failure_step {name} 2 30\n'
    env = dict(os.environ, NEREUS_FAILURE_TIMEOUT_S="soon",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    try:
        subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
        got = json.loads((out / f"{name}.json").read_text())
    finally:
        import shutil
        shutil.rmtree(stale, ignore_errors=True)
    assert got["seconds_after_failure"] is None and not got["passed"], got


def test_the_summary_judges_only_this_runs_steps(tmp_path, capsys):
    """run_all.sh starts steps.txt afresh but leaves an earlier run's JSON in the folder
    (a default run, then `--only offload` into the same OUT): that one is not this run's."""
    summarize = _summarize()
    (tmp_path / "failure_2.json").write_text(json.dumps({"name": "failure", "passed": True}))
    (tmp_path / "reshard_2.json").write_text(json.dumps({"name": "failure", "passed": False}))  # an earlier run's
    (tmp_path / "steps.txt").write_text("failure_2 rc=0, 3s\n")
    assert summarize.main([str(tmp_path)]) == 0
    assert "reshard_2" not in capsys.readouterr().out
