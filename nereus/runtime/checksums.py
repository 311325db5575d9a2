"""verify=True: the checksums a message's sender and receiver compare (rounds.run_round).

    message_sums(msg, tensors, shards, sending) -> [int, ...]   # 2 per piece, then the message's label
    mismatch(msg, got, sent) -> str                              # what differs, for the error

Input: a Message of this rank's work list, the live local tensors ({unit: {tensor: local
tensor}}: the sender's sources, or the receiver's new shards after the unpack) and the
program's shards on this GPU ({unit: {tensor: ShardInfo}}). Output: per piece two sums of
the bytes of the global box the piece names, read from the local tensor through the
shard's boxes (boxes.local_slices), not through the piece's slices or the execution
plan's regions that packing and unpacking use; then a number of the message's labels
(part_check.message_digest: every piece's tensor, units, box, bytes, in order).

Why: a sender that checksums the bytes it packed, and a receiver the bytes that arrived,
agree whenever the wire is sound, even when the bytes came from the wrong place. Here the
sender checksums the region the receiver expects (the piece's box in its source shard)
and the receiver the region it expects written (the box in its new shard): a pack that
reads the wrong rows, an unpack that writes them elsewhere, or sender and receiver that
disagree on a piece's box or order (the label) differ. A piece of several parts
(program.JOIN_PARTS, off) is read through its own region.
"""

from __future__ import annotations

import torch

from . import packing
from .boxes import box_numel, cut_segment, local_slices
from .part_check import message_digest
from .wires import dst_region, src_region


def box_content(tensor: torch.Tensor, boxes: tuple, box: tuple) -> torch.Tensor:
    """The elements of global `box` in `tensor`, the local tensor of a shard made of
    `boxes` (stacked along dim 0), in global row-major order."""
    bands = sorted(cut_segment(box, boxes, (box,)), key=lambda cut: cut[2][0][0] if cut[2] else 0)
    views = [tensor[local_slices(boxes, i, part)] for i, _, part in bands]
    if sum(box_numel(part) for _, _, part in bands) != box_numel(box):
        raise ValueError(f"box {[list(b) for b in box]} lies outside the shard {[[list(b) for b in s] for s in boxes]}")
    return views[0] if len(views) == 1 else torch.cat(views)


def message_sums(msg, tensors: dict, shards: dict, sending: bool) -> list:
    """[sum, weighted sum] per tensor of each piece of `msg` (a v2 range's piece moves the
    same box of each of its tensors), then its label number (module docstring)."""
    out = []
    for p in msg.pieces:
        unit = p.src_unit if sending else p.dst_unit
        for name in p.tensors:
            tensor = tensors[unit][name]
            if p.parts > 1:
                view = (src_region if sending else dst_region)(p, tensor)
            else:
                view = box_content(tensor, shards[unit][name].boxes, p.box)
            out.extend(packing.checksum(view))
    return out + [int(message_digest(msg)[:15], 16)]


def mismatch(msg, got: list, sent: list) -> str:
    """Which tensor of which piece of `msg` the two `message_sums` tell apart first, or its labels."""
    i = 0
    for k, p in enumerate(msg.pieces):
        for name in p.tensors:
            if got[2 * i:2 * i + 2] != sent[2 * i:2 * i + 2]:
                return f"piece {k} ({name} {[list(b) for b in p.box]}) differs from the sender's source region"
            i += 1
    return "the sender labels its pieces otherwise (tensor, box, units or order)"
