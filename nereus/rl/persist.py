"""The trainer's checkpoints: when it saves, what trainer state goes with the shards, and
how a resumed run takes it back (nereus.rl.checkpoint, nereus.rl.resume).

Input: the trainer (its runtime, module, plan, data position, drifts applied) and the
run's settings: the output folder, save every N steps, keep K, the checkpoint to resume
from. Output: `restore()` registers the state of a checkpoint and returns the step to
continue after; `boundary(step, last)` saves at the step boundary (after the step's drift
and transition, so a checkpoint is the state the next step starts from, in the plan it
starts in). Invariant: a run resumed from step N's checkpoint computes steps N+1... exactly
as the run that saved it (same plans at the same steps): the weights, fp32 masters, Adam
moments and counters are the saved bytes, the generation weights are synced from them as
at the end of step N, sampling draws from per-step generators seeded by (seed, step), the
dataset continues from the saved position, and the drifts applied so far are applied
again.
"""

from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist

from .checkpoint import CheckpointWriter, SaveLayout, adam_steps, plan_name, restore_rng, rng_state, stage
from .faults import kill_here


def _run_id() -> str:
    """One name for this run's partial checkpoint folders, the same on every rank."""
    import os

    box = [f"{int(time.time())}-{os.getpid()}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


class Persistence:
    def __init__(self, trainer, out: str, save_every: int, keep: int, resume: str = ""):
        self.trainer, self.out, self.save_every, self.resume = trainer, out, save_every, resume
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.writer = CheckpointWriter(out, keep, _run_id(), emit=trainer.emit,
                                       after_write=lambda step: kill_here("save", step, self.rank)) if out else None
        self.resumed: Optional[dict] = None
        self._layouts: dict = {}  # plan -> SaveLayout (computed once per plan)

    def restore(self) -> int:
        """Register the checkpoint's state (collective); returns its step."""
        from .resume import generation_shards, load_checkpoint

        trainer = self.trainer
        started = time.perf_counter()
        state, count, layout_bytes = load_checkpoint(trainer.rt, trainer.module, self.resume)
        for override in state["drift"]:
            trainer.apply_drift(override)
        trainer.drift_applied = list(state["drift"])
        trainer.position = state["position"]
        restore_rng(state["rng"])
        if "actor.generation" in trainer.stages and trainer.vllm is None:
            generation_shards(trainer.rt, trainer.module)
        trainer.sync_generation_weights()  # as at the end of the saved step
        figures = {"step": state["step"], "saved_plan": state["plan"], "saved_world": state["world"],
                   "plan": trainer.plan_name, "bytes_read": count.data, "state_bytes": count.state,
                   "layout_bytes": layout_bytes, "seconds": time.perf_counter() - started}
        import torch

        totals = torch.tensor([count.data, count.state, layout_bytes], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
        figures.update(total_bytes_read=int(totals[0]), total_state_bytes=int(totals[1]),
                       total_layout_bytes=int(totals[2]))
        self.resumed = figures
        trainer.emit({"event": "resume", **figures})
        return state["step"]

    def boundary(self, step: int, last: bool) -> None:
        """Save after `step` when it is due (every `save_every` steps, and the last step)."""
        if self.writer is None or not (last or (self.save_every and step % self.save_every == 0)):
            return
        trainer = self.trainer
        started = time.perf_counter()
        counters = adam_steps(trainer.rt, trainer.module)  # collective
        plan = plan_name(trainer.rt)
        if plan not in self._layouts:
            self._layouts[plan] = SaveLayout(trainer.module, plan, trainer.rt.tensor_specs)
        staged = stage(trainer.rt, trainer.module, self.rank, trainer.rt.tensor_specs, self._layouts[plan])
        if self.rank == 0:
            staged.state = {"step": step, "plan": plan_name(trainer.rt), "position": trainer.position,
                            "drift": list(trainer.drift_applied), "adam_steps": counters, "rng": rng_state(),
                            "world": trainer.world, "seed": trainer.spec.seed}
        staging = time.perf_counter() - started
        manifest = {"step": step, "plan": plan_name(trainer.rt), "world": trainer.world, "time": time.time(),
                    "position": trainer.position}
        self.writer.save(step, staged, self._layouts[plan], manifest, staging)

    @property
    def saves(self) -> list[dict]:
        """This rank's finished saves (step, stall, write), in order."""
        return self.writer.completed if self.writer is not None else []

    def close(self) -> None:
        """Wait for the save in flight (its error, if any, is raised here)."""
        if self.writer is not None:
            self.writer.wait()

    def report(self) -> list[dict]:
        """Per save: its stall on the training thread and its write (this rank's figures)."""
        return [{k: v for k, v in done.items() if k not in ("event", "path")} for done in self.saves]
