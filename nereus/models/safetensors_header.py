"""safetensors_header: the tensors of a Hugging Face checkpoint directory, from the
safetensors headers alone (no torch, no tensor data).

Input: a checkpoint directory. Output: {tensor name: Entry(file, dtype as the format names
it, shape, byte where its data starts)}, every header entry checked field by field (its
span its shape's, inside the file, disjoint from the others), and transformers 5's stacked
Qwen3-MoE experts also listed under the per-expert names published checkpoints use.
Invariant: every error is a NereusError naming the file (and the tensor), with a hint.

`tied_head_conflict` is the one check that reads tensor data: a tied model's checkpoint
that also holds an lm_head.weight is compared byte for byte with its embedding.

Files, in transformers' order: `model.safetensors`; else the shards
`model.safetensors.index.json` lists. The compiler reads these to compare a checkpoint with
its model before launch (`compare_with_model` below, run by nereus.cli.check's
check_checkpoints); the runtime reads the bytes (nereus.runtime.hf_checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from typing import NamedTuple

from nereus.ir.diagnostics import NereusError

from .hf import STACKED_EXPERTS


class Entry(NamedTuple):
    path: str
    kind: str  # the format's dtype: BF16, F32, U8, ...
    shape: tuple
    start: int  # byte of the file where the tensor's data starts
    stacked: str = ""  # an expert's matrix listed under its per-expert name: the stacked tensor it is in


_REWRITE = "the file may be truncated, a Git LFS pointer (clone with git-lfs) or not safetensors; save it again"


def _index_files(index: str) -> list:
    """The shard files an index (`model.safetensors.index.json`) lists, each checked to exist."""
    try:
        with open(index, encoding="utf-8") as handle:
            files = sorted(set(json.load(handle)["weight_map"].values()))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as error:
        raise NereusError(f"{index}: not valid JSON ({error})", hint=_REWRITE) from None
    except (KeyError, TypeError, AttributeError):
        raise NereusError(f"{index}: no 'weight_map' of tensor names to files",
                          hint="an index is {\"weight_map\": {\"name\": \"model-00001-of-00002.safetensors\", ...}}") from None
    missing = [f for f in files if not isinstance(f, str) or not os.path.isfile(os.path.join(os.path.dirname(index), f))]
    if missing:
        raise NereusError(f"{index} lists {missing[0]}, which is not in {os.path.dirname(index)}",
                          hint="copy every shard file of the checkpoint")
    return files


def checkpoint_files(directory: str) -> list:
    """The safetensors files of a checkpoint directory, in transformers' order of
    precedence: `model.safetensors`, else the shards its index lists (an index left next
    to a model.safetensors, as save_pretrained leaves one, is not read)."""
    if os.path.isfile(os.path.join(directory, "model.safetensors")):
        return ["model.safetensors"]
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        return _index_files(index)
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        names = []
    shards = [n for n in names if n.endswith(".safetensors")]
    if shards:
        raise NereusError(f"no model.safetensors.index.json listing {shards[0]}"
                          f"{f' and {len(shards) - 1} more' if len(shards) > 1 else ''} in {directory}",
                          hint="copy the checkpoint's model.safetensors.index.json too (it maps each tensor "
                               "to its shard file)")
    pickled = [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
    if pickled:
        raise NereusError(f"{directory} holds {pickled[0]}, and Nereus reads only safetensors files",
                          hint="convert it: load it with transformers and save_pretrained(dir), which writes "
                               "safetensors")
    raise NereusError(f"no model.safetensors or model.safetensors.index.json in {directory}",
                      hint="write the checkpoint with transformers' save_pretrained(dir)")


# the safetensors format's dtypes and their bytes per element: every header entry's span is
# checked; only SAFETENSORS_DTYPES are read
FORMAT_BYTES = {"C64": 8, "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


# what a dtype name of the format looks like (one this module cannot size is kept, unread)
_DTYPE_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,15}")
# safetensors refuses headers past this; a corrupt length must not make `nereusc check` read gigabytes
MAX_HEADER_BYTES = 100_000_000


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(path: str, name: str, info, data_start: int, size: int) -> Entry:
    """The Entry of header entry `name`: each field of its type, its byte span its
    shape's, inside the file (`data_start`: where the data section starts, `size`: the
    file's bytes)."""
    def bad(what: str) -> NereusError:
        return NereusError(f"{path}: the header entry of {name}: {what}", hint=_REWRITE)

    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise NereusError(f"{path}: the header entry of {name} lacks dtype, shape or data_offsets", hint=_REWRITE)
    kind, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(kind, str) or not _DTYPE_NAME.fullmatch(kind):
        raise bad(f"dtype must be one of {', '.join(FORMAT_BYTES)}, found {json.dumps(kind)[:40]}")
    if not isinstance(shape, list) or not all(_is_size(n) for n in shape):
        raise bad(f"shape must be a list of sizes, found {json.dumps(shape)[:60]}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_size(n) for n in offsets) \
            or offsets[0] > offsets[1]:
        raise bad(f"data_offsets must be two byte offsets [begin, end] with 0 <= begin <= end, "
                  f"found {json.dumps(offsets)[:60]}")
    first, last = offsets
    shape = tuple(shape)
    if kind not in FORMAT_BYTES:  # a dtype of a later format (F4, F6_E2M3, ...): read by no weight here
        if data_start + last > size:
            raise truncated(f"{path}: {name}", size)
        return Entry(path, kind, shape, data_start + first)
    nbytes = math.prod(shape) * FORMAT_BYTES[kind]
    if last - first != nbytes:
        raise NereusError(f"{path}: {name} spans {last - first} bytes, its shape {list(shape)} and dtype "
                          f"{kind} make {nbytes}", hint=_REWRITE)
    if data_start + last > size:
        raise truncated(f"{path}: {name}", size)
    return Entry(path, kind, shape, data_start + first)



def _check_disjoint(path: str, spans: list, data_start: int) -> None:
    """No two tensors of a file share a byte (a corrupt header could point one tensor
    into another's data)."""
    end, last = None, None
    for first, stop, name in sorted(s for s in spans if s[1] > s[0]):
        if end is not None and first < end:
            raise NereusError(f"{path}: the tensors {last[2]} [{last[0] - data_start}, {last[1] - data_start}) and "
                              f"{name} [{first - data_start}, {stop - data_start}) overlap in the data section",
                              hint=_REWRITE)
        end, last = stop, (first, stop, name)


def truncated(what: str, at: int) -> NereusError:
    return NereusError(f"{what}: the file ends at byte {at}, inside the tensor's data",
                       hint="the checkpoint is truncated: copy or save it again")


def _header(path: str) -> tuple:
    """(header length, header dict, file size) of a safetensors file, checked against its size."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise NereusError(f"{path}: {size} bytes, too short for a safetensors file", hint=_REWRITE)
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise NereusError(f"{path}: its header length ({length} bytes) exceeds the file ({size} bytes)",
                              hint=_REWRITE)
        if length > MAX_HEADER_BYTES:
            raise NereusError(f"{path}: its header length ({length} bytes) exceeds the format's limit "
                              f"({MAX_HEADER_BYTES} bytes)", hint=_REWRITE)
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as error:
            raise NereusError(f"{path}: the header is not valid JSON ({error})", hint=_REWRITE) from None
    if not isinstance(header, dict):
        raise NereusError(f"{path}: the header is not a JSON object", hint=_REWRITE)
    return length, header, size




def checkpoint_entries(directory: str) -> dict:
    """{name: Entry} of every tensor of the checkpoint in `directory` (module docstring)."""
    entries: dict = {}
    for file in checkpoint_files(directory):
        path = os.path.join(directory, file)
        length, header, size = _header(path)
        spans = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            entry = _entry(path, name, info, 8 + length, size)
            if entry.kind in FORMAT_BYTES:
                spans.append((entry.start, entry.start + math.prod(entry.shape) * FORMAT_BYTES[entry.kind], name))
            entries[name] = entry
        _check_disjoint(path, spans, 8 + length)
    _stacked_experts(entries)
    return entries


def _stacked_experts(entries: dict) -> None:
    """Per-expert entries for transformers 5's stacked experts (`mlp.experts.gate_up_proj`
    [E, 2F, H], gate rows then up rows; `mlp.experts.down_proj` [E, H, F]), the names
    published checkpoints and save_pretrained use: expert e's matrix is a run of whole
    rows of the stacked tensor viewed as 2-D, so it reads like any tensor."""
    for name, entry in list(entries.items()):
        match = STACKED_EXPERTS.search(name)
        if match is None or len(entry.shape) != 3 or entry.kind not in FORMAT_BYTES:
            continue
        prefix, kind = match.groups()
        experts, rows, width = entry.shape
        item = FORMAT_BYTES[entry.kind]
        parts = (("down_proj", 0, rows),) if kind == "down_proj" else \
            (("gate_proj", 0, rows // 2), ("up_proj", rows // 2, rows - rows // 2))
        for e in range(experts):
            for part, first, count in parts:
                entries.setdefault(f"{prefix}.{e}.{part}.weight",
                                   Entry(entry.path, entry.kind, (count, width),
                                         entry.start + (e * rows + first) * width * item, name))


# the format's floating-point dtypes the runtime reads a weight in
READ_KINDS = ("BF16", "F16", "F32", "F64")


def compare_with_model(model, entries: dict) -> tuple:
    """(problems, unused): what the runtime would refuse when it reads `model`'s weights
    from these entries — a tensor missing, of another shape or not in a floating-point
    dtype it reads, as (HF name, message) — and the names of the checkpoint's tensors no
    weight of the model reads. A critic's missing `score.weight` is no problem (it starts
    at zero), nor a tied model's extra `lm_head.weight`."""
    from .hf import hf_targets, tied_alias

    targets = hf_targets(model)
    problems = []
    for name, target in targets.items():
        entry = entries.get(name)
        if entry is None:
            if not target.tensor.endswith("/value_head.weight"):
                problems.append((name, f"lacks {name}, which {model.name} needs"))
        elif tuple(entry.shape) != tuple(target.shape):
            problems.append((name, f"holds {name} of shape {list(entry.shape)}, {model.name} needs "
                                   f"{list(target.shape)}"))
        elif entry.kind not in READ_KINDS:
            problems.append((name, f"holds {name} in dtype {entry.kind}, not a floating-point dtype Nereus reads "
                                   f"({', '.join(READ_KINDS)})"))
    read = set(targets) | {tied_alias(model)}
    if model.head == "value":  # a critic read from a causal LM's checkpoint leaves its head
        read.add("lm_head.weight")
    # a stacked expert tensor is read through its per-expert names (listed, not in the file)
    read |= {entries[n].stacked for n in read if n in entries and entries[n].stacked}
    unused = sorted(n for n, entry in entries.items() if not entry.stacked and n not in read)
    return problems, unused


_COMPARE_BYTES = 64 << 20  # bytes of each tensor read at a time by tied_head_conflict


def _same_bytes(a: Entry, b: Entry) -> bool:
    """Whether two entries hold the same dtype, shape and bytes (read in chunks)."""
    if (a.kind, tuple(a.shape)) != (b.kind, tuple(b.shape)) or a.kind not in FORMAT_BYTES:
        return False
    size = math.prod(a.shape) * FORMAT_BYTES[a.kind]
    with open(a.path, "rb") as first, open(b.path, "rb") as second:
        for offset in range(0, size, _COMPARE_BYTES):
            n = min(_COMPARE_BYTES, size - offset)
            first.seek(a.start + offset)
            second.seek(b.start + offset)
            if first.read(n) != second.read(n):
                return False
    return True


def tied_head_conflict(model, entries: dict):
    """For a tied model (config.json's tie_word_embeddings) whose checkpoint also holds an
    `lm_head.weight` that is not its embedding's bytes: the message saying so (transformers
    then unties the model and computes with the file's head; Nereus' tied head reads the
    embedding); else None. Reads the two tensors' data, only in that case."""
    from .hf import embedding_name, tied_alias, tied_head_mismatch

    alias = tied_alias(model)
    if alias is None or alias not in entries:
        return None
    embedding = entries.get(embedding_name(model))
    if embedding is not None and _same_bytes(entries[alias], embedding):
        return None
    return tied_head_mismatch(model)
