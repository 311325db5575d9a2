"""Sharded, asynchronous, atomic checkpoints of the RL loop's whole training state
(`nereus train --save-every N --keep K`).

Input: the runtime's registered shards of every model-stage but actor.generation (the
weight sync rebuilds it from actor.training), the trainer's own state (step, plan, data
position, applied drifts, Adam step counters, RNG states) and the output folder.
Output: OUT/checkpoints/step_N/, a torch.distributed.checkpoint (DCP) directory: each
rank's file `__R_0.distcp` holds the boxes of the global tensors it is the first holder
of in the current plan (a box held by several ranks, e.g. by dp replicas, is written
once), `.metadata` lists every tensor's global shape and its chunks (global offsets and
sizes: the boxes), and `nereus.json` says what the checkpoint is (step, plan, world,
bytes). Tensors are named `{model-stage}/{global name}`, e.g.
`actor.training/actor/layers.0.attn.qkv.weight#exp_avg`; `nereus/state` holds the trainer
state. A tensor chunk is stored as its raw bytes (not a torch.save record: `_writer`), so
DCP's loads read it through nereus.rl.checkpoint_read's storage reader, which reads only
the boxes a new layout needs (any DCP load planner works with it).

Invariants:
- no rank holds more than its own shards: a save copies this rank's boxes (the staging
  copy, the only part on the training thread) and a background thread writes them while
  training goes on (at most one save in flight; the next waits for it);
- atomic: the files go to OUT/checkpoints/.step_N.<run id>.partial; rank 0 renames it to
  step_N only after DCP's finish (every rank's data written and fsynced, `.metadata`
  written), so a checkpoint directory named step_N is complete, and a crash mid-save
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

from nereus.backends.json_program import plan_units_json
from nereus.runtime.ahead_threads import short_switch
from nereus.runtime.boxes import as_box
from nereus.runtime.state import box_piece, step_name, unit_on_gpu

CHECKPOINTS = "checkpoints"
MANIFEST = "nereus.json"
STATE_KEY = "nereus/state"
SKIPPED_STAGES = ("actor.generation",)  # rebuilt from actor.training by the weight sync


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


def saved_stages(module) -> list[str]:
    return sorted(str(ms) for ms in module.workload.model_stages() if str(ms) not in SKIPPED_STAGES)


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
    ({(fqn, offsets): tensor}), the global shape and chunk of each, and the trainer state
    (rank 0 only)."""

    def __init__(self):
        self.boxes: dict = {}
        self.chunks: dict = {}  # (fqn, offsets) -> (global shape, box)
        self.state: Optional[dict] = None
        self.bytes = 0

    def add(self, fqn: str, box, shape, tensor: torch.Tensor) -> None:
        offsets = tuple(lo for lo, _ in box)
        self.boxes[(fqn, offsets)] = tensor
        self.chunks[(fqn, offsets)] = (tuple(shape), box)
        self.bytes += tensor.numel() * tensor.element_size()


def box_writers(module, plan: str, specs: Callable[[str], dict]) -> dict:
    """{gpu: [(model-stage, tensor, box index in its shard, box), ...]}: who writes each
    distinct box of the saved model-stages in `plan`. A box held by several ranks (dp
    replicas, replicated tensors, replicated KV heads) goes to its least loaded holder so
    far (bytes), so the ranks' files come out about even. Every rank computes the same."""
    load: dict = {}
    out: dict = {}
    for ms in saved_stages(module):
        holders: dict = {}
        for unit in plan_units_json(module, plan, ms):
            for shard in unit["shards"]:
                for index, raw in enumerate(shard["boxes"]):
                    holders.setdefault((shard["tensor"], as_box(raw)), []).append((shard["gpu"], index))
        dtypes = {name: dtype for name, (_, dtype) in specs(ms).items()}
        for (tensor, box), held in holders.items():
            gpu, index = min(held, key=lambda h: (load.get(h[0], 0), h[0]))
            nbytes = torch.Size([hi - lo for lo, hi in box]).numel() * torch.empty((), dtype=dtypes[tensor]).element_size()
            load[gpu] = load.get(gpu, 0) + nbytes
            out.setdefault(gpu, []).append((ms, tensor, index, box))
    return out


def stage(rt, module, rank: int, specs: Callable[[str], dict], writers: Optional[dict] = None) -> Staged:
    """Copy the boxes this rank writes (`writers`, default `box_writers` of the runtime's
    plan) into fresh CPU tensors."""
    staged = Staged()
    plan = plan_name(rt)
    boxes: dict = {}
    writers = box_writers(module, plan, specs) if writers is None else writers
    for ms, tensor, index, box in writers.get(rank, ()):
        if ms not in boxes:
            unit = unit_on_gpu(plan_units_json(module, plan, ms), rank)
            boxes[ms] = ({s["tensor"]: [as_box(b) for b in s["boxes"]] for s in unit["shards"] if s["gpu"] == rank},
                         rt.state(ms), specs(ms))
        mine, local, shapes = boxes[ms]
        piece = box_piece(local[tensor], mine[tensor], index)
        copy = torch.empty(piece.shape, dtype=piece.dtype)
        copy.copy_(piece)
        staged.add(f"{ms}/{tensor}", box, shapes[tensor][0], copy)
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


def _planner(staged: Staged):
    """A DCP save planner whose write items are the staged boxes (chunks with their
    global offsets) and, on rank 0, the trainer state as bytes."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    class BoxSavePlanner(DefaultSavePlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> SavePlan:
            items = []
            for (fqn, offsets), tensor in staged.boxes.items():
                shape, box = staged.chunks[(fqn, offsets)]
                items.append(WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(
                                           chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                      sizes=torch.Size(tensor.shape)),
                                           properties=TensorProperties.create_from_tensor(tensor),
                                           size=torch.Size(shape))))
            if staged.state is not None:
                items.append(WriteItem(index=MetadataIndex(STATE_KEY), type=WriteItemType.BYTE_IO))
            self.plan = SavePlan(items)
            return self.plan

        def lookup_object(self, index):
            if index.fqn == STATE_KEY:
                return staged.state
            return staged.boxes[(index.fqn, tuple(index.offset))]

    return BoxSavePlanner()


def _writer(path: str, after_write: Optional[Callable[[], None]]):
    """DCP's file writer, one file per rank, fsynced, with each tensor chunk stored as its
    raw bytes (row-major, little-endian) instead of a torch.save record: a third of the
    writer's CPU (measured: 7 ms against 24 ms per save of 216 small chunks, one process),
    which a step beside the background write waits for on a busy CPU; the reader
    (nereus.rl.checkpoint_read) reads sub-boxes of it with positioned reads. Byte items
    (the trainer state) stay torch.save records. `after_write` runs once this rank's data
    is on disk (tests: a kill there leaves a partial checkpoint)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class RawWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
            results = []
            with open(os.path.join(str(self.path), name), "wb") as handle:
                for item in plan.items:
                    data = planner.resolve_data(item)
                    offset = handle.tell()
                    if item.type == WriteItemType.BYTE_IO:
                        handle.write(data.getbuffer())
                    elif data.numel():
                        handle.write(memoryview(data.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()))
                    length = handle.tell() - offset
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(name, offset, length)))
                handle.flush()
                os.fsync(handle.fileno())
            if after_write is not None:
                after_write()
            future = Future()
            future.set_result(results)
            return future

    return RawWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)


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
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.default_planner  # noqa: F401
        import torch.distributed.checkpoint.planner_helpers  # noqa: F401

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

    def save(self, step: int, staged: Staged, manifest: dict, staging_seconds: float = 0.0) -> float:
        """Start writing `staged` as step_N in the background; returns the seconds the
        caller waited for the previous save (the staging copy, `staging_seconds`, is the
        caller's own; both are the save's stall)."""
        waited = self.wait()
        self._stall = {"stall_seconds": staging_seconds + waited, "staging_seconds": staging_seconds,
                       "waited_seconds": waited}
        partial = os.path.join(checkpoints_dir(self.out), f".step_{step}.{self.run_id}.partial")
        self._thread = threading.Thread(target=self._write, args=(step, staged, manifest, partial),
                                        name=f"nereus-checkpoint-{step}", daemon=True)
        self._thread.start()
        return waited

    def _write(self, step: int, staged: Staged, manifest: dict, partial: str) -> None:
        # the GIL's switch interval short while this thread runs Python (DCP's planning,
        # torch.save per box): the training thread gives up the GIL at every torch call and
        # would wait up to 5 ms for it each time (nereus.runtime.ahead_threads, as for the
        # lowering-ahead thread; NEREUS_AHEAD_SWITCH_MS)
        with short_switch():
            self._write_files(step, staged, manifest, partial)

    def _write_files(self, step: int, staged: Staged, manifest: dict, partial: str) -> None:
        import torch.distributed.checkpoint as dcp

        started, cpu = time.perf_counter(), time.thread_time()
        try:
            os.makedirs(partial, exist_ok=True)
            hook = (lambda: self.after_write(step)) if self.after_write is not None else None
            dcp.save({}, storage_writer=_writer(partial, hook), planner=_planner(staged),
                     process_group=self.group)
            sizes = torch.tensor([staged.bytes], dtype=torch.int64)
            if self.group is not None:
                dist.all_reduce(sizes, group=self.group)
            seconds = time.perf_counter() - started
            if self.rank == 0:
                final = step_dir(self.out, step)
                with open(os.path.join(partial, MANIFEST), "w") as handle:
                    json.dump({**manifest, "bytes": int(sizes), "write_seconds": seconds}, handle, indent=1)
                    handle.flush()
                    os.fsync(handle.fileno())
                if os.path.isdir(final):  # an earlier run's (a resumed run saves that step again)
                    shutil.rmtree(final)
                os.rename(partial, final)
                _fsync_dir(checkpoints_dir(self.out))
                for old in complete_steps(self.out)[:-self.keep]:
                    shutil.rmtree(step_dir(self.out, old), ignore_errors=True)
            self._done = {"event": "checkpoint", "step": step, "path": step_dir(self.out, step),
                          "bytes": int(sizes), "rank_bytes": staged.bytes, "write_seconds": seconds,
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
