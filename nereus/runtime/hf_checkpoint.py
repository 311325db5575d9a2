"""Hugging Face checkpoints ↔ this rank's shards, without materializing the model.

    local = rt.shard_hf_checkpoint("actor.training")     # reads only this rank's boxes
    rt.register("actor.training", local)
    hf = rt.gather_hf_state_dict("actor.training")       # collective: HF names, full tensors

Loading. Input: a model, the UNIT this rank holds (JSON program v1 layout) and a
checkpoint directory (`model.safetensors`, or shards listed by
`model.safetensors.index.json`). Output: {global name: local tensor} in the local shard
contract (boxes stacked along dim 0), at the model's dtype, ready for `register`;
training units also get `#master` (fp32 copy of the weight, read at its own boxes: under
`zero 1`/`zero 3` a dp chunk of the TP shard), zeroed `#exp_avg` / `#exp_avg_sq` of the
master's shape and Adam step 0. Invariant: only the bytes of this rank's boxes are read
from the files (a row range is one positioned read, a column range one read per row), each
straight into the local tensor when the dtypes agree, so peak host memory is about this
rank's shards, not the model (a tensor whose dtype differs costs one piece more).

The safetensors format is read directly (8-byte header length, JSON header with dtype,
shape and byte offsets, then raw little-endian data): positioned reads into the target
tensor keep the file's pages out of this process, which memory-mapping the file (what
safetensors' own slicing does) would not for column slices.

A value head (`score.weight`) missing from a causal-LM checkpoint starts at zero (a critic
that predicts 0, as nereus.models.llama.init_full_weights does); a tied model reads its
head from the embedding, and a tied checkpoint that also holds a different lm_head.weight
is refused (transformers would compute with that tensor).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from nereus.ir.diagnostics import NereusError
from nereus.ir.model import Model, ModelStage
from nereus.models import OPTIMIZER_STATES, optimizer_name, tensor_table
from nereus.models.hf import TIED_HEAD_HINT, hf_targets, nereus_to_hf
from nereus.models.safetensors_header import checkpoint_entries, tied_head_conflict

from .box_read import read_box
from .boxes import as_box
from .executor import TORCH_DTYPES
from .state import assemble, step_name

SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32}


class SafetensorsFiles:
    """The tensors of a checkpoint directory by name (nereus.models.safetensors_header):
    where each lies in which file, and its torch dtype."""

    def __init__(self, directory: str):
        self.directory = directory
        self.entries: dict = {}  # name -> (file, dtype, shape, data start)
        self.unread: dict = {}  # name -> (file, safetensors dtype) of tensors in a dtype Nereus does not read
        self.headers = checkpoint_entries(directory)
        for name, entry in self.headers.items():
            if entry.kind in SAFETENSORS_DTYPES:
                self.entries[name] = (entry.path, SAFETENSORS_DTYPES[entry.kind], entry.shape, entry.start)
            else:
                self.unread[name] = (entry.path, entry.kind)
        self._fds: dict = {}

    def check(self, name: str, shape: tuple, model: str) -> None:
        """Raise unless tensor `name` is a floating-point tensor of `shape`."""
        if name in self.unread:
            path, kind = self.unread[name]
            raise NereusError(f"{path}: {name} has dtype {kind}, which Nereus does not read",
                              hint=f"Nereus reads {', '.join(SAFETENSORS_DTYPES)} weights; save the checkpoint "
                                   "in one of them (e.g. model.to(torch.bfloat16).save_pretrained(dir))")
        path, dtype, have, _ = self.entries[name]
        if have != tuple(shape):
            raise NereusError(f"{path}: {name} has shape {list(have)}, {model} needs {list(shape)}",
                              hint="is the checkpoint of the model's architecture and sizes (its config.json)?")
        if not dtype.is_floating_point:
            raise NereusError(f"{path}: {name} is {str(dtype).replace('torch.', '')}, not a floating-point weight",
                              hint="is this a model checkpoint?")

    def __contains__(self, name: str) -> bool:
        return name in self.entries or name in self.unread

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, path: str) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name][1]

    def read_into(self, name: str, box: tuple, out: torch.Tensor) -> None:
        """Read box `box` (half-open ranges per dim) of tensor `name` into the contiguous
        tensor `out` (the checkpoint's dtype, the box's shape)."""
        path, dtype, shape, start = self.entries[name]
        if len(box) != len(shape) or any(hi > n for (_, hi), n in zip(box, shape)):
            raise NereusError(f"{name}: box {box} outside its shape {shape} in {path}")
        read_box(self._fd(path), start, shape, box, out, f"{path}: {name}")


def _sources(model: Model) -> dict:
    """{global Nereus tensor: [(HF name, first row, end row), ...]} tiling its rows."""
    out: dict = {}
    for hf, target in hf_targets(model).items():
        out.setdefault(target.tensor, []).append((hf, *target.rows))
    return out


def _read_shard(files: SafetensorsFiles, pieces: list, boxes: list, dtype: torch.dtype) -> torch.Tensor:
    """The local tensor of one shard: its boxes, stacked along dim 0, read piece by piece
    (a fused tensor's rows come from several HF tensors)."""
    rest = [hi - lo for lo, hi in boxes[0][1:]]
    out = torch.empty([sum(b[0][1] - b[0][0] for b in boxes), *rest], dtype=dtype)
    row = 0
    for box in boxes:
        lo, hi = box[0]
        for hf, first, end in pieces:
            a, b = max(lo, first), min(hi, end)
            if a >= b:
                continue
            part = out[row + a - lo: row + b - lo]
            hf_box = ((a - first, b - first), *box[1:])
            if files.dtype(hf) == dtype:
                files.read_into(hf, hf_box, part)
            else:  # one piece at the checkpoint's dtype, then cast
                staged = torch.empty(part.shape, dtype=files.dtype(hf))
                files.read_into(hf, hf_box, staged)
                part.copy_(staged)
        row += hi - lo
    return out


def shard_checkpoint(model: Model, model_stage: ModelStage, unit: Optional[dict], gpu: int,
                     directory: str) -> dict:
    """Input: the model, the UNIT on this GPU (None: it holds none) and the checkpoint
    directory. Output: this GPU's local tensors by global name (see the module docstring)."""
    if unit is None:
        return {}
    files = SafetensorsFiles(directory)
    try:
        conflict = tied_head_conflict(model, files.headers)
        if conflict is not None:
            raise NereusError(f"{directory} {conflict}", hint=TIED_HEAD_HINT)
        for hf, target in hf_targets(model).items():  # every present tensor, before any read
            if hf in files:
                files.check(hf, target.shape, model.name)
        sources = _sources(model)
        dtype = TORCH_DTYPES[model.dtype]
        weights = {f"{model.name}/{spec.name}" for spec in tensor_table(model)}
        out = {}
        master = optimizer_name("", OPTIMIZER_STATES[0])
        for shard in unit["shards"]:
            name = shard["tensor"]
            # under zero 1/3 the master's boxes are a dp chunk, not the weight's boxes: read
            # each (weight or master) shard at its own boxes
            weight = name[:-len(master)] if name.endswith(master) else name
            if shard["gpu"] != gpu or weight not in weights:
                continue
            if weight != name and model_stage.stage != "training":
                continue
            boxes = [as_box(b) for b in shard["boxes"]]
            pieces = sources.get(weight, [])
            absent = [hf for hf, _, _ in pieces if hf not in files]
            if absent and weight.endswith("/value_head.weight"):
                out[name] = torch.zeros([sum(b[0][1] - b[0][0] for b in boxes), *[hi - lo for lo, hi in boxes[0][1:]]],
                                        dtype=dtype)
            elif absent:
                raise NereusError(f"{directory} lacks {absent[0]}, which {model.name} needs for {name}",
                                  hint="is the checkpoint of the model's architecture and sizes?")
            else:
                out[name] = _read_shard(files, pieces, boxes, dtype)
            if weight != name:  # the fp32 master: the checkpoint's values at the model's dtype, widened
                out[name] = out[name].float()
                for state in OPTIMIZER_STATES[1:]:
                    out[optimizer_name(weight, state)] = torch.zeros(out[name].shape, dtype=torch.float32)
    finally:
        files.close()
    if model_stage.stage == "training":
        out[step_name(model.name)] = torch.tensor(0, dtype=torch.int64)
    return out


def gather_hf(model: Model, units: list, gpu: int, local: dict, group=None) -> dict:
    """Collective over `group`: the full weights (no optimizer state) under HF names on
    every rank, each a contiguous tensor at the model's dtype."""
    dtype = TORCH_DTYPES[model.dtype]
    specs = {f"{model.name}/{spec.name}": (spec.shape, dtype) for spec in tensor_table(model)}
    full = assemble(units, gpu, local, specs, group=group)
    return {name: tensor.contiguous().clone() for name, tensor in nereus_to_hf(model, full).items()}
