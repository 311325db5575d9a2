"""Rank 0's record of a run: generated samples and metrics (`--logger`, `--samples-every`).

Input: the trainer's events (the dicts nereus.rl.worker receives: step, samples,
transition, drift, decision, checkpoint, resume) and the output folder. Output:
  OUT/samples.jsonl       {"step", "prompt", "response", "reward"} per sample
  OUT/metrics.jsonl       (logger jsonl) one line per event, its scalars as they came
  OUT/tensorboard/        (logger tensorboard) scalars under train/, time/, transition/,
                          checkpoint/, controller decisions as text
  OUT/wandb/              (logger wandb) the same scalars; offline unless WANDB_MODE says
                          otherwise or a W&B API key is set (WANDB_API_KEY or ~/.netrc)
Only the loggers asked for are imported. On resume (`resume_step`) the records of steps
after the checkpoint, which the crashed run wrote and the resumed run writes again, are
dropped from the JSONL files and TensorBoard purges them (`purge_step`), so every step
appears once.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Optional

from nereus.ir.diagnostics import NereusError

LOGGERS = ("jsonl", "tensorboard", "wandb")


def step_scalars(event: dict) -> dict:
    """The scalars of a step event, by metric name."""
    out = {f"train/{k}": event[k] for k in ("reward", "kl", "loss", "value_loss", "response_length")
           if isinstance(event.get(k), (int, float))}
    if isinstance(event.get("rm_score"), (int, float)):
        out["train/rm_score"] = event["rm_score"]
    out["time/step_seconds"] = event.get("seconds", 0.0)
    out["time/reward_seconds"] = event.get("reward_seconds", 0.0)
    for stage, seconds in (event.get("stage_seconds") or {}).items():
        out[f"time/{stage}"] = seconds
    out["sync/bytes"] = event.get("sync_bytes", 0)
    out["sync/seconds"] = event.get("sync_seconds", 0.0)
    return out


def transition_scalars(event: dict) -> dict:
    return {f"transition/{k}": event[k] for k in ("seconds", "bytes", "runtime_seconds", "compile_seconds",
                                                  "engine_seconds") if isinstance(event.get(k), (int, float))}


def checkpoint_scalars(event: dict) -> dict:
    return {f"checkpoint/{k}": event[k] for k in ("stall_seconds", "write_seconds", "write_cpu_seconds", "bytes")
            if isinstance(event.get(k), (int, float))}


def _truncate_jsonl(path: str, after_step: int) -> None:
    """Drop the lines of steps after `after_step` (a resumed run writes them again)."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                step = json.loads(line).get("step")
            except (json.JSONDecodeError, AttributeError):
                continue  # a line cut by the crash
            if not isinstance(step, int) or step <= after_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w", encoding="utf-8") as handle:
        handle.writelines(kept)
    os.replace(path + ".tmp", path)


def _wandb_mode() -> str:
    """offline unless the user set WANDB_MODE or has a W&B key (this machine may have no
    network, and a run must not wait on one)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = os.path.expanduser("~/.netrc")
    try:
        with open(netrc, encoding="utf-8") as handle:
            if "api.wandb.ai" in handle.read():
                return "online"
    except OSError:
        pass
    return "offline"


class RunLog:
    """Writes the events of rank 0 (module docstring); `event(e)` for each, `close()` at the end."""

    def __init__(self, out: str, loggers=("jsonl",), config: Optional[dict] = None, resume_step: Optional[int] = None,
                 name: str = "run"):
        unknown = [n for n in loggers if n not in LOGGERS]
        if unknown:
            raise NereusError(f"unknown --logger {unknown[0]!r}", hint=f"loggers: {', '.join(LOGGERS)}")
        os.makedirs(out, exist_ok=True)
        self.out, self.loggers = out, tuple(loggers)
        self.samples_path = os.path.join(out, "samples.jsonl")
        self.metrics_path = os.path.join(out, "metrics.jsonl") if "jsonl" in loggers else None
        if resume_step is not None:
            _truncate_jsonl(self.samples_path, resume_step)
            if self.metrics_path:
                _truncate_jsonl(self.metrics_path, resume_step)
        else:  # a fresh run starts its files
            for path in (self.samples_path, self.metrics_path):
                if path and os.path.exists(path):
                    os.remove(path)
        self._samples = open(self.samples_path, "a", encoding="utf-8")
        self._metrics = open(self.metrics_path, "a", encoding="utf-8") if self.metrics_path else None
        self._tb = self._wandb = None
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise NereusError("--logger tensorboard needs the tensorboard package",
                                  hint="pip install 'nereus[rl]' (or tensorboard)") from None
            purge = resume_step + 1 if resume_step is not None else None
            self._tb = SummaryWriter(os.path.join(out, "tensorboard"), purge_step=purge)
        if "wandb" in loggers:
            self._wandb = self._start_wandb(config or {}, name, resume_step is not None)
        self._step = 0

    def _start_wandb(self, config: dict, name: str, resume: bool):
        try:
            import wandb
        except ImportError:
            raise NereusError("--logger wandb needs the wandb package", hint="pip install wandb") from None
        id_path = os.path.join(self.out, "wandb-run-id")
        if resume and os.path.isfile(id_path):
            with open(id_path) as handle:
                run_id = handle.read().strip()
        else:
            run_id = uuid.uuid4().hex[:8]  # W&B's run id form (wandb.util.generate_id is gone in 0.31)
            with open(id_path, "w") as handle:
                handle.write(run_id)
        return wandb.init(project=os.environ.get("WANDB_PROJECT", "nereus"), name=name, id=run_id,
                          dir=self.out, config=config, mode=_wandb_mode(), resume="allow")

    def _write(self, kind: str, step: int, scalars: dict, extra: Optional[dict] = None) -> None:
        if self._metrics is not None:
            self._metrics.write(json.dumps({"event": kind, "step": step, "time": time.time(), **scalars,
                                            **(extra or {})}) + "\n")
            self._metrics.flush()
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None and scalars:
            self._wandb.log(scalars, step=step)

    def event(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "samples":
            for prompt, response, reward in zip(event["prompts"], event["responses"], event["rewards"]):
                self._samples.write(json.dumps({"step": event["step"], "prompt": prompt, "response": response,
                                                "reward": reward}) + "\n")
            self._samples.flush()
        elif kind == "step":
            self._step = event["step"]
            self._write("step", event["step"], step_scalars(event), {"plan": event.get("plan")})
        elif kind == "transition":
            self._write("transition", event["after_step"], transition_scalars(event),
                        {"from": event.get("from"), "to": event.get("to")})
        elif kind == "checkpoint":
            self._write("checkpoint", event["step"], checkpoint_scalars(event), {"path": event.get("path")})
        elif kind == "decision":
            record = {k: v for k, v in event.items() if k not in ("event", "step")}
            self._write("decision", event["step"], {}, {"decision": record})
            if self._tb is not None:
                self._tb.add_text("controller/decision", json.dumps(record), event["step"])
        elif kind in ("drift", "resume"):
            self._write(kind, event.get("after_step", event.get("step", self._step)), {},
                        {k: v for k, v in event.items() if k not in ("event", "step", "after_step")})

    def close(self) -> None:
        self._samples.close()
        if self._metrics is not None:
            self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
