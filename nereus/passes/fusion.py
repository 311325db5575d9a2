"""fusion: Schedule → messages per round, one per (src GPU, dst GPU) pair, capped by a bucket.

Input: a `TransitionDag` and its `Schedule`. Output: for every round a tuple of `Message`s.
Invariant: the multiset of (transfer, slot) pairs is unchanged — fusion only regroups,
so a program writes exactly the same boxes with or without it (the verifier checks) — and
every message but the last of a pair carries ≤ `bucket` bytes where transfers allow (a
transfer bigger than the bucket is split along its layer range, down to one layer).

Messages of a pair keep their transfers in DAG order (segments in a fixed order: the
receiver unpacks by position). Without this pass (`unfused`) every send is its own message.
Transient buffers do not change: the resources pass already counts every send's bytes on
both GPUs of the round, and fusion neither adds nor moves bytes between rounds.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from functools import partial
from typing import Callable

from .dag import SEND, Piece, TransitionDag, Xfer
from .layout import box_volume, held_boxes, slot_specs
from .fitting import xfer_slice
from .resources import Schedule


_set = object.__setattr__  # Message is frozen: its own fields are set through object


class Message:
    """The sends of one (src, dst) pair in a round (or one bucket of them), in DAG order:
    an immutable record, equal and hashed by value like a frozen dataclass.

    `xfers` may be deferred (`Message.deferred`): `fuse` then merges a pair's transfers
    (`coalesce`) when `xfers` is first read, not while fusing. Everything that reads the
    whole program (cost, verify, JSON emission) reads every message's `xfers` and gets
    the same transfers; a rank program reads only its own rank's messages, so at 4,096
    GPUs the other 99.9% are never merged (their `src`, `dst` and `bytes`, which are
    known up front, are all it needs to number the ops)."""

    __slots__ = ("src", "dst", "bytes", "_xfers", "_make")

    def __init__(self, src: int, dst: int, xfers: tuple[Xfer, ...], bytes: int):
        _set(self, "src", src)
        _set(self, "dst", dst)
        _set(self, "bytes", bytes)
        _set(self, "_xfers", tuple(xfers))
        _set(self, "_make", None)

    @classmethod
    def deferred(cls, src: int, dst: int, make: Callable[[], list[Xfer]], nbytes: int) -> "Message":
        """A message whose transfers are `make()`, computed on the first read of `xfers`."""
        message = cls.__new__(cls)
        _set(message, "src", src)
        _set(message, "dst", dst)
        _set(message, "bytes", nbytes)
        _set(message, "_xfers", None)
        _set(message, "_make", make)
        return message

    @property
    def xfers(self) -> tuple[Xfer, ...]:
        if self._xfers is None:
            _set(self, "_xfers", tuple(self._make()))
            _set(self, "_make", None)
        return self._xfers

    def __setattr__(self, name, value):
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def _key(self) -> tuple:
        return self.src, self.dst, self.xfers, self.bytes

    def __eq__(self, other) -> bool:
        return type(other) is Message and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"Message(src={self.src!r}, dst={self.dst!r}, xfers={self.xfers!r}, bytes={self.bytes!r})"

    def __reduce__(self):
        return Message, self._key()


def unfused(schedule: Schedule) -> tuple[tuple[Message, ...], ...]:
    """One message per send transfer."""
    return tuple(tuple(Message(x.src_gpu, x.dst_gpu, (x,), x.bytes) for x in r.xfers if x.kind == SEND)
                 for r in schedule.rounds)


def fuse(dag: TransitionDag, schedule: Schedule, bucket: int | None = None) -> tuple[tuple[Message, ...], ...]:
    """Group each round's sends by (src, dst) pair, pairs in (src, dst) order; split at
    `bucket` bytes (None: no cap)."""
    out = []
    memo: dict = {}  # merged pieces of identical transfer groups (`coalesce`), shared by this call's messages
    for r in schedule.rounds:
        pairs: dict[tuple[int, int], list[Xfer]] = {}
        for x in r.xfers:
            if x.kind == SEND:
                key = (x.src_gpu, x.dst_gpu)
                found = pairs.get(key)
                if found is None:
                    pairs[key] = [x]
                else:
                    found.append(x)
        messages = []
        for key in sorted(pairs):
            xs = pairs[key]
            if len(xs) == 1 and (bucket is None or xs[0].bytes <= bucket):  # the common case at scale
                messages.append(Message(key[0], key[1], (xs[0],), xs[0].bytes))
                continue
            if bucket is None:  # one message per pair: its bytes are known, its merge can wait
                messages.append(Message.deferred(key[0], key[1], partial(coalesce, dag, xs, memo),
                                                 sum(x.bytes for x in xs)))
                continue
            for group in _buckets(dag, coalesce(dag, xs, memo), bucket):
                messages.append(Message(key[0], key[1], tuple(group), sum(x.bytes for x in group)))
        out.append(tuple(messages))
    return tuple(out)


def coalesce(dag: TransitionDag, xfers: list[Xfer], memo: dict | None = None) -> list[Xfer]:
    """Merge transfers of one GPU pair that read the same before shard into the same after
    shard over the same layers into one, and join adjacent pieces of one tensor (touching
    along dim 0, equal elsewhere) when the union stays inside one source box and one
    destination box, so that the receiver still unpacks each segment into one box.
    `memo` (optional, one compile's) keeps the merged pieces of a group by its shard
    positions and its transfers' piece tuples, which the dag shares between every GPU
    with the same recipe: at scale most groups repeat."""
    if len(xfers) == 1:
        return list(xfers)
    groups: dict[tuple, list[Xfer]] = {}
    for x in xfers:
        key = (x.stage, x.alloc, x.free, x.slots, x.states)
        found = groups.get(key)
        if found is None:
            groups[key] = [x]
        else:
            found.append(x)
    if len(groups) == len(xfers):
        return list(xfers)
    memo = {} if memo is None else memo
    out = []
    for (stage, alloc, free, slots, states), xs in groups.items():
        if len(xs) == 1:
            out.append(xs[0])
            continue
        src, dst = dag.frees[free], dag.allocs[alloc]
        key = (stage, states, src.replica, src.pos[1], dst.replica, dst.pos[1], tuple(id(x.pieces) for x in xs))
        found = memo.get(key)
        if found is None:
            # the entry holds the keyed tuples: their ids stay theirs while the memo lives
            found = memo[key] = (*_merged(dag.stages[stage], xs, src, dst, states), [x.pieces for x in xs])
        merged, volumes, _ = found
        x = xs[0]
        out.append(Xfer(x.kind, stage, alloc, free, x.src_gpu, x.dst_gpu, slots, merged,
                        sum(y.bytes for y in xs), volumes, states))
    return out


def _merged(info, xs: list[Xfer], src, dst, states) -> tuple[tuple[Piece, ...], tuple[int, int, int]]:
    """The pieces of `xs` sorted and joined where the union stays inside one source and one
    destination box (`coalesce`), and their volumes per slot kind."""
    specs = slot_specs(info.model)
    pieces = sorted((p for x in xs for p in x.pieces), key=lambda p: (p.spec, p.box))
    merged: list[Piece] = []
    for piece in pieces:
        if merged and merged[-1].spec == piece.spec:
            prev = merged[-1]
            if prev.box[0][1] == piece.box[0][0] and prev.box[1:] == piece.box[1:]:
                union = ((prev.box[0][0], piece.box[0][1]),) + piece.box[1:]
                spec = specs[piece.spec].spec
                if _within(union, held_boxes(spec, info.before, src.replica, src.pos[1], states)) and \
                        _within(union, held_boxes(spec, info.after, dst.replica, dst.pos[1], states)):
                    merged[-1] = Piece(piece.spec, union)
                    continue
        merged.append(piece)
    volumes = [0, 0, 0]
    for piece in merged:
        volumes[("first", "layer", "last").index(specs[piece.spec].kind)] += box_volume(piece.box)
    return tuple(merged), tuple(volumes)


def _within(box, boxes) -> bool:
    return any(all(a >= c and b <= d for (a, b), (c, d) in zip(box, outer)) for outer in boxes)


def _buckets(dag: TransitionDag, xfers: list[Xfer], bucket: int | None) -> list[list[Xfer]]:
    if bucket is None:
        return [xfers]
    groups: list[list[Xfer]] = [[]]
    size = 0
    queue = list(xfers)
    while queue:
        x = queue.pop(0)
        if size + x.bytes <= bucket or (not groups[-1] and x.slots[1] - x.slots[0] == 1):
            groups[-1].append(x)
            size += x.bytes
        elif x.slots[1] - x.slots[0] > 1 and x.bytes > bucket:
            # fill the open bucket with as many whole layers as fit, the rest goes on
            lo, hi = x.slots
            cut = lo + 1
            while cut < hi and xfer_slice(dag, x, lo, cut + 1).bytes + size <= bucket:
                cut += 1
            head = xfer_slice(dag, x, lo, cut)
            if size + head.bytes > bucket and groups[-1]:
                groups.append([])
                size = 0
                queue.insert(0, x)
                continue
            groups[-1].append(head)
            size += head.bytes
            queue.insert(0, xfer_slice(dag, x, cut, hi))
        else:
            groups.append([x])
            size = x.bytes
    return [g for g in groups if g]
