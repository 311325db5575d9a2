"""Reading the RL loop's sharded checkpoints (nereus.rl.checkpoint) into any layout.

Input: a checkpoint directory and, per tensor, the boxes a reader needs: on resume the
boxes of this rank's shards in the new plan (`Runtime.layout`, any plan of the file, any
process count that plan fits); for an export a whole tensor. Output: the boxes filled, and
the bytes read. Invariant: only the bytes of the requested boxes are read from the data
files, so a rank never holds a full tensor unless its shard is one, and the tensor bytes
read on resume equal the new layout's bytes.

How: DCP's load plans the reads (`create_read_items_for_chunk_list` intersects the boxes
wanted with the chunks stored, whatever layout wrote them); the storage reader here,
instead of DCP's (which unpickles a whole stored chunk, then narrows it), reads the wanted
sub-box of the chunk's raw bytes (nereus.rl.checkpoint `_writer`) with positioned reads
straight into the destination (nereus.runtime.box_read).
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

from nereus.ir.diagnostics import NereusError
from nereus.runtime.box_read import pread_into, read_box

from .checkpoint import MANIFEST, STATE_KEY, complete_steps, step_dir


@dataclass
class ReadCount:
    """Bytes a load read: tensor data (the boxes asked for) and the rest (the trainer state)."""

    data: int = 0
    state: int = 0


def manifest(path: str) -> dict:
    with open(os.path.join(path, MANIFEST)) as handle:
        return json.load(handle)


def latest(out: str, step: Optional[int] = None) -> tuple[int, str]:
    """(step, directory) of the latest complete checkpoint under OUT (or of `step`)."""
    steps = complete_steps(out)
    if not steps:
        raise NereusError(f"{out} holds no complete checkpoint (OUT/checkpoints/step_N)",
                          hint="train with --save-every N (a checkpoint is complete once nereus.json and "
                               ".metadata are in it)")
    if step is None:
        return steps[-1], step_dir(out, steps[-1])
    if step not in steps:
        raise NereusError(f"{out} has no complete checkpoint of step {step}",
                          hint=f"complete checkpoints: steps {', '.join(map(str, steps))}")
    return step, step_dir(out, step)


def storage_reader(path: str, count: Optional[ReadCount] = None):
    """A DCP storage reader for the checkpoint at `path` (DCP's FileSystemReader with
    partial reads of raw tensor chunks, module docstring), for `dcp.load` with any load
    planner; `count` adds up the bytes it reads."""
    count = ReadCount() if count is None else count
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class BoxReader(FileSystemReader):
        def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            self.metadata = metadata

        def _chunk(self, index):
            for chunk in self.metadata.state_dict_metadata[index.fqn].chunks:
                if tuple(chunk.offsets) == tuple(index.offset):
                    return chunk
            raise NereusError(f"{path}: no stored chunk of {index.fqn} at {tuple(index.offset)}")

        def read_data(self, plan, planner):
            fds: dict = {}
            try:
                for item in plan.items:
                    info = self.storage_data[item.storage_index]
                    file = os.path.join(str(self.path), info.relative_path)
                    if file not in fds:
                        fds[file] = os.open(file, os.O_RDONLY)
                    fd = fds[file]
                    if item.type == LoadItemType.BYTE_IO:
                        data = bytearray(info.length)
                        pread_into(fd, memoryview(data), info.offset, file)
                        count.state += info.length
                        planner.load_bytes(item, io.BytesIO(bytes(data)))
                        continue
                    chunk = self._chunk(item.storage_index)
                    dtype = self.metadata.state_dict_metadata[item.storage_index.fqn].properties.dtype
                    shape = tuple(chunk.sizes)
                    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                    if info.length != nbytes:
                        raise NereusError(f"{file}: {item.storage_index.fqn} at {tuple(chunk.offsets)} holds "
                                          f"{info.length} bytes, its chunk {nbytes}",
                                          hint="was this checkpoint written by nereus train (raw chunks)?")
                    box = tuple((o, o + n) for o, n in zip(item.storage_offsets, item.lengths))
                    target = planner.resolve_tensor(item)
                    staging = target if target.is_contiguous() and target.device.type == "cpu" else \
                        torch.empty(target.shape, dtype=dtype)
                    count.data += read_box(fd, info.offset, shape, box, staging, file)
                    if staging is not target:
                        target.copy_(staging)
                    planner.commit_tensor(item, target)
            finally:
                for fd in fds.values():
                    os.close(fd)
            future = Future()
            future.set_result(None)
            return future

    return BoxReader(path)


def _planner(wanted: dict, want_state: bool):
    """A DCP load planner for `wanted`: {(fqn, offsets): (box, destination tensor)}."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import (_create_read_item_for_byteio,
                                                              create_read_items_for_chunk_list)

    class BoxLoadPlanner(DefaultLoadPlanner):
        state: Optional[dict] = None

        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> LoadPlan:
            items = []
            stored = self.metadata.state_dict_metadata
            for (fqn, offsets), (box, _) in wanted.items():
                if fqn not in stored:
                    raise NereusError(f"the checkpoint has no tensor {fqn}",
                                      hint="resume with the plan file (and --set values) the run was saved with")
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets),
                                             sizes=torch.Size([hi - lo for lo, hi in box]))
                items += create_read_items_for_chunk_list(fqn, stored[fqn], [chunk])
            if want_state:
                index = MetadataIndex(STATE_KEY)
                items.append(_create_read_item_for_byteio(index, 0, index, 0, 0))
            return LoadPlan(items)

        def resolve_tensor(self, item):
            box, tensor = wanted[(item.dest_index.fqn, tuple(item.dest_index.offset))]
            view = tensor
            for dim, (start, length) in enumerate(zip(item.dest_offsets, item.lengths)):
                view = view.narrow(dim, start, length)
            return view

        def load_bytes(self, item, value) -> None:
            self.state = torch.load(value, weights_only=True)

    return BoxLoadPlanner()


def read_boxes(path: str, wanted: dict, process_group=None, distributed: bool = True,
               want_state: bool = True) -> tuple[Optional[dict], ReadCount]:
    """Fill each destination of `wanted` ({(fqn, box offsets): (box, tensor of the box's
    shape)}) from the checkpoint at `path`; returns (the trainer state, bytes read).
    Collective over `process_group` when `distributed` (every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    import warnings

    count = ReadCount()
    planner = _planner(wanted, want_state)
    with warnings.catch_warnings():  # DCP warns when no process group is up: one process reads, on purpose
        if not distributed:
            warnings.simplefilter("ignore", UserWarning)
        dcp.load({}, storage_reader=storage_reader(path, count), planner=planner, process_group=process_group,
                 no_dist=not distributed)
    return planner.state, count


def stored_tensors(path: str) -> dict:
    """{fqn: (global shape, dtype)} of the tensors a checkpoint holds (its .metadata)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(path).read_metadata()
    return {fqn: (tuple(md.size), md.properties.dtype) for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)}


def read_full(path: str, names: list[str]) -> tuple[dict, ReadCount]:
    """Whole tensors `names` (fqns) in one process (export, tests): {fqn: tensor}."""
    stored = stored_tensors(path)
    out, wanted = {}, {}
    for fqn in names:
        shape, dtype = stored[fqn]
        out[fqn] = torch.empty(shape, dtype=dtype)
        wanted[(fqn, tuple(0 for _ in shape))] = (tuple((0, n) for n in shape), out[fqn])
    _, count = read_boxes(path, wanted, distributed=False, want_state=False)
    return out, count
