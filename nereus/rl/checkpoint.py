"""Sharded, asynchronous, atomic checkpoints of the RL loop's whole training state
(`nereus train --save-every N --keep K`).

Input: the runtime's registered shards of every model-stage but actor.generation (the
weight sync rebuilds it from actor.training), the trainer's own state (step, plan, data
position, applied drifts, Adam step counters, RNG states) and the output folder.
Output: OUT/checkpoints/step_N/, a torch.distributed.checkpoint (DCP) directory: each
rank's file `__R_0.distcp` holds the boxes of the current plan's layout that it writes (a
box held by several ranks, e.g. by dp replicas, is written once), `.metadata` is DCP's
metadata (every tensor's global shape and chunks: the boxes with their global offsets,
and where each lies in which file), and `nereus.json` says what the checkpoint is (step,
plan, world, bytes). Tensors are named `{model-stage}/{global name}`, e.g.
`actor.training/actor/layers.0.attn.qkv.weight#exp_avg`; `nereus/state` holds the trainer
state (nereus.rl.checkpoint_layout).

A chunk is stored as its raw bytes, not as a torch.save record as DCP's own writer does,
and the metadata is computed from the layout, which every rank knows, rather than planned
by DCP's collectives: the background writer then costs little CPU (and GIL) beside the
training step (measured: benchmarks/checkpoint_stall.py). DCP loads read the chunks
through nereus.rl.checkpoint_read's storage reader, which reads only the boxes a new
layout needs (any DCP load planner works with it).

Invariants:
- no rank holds more than its own shards: a save copies this rank's boxes (the staging
  copy, the only part on the training thread) and a background thread writes them while
  training goes on (at most one save in flight; the next waits for it);
- atomic: the files go to OUT/checkpoints/.step_N.<run id>.partial; rank 0 writes
  `.metadata` and `nereus.json` once every rank's file is written and fsynced (an
  all-reduce on the writers' own gloo group) and then renames the folder to step_N, so a
  checkpoint directory named step_N is complete, and a crash mid-save
  leaves the previous one valid (a partial folder is never read, and is removed when the
  next run starts);
- the last `keep` complete checkpoints stay, older ones are removed after a new one is
  complete.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from nereus.runtime.ahead_threads import short_switch
from nereus.runtime.state import box_piece, step_name

from .checkpoint_layout import STATE_KEY, SaveLayout, file_name, saved_stages  # noqa: F401 - re-exported

CHECKPOINTS = "checkpoints"
MANIFEST = "nereus.json"


def checkpoints_dir(out: str) -> str:
    return os.path.join(out, CHECKPOINTS)


def step_dir(out: str, step: int) -> str:
    return os.path.join(checkpoints_dir(out), f"step_{step}")


def complete_steps(out: str) -> list[int]:
    """Steps of the complete checkpoints under OUT/checkpoints, ascending."""
    found = []
    root = checkpoints_dir(out)
    if not os.path.isdir(root):
        return found
    for entry in os.listdir(root):
        if entry.startswith("step_") and entry[5:].isdigit():
            path = os.path.join(root, entry)
            if os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, MANIFEST)):
                found.append(int(entry[5:]))
    return sorted(found)


def plan_name(rt) -> str:
    """The current plan's name (the Nereus runtime's `plan` is a name, the restart baseline's a Plan)."""
    return rt.plan if isinstance(rt.plan, str) else rt.plan.name


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
            "python_version": random.getstate()[0], "python_gauss": random.getstate()[2]}


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))


class Staged:
    """This rank's part of a checkpoint, copied out of the live state: the boxes it writes
    ({(fqn, offsets): tensor}, in its file's order) and the trainer state (rank 0 only)."""

    def __init__(self):
        self.boxes: dict = {}
        self.state: Optional[dict] = None
        self.bytes = 0

    def add(self, fqn: str, box, tensor: torch.Tensor) -> None:
        self.boxes[(fqn, tuple(lo for lo, _ in box))] = tensor
        self.bytes += tensor.numel() * tensor.element_size()


def stage(rt, module, rank: int, specs: Callable[[str], dict], layout: Optional[SaveLayout] = None) -> Staged:
    """Copy the boxes this rank writes (`layout`, default the runtime's plan's) into fresh
    CPU tensors, in the order of its file."""
    staged = Staged()
    layout = SaveLayout(module, plan_name(rt), specs) if layout is None else layout
    states: dict = {}
    for ms, tensor, index, box in layout.writers.get(rank, ()):
        if ms not in states:
            states[ms] = rt.state(ms)
        piece = box_piece(states[ms][tensor], layout.shard_boxes[(rank, ms, tensor)], index)
        copy = torch.empty(piece.shape, dtype=piece.dtype)
        copy.copy_(piece)
        staged.add(f"{ms}/{tensor}", box, copy)
    return staged


def adam_steps(rt, module) -> dict:
    """{model-stage: the runtime's Adam step counter} of the training stages; collective
    (a counter lives on the ranks that hold the stage)."""
    out = {}
    for ms in saved_stages(module):
        if not ms.endswith(".training"):
            continue
        local = rt.state(ms).get(step_name(ms.partition(".")[0]))
        value = torch.tensor([int(local) if local is not None else -1], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        out[ms] = int(value)
    return out


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointWriter:
    """Asynchronous sharded saves of one run (module docstring). Every rank makes one, in
    the same order relative to the process groups it creates (it makes a gloo group of
    its own: the background thread's collectives must not interleave with the loop's on
    the default group)."""

    def __init__(self, out: str, keep: int, run_id: str, emit: Callable[[dict], None] = lambda e: None,
                 after_write: Optional[Callable[[int], None]] = None):
        self.out, self.keep, self.run_id, self.emit = out, max(1, keep), run_id, emit
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.after_write = after_write
        # imported here, before training: importing DCP in the first save's thread held the
        # GIL for over a second, which the training step beside it waited out (seen: step 2
        # of a run saving every step took 1.5-2.0 s instead of 0.1-0.3 s)
        import torch.distributed.checkpoint.filesystem  # noqa: F401
        import torch.distributed.checkpoint.metadata  # noqa: F401

        self._thread: Optional[threading.Thread] = None
        self._stall: dict = {}
        self.completed: list[dict] = []  # this rank's finished saves: step, bytes, write (and its CPU) seconds
        self._error: Optional[BaseException] = None
        self._done: Optional[dict] = None
        if self.rank == 0:
            self._clear_partials()
        if dist.is_initialized():
            dist.barrier()  # no rank writes into a folder rank 0 is removing

    def _clear_partials(self) -> None:
        root = checkpoints_dir(self.out)
        if not os.path.isdir(root):
            return
        for entry in os.listdir(root):
            if entry.startswith(".step_") and entry.endswith(".partial"):
                shutil.rmtree(os.path.join(root, entry), ignore_errors=True)

    def save(self, step: int, staged: Staged, layout: SaveLayout, manifest: dict, staging_seconds: float = 0.0) -> float:
        """Start writing `staged` as step_N in the background; returns the seconds the
        caller waited for the previous save (the staging copy, `staging_seconds`, is the
        caller's own; both are the save's stall)."""
        waited = self.wait()
        self._stall = {"stall_seconds": staging_seconds + waited, "staging_seconds": staging_seconds,
                       "waited_seconds": waited}
        partial = os.path.join(checkpoints_dir(self.out), f".step_{step}.{self.run_id}.partial")
        self._thread = threading.Thread(target=self._write, args=(step, staged, layout, manifest, partial),
                                        name=f"nereus-checkpoint-{step}", daemon=True)
        self._thread.start()
        return waited

    def _write(self, step: int, staged: Staged, layout: SaveLayout, manifest: dict, partial: str) -> None:
        # the GIL's switch interval short while this thread runs Python: the training thread
        # gives up the GIL at every torch call and would wait up to 5 ms for it each time
        # (nereus.runtime.ahead_threads, as for the lowering-ahead thread; NEREUS_AHEAD_SWITCH_MS)
        with short_switch():
            self._write_files(step, staged, layout, manifest, partial)

    def _write_files(self, step: int, staged: Staged, layout: SaveLayout, manifest: dict, partial: str) -> None:
        import io
        import pickle

        started, cpu = time.perf_counter(), time.thread_time()
        try:
            os.makedirs(partial, exist_ok=True)
            state = b""
            if staged.state is not None:
                buffer = io.BytesIO()
                torch.save(staged.state, buffer)
                state = buffer.getvalue()
            path = os.path.join(partial, file_name(self.rank))
            with open(path, "wb") as handle:  # the chunks in the layout's order, raw, then the state
                for tensor in staged.boxes.values():
                    if tensor.numel():
                        handle.write(memoryview(tensor.contiguous().view(torch.uint8).reshape(-1).numpy()))
                handle.write(state)
                handle.flush()
                os.fsync(handle.fileno())
                written = handle.tell()
            if written != layout.file_bytes.get(self.rank, 0) + len(state):
                raise RuntimeError(f"checkpoint file {path}: {written} bytes written, the layout places "
                                   f"{layout.file_bytes.get(self.rank, 0) + len(state)}")
            if self.after_write is not None:
                self.after_write(step)
            # every rank's file is on disk once this all-reduce returns on rank 0
            sizes = torch.tensor([staged.bytes, len(state)], dtype=torch.int64)
            if self.group is not None:
                dist.all_reduce(sizes, group=self.group)
            seconds = time.perf_counter() - started
            if self.rank == 0:
                final = step_dir(self.out, step)
                for name, data in ((".metadata", pickle.dumps(layout.metadata(len(state), final))),
                                   (MANIFEST, json.dumps({**manifest, "bytes": int(sizes[0]),
                                                          "write_seconds": seconds}, indent=1).encode())):
                    with open(os.path.join(partial, name), "wb") as handle:
                        handle.write(data)
                        handle.flush()
                        os.fsync(handle.fileno())
                if os.path.isdir(final):  # an earlier run's (a resumed run saves that step again)
                    shutil.rmtree(final)
                os.rename(partial, final)
                _fsync_dir(checkpoints_dir(self.out))
                for old in complete_steps(self.out)[:-self.keep]:
                    shutil.rmtree(step_dir(self.out, old), ignore_errors=True)
            self._done = {"event": "checkpoint", "step": step, "path": step_dir(self.out, step),
                          "bytes": int(sizes[0]), "rank_bytes": staged.bytes, "write_seconds": seconds,
                          "write_cpu_seconds": time.thread_time() - cpu, **self._stall}
        except BaseException as error:  # noqa: BLE001 - raised on the training thread by wait()
            self._error = error

    def wait(self) -> float:
        """Wait for the save in flight; raise its error; emit its event. Returns the wait."""
        started = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        waited = time.perf_counter() - started
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._done is not None:
            self.completed.append(self._done)
            if self.rank == 0:
                self.emit(self._done)
            self._done = None
        return waited
