"""Crash tests of `nereus train --resume` (2 gloo processes, a 2-layer model, 4 GRPO steps,
a plan change after step 2, a checkpoint after every step): rank 1 is SIGKILLed (a)
inside step 3, (b) inside the transition after step 2, (c) while step 3's checkpoint is
written (NEREUS_KILL, nereus.rl.faults). Each time the job ends as a failure naming the
killed rank, the latest complete checkpoint is the one before the kill, and `--resume`
finishes the run with the final weights (sha256) of a run never killed. Resumed in
another plan on one process, the state read equals the checkpoint's, byte for byte."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.multiprocess

NIR = """
cluster cpu { nodes 1 gpus_per_node 2 gpu { mem 1GB flops 1TFLOPS hbm 100GB/s } intra 10GB/s inter 1GB/s host_mem 16GB }
model actor = llama { layers 2 hidden 32 heads 4 kv_heads 2 ffn 64 vocab 16 dtype fp32 }
model ref = actor
workload grpo { batch 8 prompt 4 response 3 microbatch 4  generation: actor  inference: ref  training: actor }
plan S1 { actor.generation dp 1 tp 2 on 0, 1  ref.inference dp 2 on 0, 1  actor.training dp 2 on 0, 1 }
plan S2 = S1 { actor.generation dp 2 on 0, 1  actor.training dp 1 tp 2 on 0, 1 }
plan S0 { actor.generation dp 1 on 0  ref.inference dp 1 on 0  actor.training dp 1 on 0 }
transition S1 -> S2
"""


def _nereus(*args, kill=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))),
               NEREUS_FAILURE_TIMEOUT_S="30")
    if kill:
        env["NEREUS_KILL"] = kill
    return subprocess.run([sys.executable, "-c", "from nereus.cli import nereus; nereus()", "train", *args, "--json"],
                          capture_output=True, text=True, env=env, timeout=400)


def _last(run) -> dict:
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("crash") / "tiny.nir"
    path.write_text(NIR)
    return path


def _train(plan, out, kill=None):
    return _nereus(str(plan), "--algo", "grpo", "--nproc", "2", "--steps", "4", "--events", "2:S2", "--save-every", "1",
                   "--keep", "5", "--lr", "1e-2", "--out", str(out), kill=kill)


@pytest.fixture(scope="module")
def never_killed(plan, tmp_path_factory):
    run = _train(plan, tmp_path_factory.mktemp("crash") / "whole")
    assert run.returncode == 0, run.stdout + run.stderr
    return _last(run)


@pytest.mark.parametrize("kill, saved", [("1:step:3", 2), ("1:transition:2", 1), ("1:save:3", 2)])
def test_a_killed_rank_loses_only_the_steps_since_the_last_checkpoint(plan, never_killed, tmp_path, kill, saved):
    from nereus.rl.checkpoint import complete_steps

    out = tmp_path / "out"
    killed = _train(plan, out, kill=kill)
    assert killed.returncode == 2, killed.stdout + killed.stderr
    error = _last(killed)["error"]
    assert error["rank"] == 1 and "signal 9" in error["message"], error
    assert complete_steps(str(out)) == list(range(1, saved + 1))
    if kill.endswith("save:3"):  # the save in flight left a partial folder, which does not count
        assert any(name.startswith(".step_3.") for name in os.listdir(out / "checkpoints"))
    resumed = _nereus("--resume", str(out))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    result = _last(resumed)
    assert [s["step"] for s in result["steps"]] == list(range(saved + 1, 5))
    assert result["final_weights_sha256"] == never_killed["final_weights_sha256"]
    assert [s["reward"] for s in result["steps"]] == [s["reward"] for s in never_killed["steps"][saved:]]
    if kill.endswith("save:3"):
        assert not any(name.endswith(".partial") for name in os.listdir(out / "checkpoints"))
        # another plan, one process: the state gathered is the checkpoint's, byte for byte
        import torch

        from nereus.rl.checkpoint import step_dir
        from nereus.rl.checkpoint_read import read_full, stored_tensors

        other = _nereus("--resume", str(out), "--plan", "S0", "--nproc", "1", "--steps", "4", "--out", str(out))
        assert other.returncode == 0, other.stdout + other.stderr
        assert _last(other)["steps"] == [] and _last(other)["resumed"]["step"] == 4
        gathered = torch.load(out / "run" / "final_state.pt")
        path = step_dir(str(out), 4)
        names = [n for n in stored_tensors(path) if n.startswith("actor.training/")]
        saved_state, count = read_full(path, names)
        for name in names:
            assert torch.equal(gathered[name.split("/", 1)[1]], saved_state[name]), name
        assert _last(other)["final_weights_sha256"] == never_killed["final_weights_sha256"]
