"""What a checkpoint of one plan's layout holds, computed the same way on every rank:
which rank writes which box, in what order and at what offset of its file, and the
torch.distributed.checkpoint (DCP) metadata that describes the whole.

Input: the module, the plan and the tensor specs of each model-stage. Output: `writers`
({rank: [(model-stage, tensor, box index in its shard, box), ...]} in file order) and
`metadata(state_length, checkpoint_id)`: a DCP `Metadata` whose tensors are named
`{model-stage}/{global name}`, each with its global size and its chunks (the boxes, with
their global offsets), whose `storage_data` places each chunk at its byte range of
`__R_0.distcp`, raw (row-major), and the trainer state (`nereus/state`, a torch.save
record) after rank 0's chunks. Invariant: every distinct box of every saved model-stage is
in exactly one rank's file; a box that several ranks hold goes to its least loaded holder
(bytes), so the files come out about even. Because every rank derives the same layout,
a save needs no planning collective: each rank writes its file, and rank 0 writes the
metadata once all files are on disk (nereus.rl.checkpoint).
"""

from __future__ import annotations

from typing import Callable

import torch

from nereus.backends.json_program import plan_units_json
from nereus.runtime.boxes import as_box

SKIPPED_STAGES = ("actor.generation",)  # rebuilt from actor.training by the weight sync
STATE_KEY = "nereus/state"


def saved_stages(module) -> list[str]:
    return sorted(str(ms) for ms in module.workload.model_stages() if str(ms) not in SKIPPED_STAGES)


def file_name(rank: int) -> str:
    """A rank's data file (DCP's FileSystemWriter names one file per rank the same way)."""
    return f"__{rank}_0.distcp"


class SaveLayout:
    """The checkpoint layout of `plan` (module docstring)."""

    def __init__(self, module, plan: str, specs: Callable[[str], dict]):
        self.plan = plan
        load: dict = {}
        self.writers: dict = {}
        self._chunks: list = []  # (rank, fqn, box, dtype, global shape, bytes) in file order per rank
        self.shard_boxes: dict = {}  # (rank, model-stage, tensor) -> the boxes of that rank's shard
        for ms in saved_stages(module):
            holders: dict = {}
            for unit in plan_units_json(module, plan, ms):
                for shard in unit["shards"]:
                    boxes = [as_box(raw) for raw in shard["boxes"]]
                    self.shard_boxes[(shard["gpu"], ms, shard["tensor"])] = boxes
                    for index, box in enumerate(boxes):
                        holders.setdefault((shard["tensor"], box), []).append((shard["gpu"], index))
            tensors = specs(ms)
            for (tensor, box), held in holders.items():
                shape, dtype = tensors[tensor]
                rank, index = min(held, key=lambda h: (load.get(h[0], 0), h[0]))
                nbytes = torch.Size([hi - lo for lo, hi in box]).numel() * torch.empty((), dtype=dtype).element_size()
                load[rank] = load.get(rank, 0) + nbytes
                self.writers.setdefault(rank, []).append((ms, tensor, index, box))
                self._chunks.append((rank, f"{ms}/{tensor}", box, dtype, tuple(shape), nbytes))
        self.file_bytes = load  # rank -> bytes of its chunks
        covered: dict = {}
        for _, fqn, box, _, shape, _ in self._chunks:
            covered[fqn] = covered.get(fqn, 0) + torch.Size([hi - lo for lo, hi in box]).numel()
        for _, fqn, _, _, shape, _ in self._chunks:
            if covered[fqn] != torch.Size(shape).numel():  # (what DCP's save planner validates)
                raise RuntimeError(f"plan {plan}: the boxes of {fqn} do not tile its shape {list(shape)}")

    def metadata(self, state_length: int, checkpoint_id: str = ""):
        """The DCP Metadata of a save whose trainer state record is `state_length` bytes."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                           MetadataIndex, StorageMeta, TensorProperties,
                                                           TensorStorageMetadata)

        tensors: dict = {}
        storage: dict = {}
        offsets: dict = {}
        for rank, fqn, box, dtype, shape, nbytes in self._chunks:
            start = tuple(lo for lo, _ in box)
            if fqn not in tensors:
                tensors[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [])
            tensors[fqn].chunks.append(ChunkStorageMetadata(torch.Size(start), torch.Size([hi - lo for lo, hi in box])))
            at = offsets.get(rank, 0)
            storage[MetadataIndex(fqn, torch.Size(start))] = _StorageInfo(file_name(rank), at, nbytes)
            offsets[rank] = at + nbytes
        tensors[STATE_KEY] = BytesStorageMetadata()
        storage[MetadataIndex(STATE_KEY)] = _StorageInfo(file_name(0), offsets.get(0, 0), state_length)
        metadata = Metadata(state_dict_metadata=tensors, storage_data=storage)
        metadata.storage_meta = StorageMeta(checkpoint_id=checkpoint_id)
        try:  # the format version DCP's own writer stamps (absent from older torch)
            from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

            metadata.version = CURRENT_DCP_VERSION
        except ImportError:
            pass
        return metadata
