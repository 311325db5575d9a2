"""quantize: a weight sync's JSON program → the same sync into FP8 generation weights.

Input: a whole JSON program v1 (docs/program.md) of a weight sync (nereus.runtime.
vllm_sync: before units = the training layout, after units = the generation layout), the
global names of the weights the generation layout holds in FP8
(nereus.models.quant.quantized_names) and the block size.
Output: a new program (docs/program.md, "Weight-sync codecs") with
  - header field `quant` = {"format": "fp8_e4m3", "block": [B, B], "scale_dtype": "fp32",
    "tensors": [...]}: the after shards of these tensors hold e4m3 codes (1 byte) and one
    fp32 scale per block of their local tensor (nereus.ir.scale_blocks);
  - every keep of a quantized tensor turned into a copy (a bf16 shard cannot be handed
    over as an FP8 one); copy and send bytes counted at 1 byte per quantized element plus
    4 bytes per scale the segment carries (the blocks whose origin it writes); alloc and
    free bytes recomputed accordingly;
  - `amax` ops in round 0, before its transfers: where a block's elements come from more
    than one GPU (a training split that cuts a block), every such GPU sends each other one
    its partial amax over the parts of the block it writes, so that each computes the
    block's scale from the whole block;
  - op ids renumbered in program order.
Invariant: the segments are the dense program's, in the same rounds (every after box is
written exactly once from the same source); every block's scale is computed by each of
its writers from the whole block. `nereus.passes.verify` proves both (verify_codec.py).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Iterable

from nereus.ir.diagnostics import ProgramError
from nereus.ir.model import DTYPE_BYTES
from nereus.ir.scale_blocks import (block_rect, boundary, intersect, local_shape, scales_in, shard_scales, to_global,
                                    to_local)
from nereus.models.quant import BLOCK, FORMAT, SCALE_BYTES

ELEMENT_BYTES = dict(DTYPE_BYTES, int64=8, int32=4, uint8=1, fp64=8)


def shard_index(units: list) -> dict:
    """(unit id, gpu, tensor) → its boxes as tuples."""
    return {(u["id"], s["gpu"], s["tensor"]): tuple(tuple(tuple(r) for r in b) for b in s["boxes"])
            for u in units for s in u["shards"]}


def volume(box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def as_box(raw) -> tuple:
    return tuple((int(lo), int(hi)) for lo, hi in raw)


class Sizes:
    """Byte counts of a quantized program's segments and shards (shared with the verifier)."""

    def __init__(self, tensors: dict, after: dict, quantized: set, block: int):
        self.tensors, self.after, self.quantized, self.block = tensors, after, quantized, block

    def element(self, name: str) -> int:
        return ELEMENT_BYTES[self.tensors[name]["dtype"]]

    def segment(self, seg: dict, dst_gpu: int) -> int:
        """Bytes a segment moves: dense, or 1 per element + its scales when quantized."""
        box, name = as_box(seg["box"]), seg["tensor"]
        if name not in self.quantized:
            return volume(box) * self.element(name)
        boxes = self.after[(seg["dst_unit"], dst_gpu, name)]
        return volume(box) + SCALE_BYTES * scales_in(boxes, box, self.block)

    def dense_segment(self, seg: dict) -> int:
        return volume(as_box(seg["box"])) * self.element(seg["tensor"])

    def shard(self, name: str, boxes) -> int:
        """Bytes of an after shard: dense, or 1 per element + 4 per block when quantized."""
        numel = sum(volume(b) for b in boxes)
        if name not in self.quantized:
            return numel * self.element(name)
        return numel + SCALE_BYTES * shard_scales(boxes, self.block)


def quantize_program(program: dict, names: Iterable[str], block: int = BLOCK) -> dict:
    """See the module docstring. Raises ProgramError on a program it cannot quantize (not
    version 1 with segments per op, a named tensor that is not 2-D)."""
    if program.get("version") != 1 or any("src_unit" in op for rnd in program["rounds"] for op in rnd["ops"]):
        raise ProgramError("quantize reads whole programs of version 1",
                           hint="emit the sync with program_json(compiled) (version 1), not a rank part")
    data = copy.deepcopy(program)
    tensors = {t["name"]: t for t in data["tensors"]}
    after = shard_index(data["units"]["after"])
    held = {name for (_, _, name) in after}
    wanted = set(names)
    quantized = [t["name"] for t in data["tensors"] if t["name"] in wanted and t["name"] in held]
    for name in quantized:
        if len(tensors[name]["shape"]) != 2:
            raise ProgramError(f"cannot quantize {name}: block FP8 scales 2-D weights, it has shape "
                               f"{tensors[name]['shape']}", hint="nereus.models.quant names the FP8 weights")
    q = set(quantized)
    sizes = Sizes(tensors, after, q, block)
    _keeps_to_copies(data, q)
    kept_into, kept_out = defaultdict(int), defaultdict(int)
    for rnd in data["rounds"]:
        for op in rnd["ops"]:
            if op["op"] == "keep":
                for s in op["segments"]:
                    kept_into[(s["dst_unit"], op["gpu"])] += sizes.dense_segment(s)
                    kept_out[(s["src_unit"], op["gpu"])] += sizes.dense_segment(s)
            elif op["op"] in ("copy", "send"):
                dst = op["gpu"] if op["op"] == "copy" else op["dst"]
                op["bytes"] = sum(sizes.segment(s, dst) for s in op["segments"])
    after_bytes, before_bytes = defaultdict(int), defaultdict(int)
    for (unit, gpu, name), boxes in after.items():
        after_bytes[(unit, gpu)] += sizes.shard(name, boxes)
    for (unit, gpu, name), boxes in shard_index(data["units"]["before"]).items():
        before_bytes[(unit, gpu)] += sum(volume(b) for b in boxes) * sizes.element(name)
    for rnd in data["rounds"]:
        for op in rnd["ops"]:
            if op["op"] == "alloc":
                op["bytes"] = after_bytes[(op["unit"], op["gpu"])] - kept_into[(op["unit"], op["gpu"])]
            elif op["op"] in ("free", "stage_out"):
                op["bytes"] = before_bytes[(op["unit"], op["gpu"])] - kept_out[(op["unit"], op["gpu"])]
    amax = amax_ops(data["rounds"], after, q, block)
    if amax:
        ops = data["rounds"][0]["ops"]
        at = next((i for i, op in enumerate(ops) if op["op"] != "alloc"), len(ops))
        ops[at:at] = amax
    n = 0
    for k, rnd in enumerate(data["rounds"]):
        for op in rnd["ops"]:
            op["id"], op["round"] = n, k
            n += 1
    data["quant"] = {"format": FORMAT, "block": [block, block], "scale_dtype": "fp32", "tensors": quantized}
    return data


def _keeps_to_copies(data: dict, quantized: set) -> None:
    """Each keep's segments of quantized tensors move to a copy on the same GPU, right after it."""
    for rnd in data["rounds"]:
        ops = []
        for op in rnd["ops"]:
            if op["op"] != "keep":
                ops.append(op)
                continue
            moved = [s for s in op["segments"] if s["tensor"] in quantized]
            rest = [s for s in op["segments"] if s["tensor"] not in quantized]
            if rest:
                ops.append(dict(op, segments=rest))
            if moved:
                ops.append({"op": "copy", "gpu": op["gpu"], "segments": moved, "bytes": 0})
        rnd["ops"] = ops


def writers(rounds: list, after: dict, quantized: set) -> dict:
    """(dst unit, gpu, tensor) of each quantized after shard → [(source GPU, source unit,
    local rect)] of every segment written into it (copies and sends, any round)."""
    out: dict = defaultdict(list)
    for rnd in rounds:
        for op in rnd["ops"]:
            if op["op"] not in ("copy", "send", "keep"):
                continue
            src = op["src"] if op["op"] == "send" else op["gpu"]
            dst = op["dst"] if op["op"] == "send" else op["gpu"]
            for s in op["segments"]:
                if s["tensor"] not in quantized:
                    continue
                key = (s["dst_unit"], dst, s["tensor"])
                for rect in to_local(after[key], as_box(s["box"])):
                    out[key].append((src, s["src_unit"], rect))
    return out


def straddling(boxes, written: list, block: int) -> dict:
    """{(i, j): [(source GPU, source unit, rect), ...]} of the blocks of a shard that two or
    more GPUs write (only blocks some write does not hold whole can be such blocks)."""
    shape = local_shape(boxes)
    per_block: dict = defaultdict(list)
    for src, su, rect in written:
        for b in boundary(rect, shape, block):
            per_block[b].append((src, su, rect))
    return {b: items for b, items in sorted(per_block.items()) if len({src for src, _, _ in items}) > 1}


def amax_ops(rounds: list, after: dict, quantized: set, block: int) -> list:
    """The `amax` ops of a program (module docstring): one per (sender, receiver) pair of
    GPUs that write parts of a common block, listing per block the sender's parts."""
    entries: dict = defaultdict(list)
    for key, written in writers(rounds, after, quantized).items():
        unit, gpu, name = key
        shape = local_shape(after[key])
        for (i, j), items in straddling(after[key], written, block).items():
            whole = block_rect(i, j, shape, block)
            gpus = sorted({src for src, _, _ in items})
            for d in gpus:
                parts = [{"src_unit": su, "box": [list(r) for r in g]} for src, su, rect in items if src == d
                         for g in to_global(after[key], intersect(rect, whole))]
                for c in gpus:
                    if c != d:
                        entries[(d, c)].append({"tensor": name, "dst_unit": unit, "gpu": gpu, "block": [i, j],
                                                "parts": parts})
    return [{"op": "amax", "src": d, "dst": c, "entries": found, "bytes": 4 * len(found)}
            for (d, c), found in sorted(entries.items())]
