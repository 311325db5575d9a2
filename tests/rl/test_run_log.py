"""Rank 0's run log (nereus.rl.metrics) without processes: samples.jsonl and metrics.jsonl
lines per event, TensorBoard scalars, W&B offline, and on resume the records after the
checkpoint's step dropped so that each step appears once."""

import json
import os

import pytest

from nereus.ir.diagnostics import NereusError
from nereus.rl.metrics import RunLog, _wandb_mode


def _step(step, reward):
    return {"event": "step", "step": step, "plan": "S1", "loss": 0.5, "value_loss": 0.0, "reward": reward,
            "kl": 0.01, "rm_score": None, "seconds": 0.2, "response": 4, "stage_seconds": {"actor.generation": 0.1},
            "sync_bytes": 64, "response_length": 3.5, "reward_seconds": 0.001, "sync_seconds": 0.01}


def _feed(log, steps):
    for step in steps:
        log.event(_step(step, step / 10))
        log.event({"event": "samples", "step": step, "prompts": ["1+1="], "responses": ["2"], "rewards": [1.0]})
    log.event({"event": "transition", "after_step": steps[-1], "from": "S1", "to": "S2", "seconds": 0.1,
               "bytes": 1024, "runtime_seconds": 0.05, "compile_seconds": 0.01, "engine_seconds": 0.0})


def test_jsonl_files_and_resume_truncation(tmp_path):
    log = RunLog(str(tmp_path), ("jsonl",))
    _feed(log, [1, 2, 3])
    log.close()
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(m["event"], m["step"]) for m in lines] == [("step", 1), ("step", 2), ("step", 3), ("transition", 3)]
    assert lines[0]["train/reward"] == 0.1 and lines[0]["time/actor.generation"] == 0.1 and lines[0]["sync/bytes"] == 64
    assert lines[3]["transition/bytes"] == 1024
    assert [json.loads(line)["step"] for line in open(tmp_path / "samples.jsonl")] == [1, 2, 3]
    resumed = RunLog(str(tmp_path), ("jsonl",), resume_step=1)  # steps 2, 3 run again
    _feed(resumed, [2, 3])
    resumed.close()
    assert [json.loads(line)["step"] for line in open(tmp_path / "samples.jsonl")] == [1, 2, 3]
    assert [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")] == [1, 2, 3, 3]
    with pytest.raises(NereusError, match="unknown --logger 'csv'"):
        RunLog(str(tmp_path), ("csv",))


def test_tensorboard_scalars_purged_on_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLog(str(tmp_path), ("tensorboard",))
    _feed(log, [1, 2, 3])
    log.close()
    resumed = RunLog(str(tmp_path), ("tensorboard",), resume_step=1)
    log_steps = [2, 3]
    for step in log_steps:
        resumed.event(_step(step, 0.9))
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 2)) for e in events.Scalars("train/reward")] == [(1, 0.1), (2, 0.9), (3, 0.9)]


def test_wandb_offline_without_credentials(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    assert _wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = RunLog(str(tmp_path), ("wandb",), config={"steps": 2})
    _feed(log, [1, 2])
    log.close()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1 and os.path.isfile(tmp_path / "wandb-run-id")
