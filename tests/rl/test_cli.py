"""`nereus train` end to end: torchrun launch, --json last line, checkpoint, errors."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN = os.path.join(ROOT, "examples", "rl", "grpo-cpu.nir")


def _nereus(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))))
    return subprocess.run([sys.executable, "-c", "from nereus.cli import nereus; nereus()", "train", *args],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.multiprocess
def test_train_json_line_transitions_and_checkpoint(tmp_path):
    run = _nereus(PLAN, "--algo", "grpo", "--nproc", "2", "--steps", "3", "--events", "1:S2,2:S3",
                  "--out", str(tmp_path), "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["name"] == "train"
    assert [s["step"] for s in result["steps"]] == [1, 2, 3]
    assert all(set(s) >= {"step", "loss", "reward", "kl", "seconds"} for s in result["steps"])
    assert [(t["after_step"], t["to"]) for t in result["transitions"]] == [(1, "S2"), (2, "S3")]
    assert all(t["bytes"] > 0 for t in result["transitions"])
    assert len(result["final_weights_sha256"]) == 64
    # the final state as a sharded checkpoint (nereus.rl.checkpoint), each rank its own boxes
    assert os.path.exists(tmp_path / "checkpoints" / "step_3" / ".metadata")
    assert sorted(os.listdir(tmp_path / "checkpoints" / "step_3")) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                       "nereus.json"]


def test_bad_events_are_reported_without_traceback():
    run = _nereus(PLAN, "--steps", "3", "--events", "2:S9")
    assert run.returncode == 2
    assert "unknown plan 'S9'" in run.stderr and "Traceback" not in run.stderr
    run = _nereus(PLAN, "--steps", "3", "--events", "3:S2")
    assert run.returncode == 2 and "not a step boundary" in run.stderr


def _without(text: str, *lines: str) -> str:
    for line in lines:
        assert line in text, line
        text = text.replace(line, "")
    return text


def test_workload_errors_are_reported_before_any_process_starts(tmp_path):
    # The workers would refuse these; the launcher finds them first (no torchrun, located).
    with open(PLAN) as f:
        text = f.read()
    no_critic = tmp_path / "no-critic.nir"
    no_critic.write_text(text)
    run = _nereus(str(no_critic), "--algo", "ppo", "--steps", "2", "--out", str(tmp_path / "a"))
    assert run.returncode == 2, run.stdout + run.stderr
    assert "lacks critic.training, which ppo needs" in run.stderr and "no-critic.nir:" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "a").exists()
    run = _nereus(PLAN, "--algo", "grpo", "--group", "3", "--steps", "2", "--out", str(tmp_path / "b"))
    assert run.returncode == 2 and "batch 32 must divide into 2 minibatches of whole groups of 3" in run.stderr
    assert "grpo-cpu.nir:" in run.stderr and not (tmp_path / "b").exists()
    # batch 16 suits the microbatch (8) but not 2 minibatches of whole groups of 16
    run = _nereus(PLAN, "--algo", "grpo", "--group", "16", "--steps", "3", "--drift", "1:batch=16",
                  "--out", str(tmp_path / "c"))
    assert run.returncode == 2 and "batch 16 must divide" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "c").exists()


@pytest.mark.multiprocess
@pytest.mark.multiprocess
def test_progress_lines_when_stderr_is_no_terminal(tmp_path):
    """Rich draws no bar into a pipe or a log file: plain lines say the run is alive (stderr
    was empty until the end)."""
    run = _nereus(PLAN, "--algo", "grpo", "--nproc", "2", "--steps", "2", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "starting the processes" in run.stderr
    assert "step 1/2 [S1] reward" in run.stderr and "step 2/2 [S1] reward" in run.stderr


def test_grpo_without_a_reward_model_trains_on_the_task_rule(tmp_path):
    with open(PLAN) as f:
        text = _without(f.read(), "inference:  ref, reward", "  reward.inference  dp 1 tp 2  on 0, 1\n")
    text = text.replace("workload grpo {", "workload grpo {\n  inference: ref")
    plan = tmp_path / "rule.nir"
    plan.write_text(text)
    run = _nereus(str(plan), "--algo", "grpo", "--nproc", "2", "--steps", "2", "--events", "1:S2",
                  "--out", str(tmp_path / "run"), "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert [s["rm_score"] for s in result["steps"]] == [None, None]
    assert all(0.0 <= s["reward"] <= 1.0 for s in result["steps"])


@pytest.mark.parametrize("args, message", [
    (["--algo", "grpo", "--group", "1"], "--group 1: GRPO needs at least 2 responses per prompt"),
    (["--lr", "nan"], "--lr nan: must be a finite number ≥ 0"),
    (["--lr", "-1"], "--lr -1.0: must be a finite number ≥ 0"),
    (["--nproc", "0"], "--nproc 0: must be at least 1"),
    (["--out", ""], "--out is empty"),
    (["--backend", "nccl"], "--backend nccl needs a CUDA device per process"),
    (["--steps", "1", "--events", "1:S2"], "a 1-step run has no step boundary: use --steps 2 or more"),
    (["--steps", "3", "--events", "\u00b2:S2"], "--events: cannot read '\u00b2:S2'"),
    (["--steps", "3", "--drift", "1:respons=8"], "--drift '1:respons=8': unknown key 'workload.respons'"),
    (["--steps", "4", "--drift", "2:microbatch=1,2:batch=4"],
     "error: after --drift 2:batch=4: batch 4 must divide into 2 minibatches of whole groups of 4"),
    (["--steps", "4", "--drift", "2:batch=4"], "error: --drift '2:batch=4': microbatch 8 is larger than batch 4\n"),
    (["--steps", "4", "--drift", "3:foo=1"], "keys: workload.batch, workload.prompt, workload.response, "
     "workload.microbatch, workload.recompute\n"),
    (["--steps", "6", "--events", "2:S2,4:S2"], "--events 4:S2: S2 is already the plan running after step 4"),
    (["--steps", "6", "--events", "2:S1"], "--events 2:S1: S1 is already the plan running after step 2"),
    (["--steps", "4", "--drift", "2:gpus_per_node=4"], "--drift '2:gpus_per_node=4': unknown key "
     "'workload.gpus_per_node'\nhint: keys: workload.batch"),
    (["--steps", "3", "--drift", "1:cluster.reserve=10%"],
     "--drift '1:cluster.reserve=10%': only workload keys drift, not cluster keys"),
])
def test_options_are_checked_before_any_process_starts(args, message):
    run = _nereus(PLAN, "--algo", "grpo", *args) if "--algo" not in args else _nereus(PLAN, *args)
    if args[:2] == ["--backend", "nccl"] and "CUDA device" not in run.stderr and run.returncode == 0:
        pytest.skip("this machine has a CUDA device per process")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert message in run.stderr, run.stderr


def test_a_file_without_plans_is_an_error(tmp_path):
    text = open(PLAN).read()
    path = tmp_path / "noplans.nir"
    path.write_text(text[:text.index("plan ")])
    run = _nereus(str(path), "--algo", "grpo", "--steps", "2")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "declares no plan" in run.stderr


def test_changes_after_one_step_all_apply_in_order():
    from nereus.cli.train import parse_drift
    import nereus.ir as ir

    module = ir.parse_file(PLAN)
    assert parse_drift("2:response=8,1:batch=16,2:response=10", module, 4) == \
        [(1, "workload.batch=16"), (2, "workload.response=8"), (2, "workload.response=10")]


def test_plans_that_do_not_fit_are_refused_unless_allowed():
    """A plan `nereusc check` refuses was only warned about, and the run died at the first
    transition: an error at the plan's line now, also for one a --drift makes stop
    fitting; --allow-infeasible makes them warnings again (a CPU run's memory is not the
    declared cluster's)."""
    import nereus.ir as ir
    from nereus.cli.train import unfit_plans

    module = ir.parse_file(PLAN)
    assert unfit_plans(module, []) == []
    tight = ir.apply_overrides(module, ["cluster.gpu.mem=2MB"])
    errors = unfit_plans(tight, [])
    assert errors and all("does not fit" in e.message and e.loc.line > 1 for e in errors)
    drifted = unfit_plans(module, [(2, "workload.response=100000")])
    assert drifted and drifted[0].message.startswith("after step 2 (workload.response=100000): plan ")
    run = _nereus(PLAN, "--algo", "grpo", "--steps", "2", "--set", "cluster.gpu.mem=2MB")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "grpo-cpu.nir:" in run.stderr and "does not fit" in run.stderr and "--allow-infeasible" in run.stderr


def test_more_processes_than_the_plans_gpus_are_refused():
    """`--nproc 64` on a 2-GPU cluster started 64 ranks (251 s) that held nothing."""
    run = _nereus(PLAN, "--algo", "grpo", "--steps", "2", "--nproc", "64")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "grpo-cpu.nir:7:9: error: --nproc 64: cluster cpu has 2 GPUs" in run.stderr, run.stderr
    run = _nereus(PLAN, "--algo", "grpo", "--steps", "2", "--nproc", "3", "--set", "cluster.gpus_per_node=4")
    assert run.returncode == 2 and "--nproc 3: the plans use GPUs 0..1" in run.stderr, run.stderr


def test_more_cpu_processes_than_the_machine_runs_are_refused():
    from nereus.cli.train import check_cpu_processes
    from nereus.ir.diagnostics import NereusError

    check_cpu_processes(8, cores=2)
    with pytest.raises(NereusError, match=r"--nproc 9: 9 CPU processes on 2 cores") as error:
        check_cpu_processes(9, cores=2)
    assert "own torch" in str(error.value)


def test_a_gpu_scale_plan_is_refused_on_cpu_processes():
    """`nereus train examples/ppo-8b.nir` on a CPU box started 64 ranks of an 8B model until
    the OOM killer ended them: refused before launch, naming what it needs."""
    import nereus.ir as ir
    from nereus.cli.train import check_host_memory
    from nereus.ir.diagnostics import NereusError

    big = ir.parse_file(os.path.join(ROOT, "examples", "ppo-8b.nir"))
    with pytest.raises(NereusError, match=r"plan S1 on CPU processes needs .* TiB of this machine's memory "
                                          r"\(its 64 ranks together\), and 16.0 GiB is available"):
        check_host_memory(big, "S1", available=16 << 30)
    small = ir.parse_file(PLAN)
    check_host_memory(small, "S1", available=16 << 30)


@pytest.mark.parametrize("asked, nproc, devices, backend, noted", [
    ("auto", 2, 0, "gloo", False),   # no GPU: CPU processes, as always
    ("auto", 2, 2, "nccl", False),   # a GPU per process
    ("auto", 1, 8, "nccl", False),
    ("auto", 2, 1, "gloo", True),    # too few GPUs: CPU, and said so (NCCL's rank 1 had no device)
    ("gloo", 2, 8, "gloo", False),
    ("nccl", 2, 2, "nccl", False),
])
def test_auto_backend_is_nccl_only_with_a_gpu_per_process(asked, nproc, devices, backend, noted):
    """On a 1-GPU host `nereus train plan.nir --nproc 2` picked NCCL (CUDA was available),
    rank 1 found no cuda:1 and the launcher's dump was all the user saw."""
    from nereus.cli.train import resolve_backend

    got, note = resolve_backend(asked, nproc, devices)
    assert got == backend and bool(note) == noted
    if noted:
        assert note == f"{nproc} processes and {devices} CUDA device: running on CPU with gloo (NCCL needs a GPU per process)"


def test_nccl_without_a_gpu_per_process_is_refused():
    from nereus.cli.train import resolve_backend
    from nereus.ir.diagnostics import NereusError

    with pytest.raises(NereusError, match=r"--backend nccl needs a CUDA device per process: 2 processes, 1 device"):
        resolve_backend("nccl", 2, 1)


def test_an_engine_restart_is_counted_apart_from_the_transition():
    """A vLLM engine restart after a plan change was counted as transition time (95.67% of
    the run); the summary and the table keep it apart."""
    from nereus.rl.report import summary

    result = {"steps": [{"step": 1, "seconds": 2.0, "reward": 0.1}, {"step": 2, "seconds": 2.0, "reward": 0.2}],
              "transitions": [{"after_step": 1, "seconds": 0.5, "engine_seconds": 95.5, "bytes": 10}],
              "run_seconds": 100.0}
    s = summary(result)
    assert s["transition_seconds"] == 0.5 and s["engine_restart_seconds"] == 95.5
    assert s["transition_share"] == 0.005 and s["engine_restart_share"] == 0.955
    assert summary({**result, "run_seconds": None})["run_seconds"] == 100.0  # steps + transition + restart


def test_the_run_table_shows_engine_restarts_only_where_there_were_some(capsys):
    from nereus.cli.train import _print_summary

    result = {"steps": [{"step": 1, "seconds": 2.0, "reward": 0.1}],
              "transitions": [{"after_step": 1, "seconds": 0.5, "engine_seconds": 95.5, "bytes": 10}],
              "run_seconds": 100.0}
    _print_summary({"run": result}, None, "out", 100.0, quiet=False)
    table = capsys.readouterr().out
    assert "engine restarts" in table and "95.500 s" in table and "0.50%" in table
    _print_summary({"run": {**result, "transitions": [{"after_step": 1, "seconds": 0.5, "bytes": 10}]}}, None, "out",
                   100.0, quiet=False)
    assert "engine restarts" not in capsys.readouterr().out
