"""Per-peer packed streams: a round's packed pieces to one peer, cut into chunks that are
packed, sent and unpacked in a pipeline.

Why: NCCL runs the point-to-point ops of one communicator one after the other, and
hundreds of ops in both directions at once reach a fraction of the link (measured on 2
H200s, 2 GiB each way: one op 347 GB/s per direction, 64 ops 198 GB/s, 512 ops 60 GB/s).
So every piece of a round that does not travel in place (see `streamed`: small or
strided pieces, and with a peer exchanged with both ways every piece below a chunk), of
every message to one peer, joins one byte stream in message order; the
stream is cut into chunks of about `chunk_bytes` (a piece is split along its first
dimension where a chunk ends), and chunk k travels as one op on data group k % groups,
in one batch with every other peer's chunk k in both directions. The sender packs chunk
k + 1 while chunk k travels; the receiver unpacks chunk k while later chunks travel. A
ring of at most `depth` chunk buffers per peer and direction bounds the memory: a slot
is packed again only after its previous chunk's batch completed, and received into
again only after its previous chunk was unpacked (on CUDA these waits are stream
waits: the host runs ahead and only the device waits).

A chunk of one contiguous segment (a piece larger than a chunk is cut into such chunks)
travels in place on a side whose view is contiguous: sent from or received into the
tensor itself, with no pack, unpack or ring slot, while the other side may still pack
or unpack it (a dim-1 slice). With `alone_bytes` set (NEREUS_P2P_ALONE_BYTES), every
piece from that size on travels in chunks of its own and so in place where contiguous.
It is off by default: measured on 2 H200s (benchmarks/RESULTS.md, "in-place chunks"),
more and smaller batches cost more host time per op than the saved copies gave back.

Input: the wires' packed views (sender: source views; receiver: destination views, the
same shapes in the same order). Output: the destination views written. Invariant: a
sender and its receiver derive the same chunks, tags and groups from the shapes alone,
and every rank posts every op whatever fails locally (a failed pack sends garbage and is
reported), so no peer waits forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import env_flag, env_number

from . import offload, packing
# chunk planning lives in chunks.py; these names are re-exported here, where callers look
from .chunks import FUSED_MIN_SEGMENTS, ChunkPlan, SegmentPlan, cut, fused, nbytes_of, plan, ring  # noqa: F401

STREAM_TAG = 1 << 20  # gloo tags of stream chunks start here (direct pieces: from 0)
# chunk size and ring depth; 128 MiB x 8 slots = 1 GiB of buffers per peer and direction
# at most (NEREUS_P2P_CHUNK_BYTES, NEREUS_P2P_DEPTH)
CHUNK_BYTES = env_number("NEREUS_P2P_CHUNK_BYTES", 128 << 20, 1 << 10)
DEPTH = env_number("NEREUS_P2P_DEPTH", 8, 1)
# pieces of this many bytes or more travel as chunks of their own, in place where contiguous
# (NEREUS_P2P_ALONE_BYTES; 0: never, the default: on 2 H200s, from 4 or 16 MiB on it made a
# TP -> DP change of 8B-shaped weights 7-16% slower and a weight sync to tp 2 25% slower:
# each op is one more batch of host work, and the device waited for the posts)
ALONE_BYTES = env_number("NEREUS_P2P_ALONE_BYTES", 0, 0)
# whether a chunk of one contiguous segment travels in place (0: always through a slot, as
# before; for measuring; NEREUS_P2P_IN_PLACE)
IN_PLACE = env_flag("NEREUS_P2P_IN_PLACE", True)
# with a peer exchanged with both ways, a piece the lowering marked direct still joins the
# stream below this many bytes (0: below one chunk, the default; NEREUS_P2P_BOTH_DIRECT_MIN)
BOTH_DIRECT_MIN = env_number("NEREUS_P2P_BOTH_DIRECT_MIN", 0, 0)


def streamed(piece, both_ways: bool, chunk_bytes: int) -> bool:
    """Whether a piece travels in its peer's stream rather than in place as its own op:
    every piece the lowering did not mark direct (small or strided), and, with a peer
    this rank both sends to and receives from in the round, every piece smaller than a
    chunk (many ops in both directions at once are what NCCL serializes; one direction
    reached 1.00-1.13x of the link with in-place ops). Both sides of a message derive the
    same answer: each knows the round's traffic in both directions with the other."""
    return not piece.direct or (both_ways and piece.nbytes < (BOTH_DIRECT_MIN or chunk_bytes))


def chunk_views(views: list, chunk_bytes: int, alone_bytes: Optional[int] = None) -> list:
    """[[segment view]]: `views` in order, cut into chunks of at most `chunk_bytes` packed
    bytes (chunks.cut: a row larger than a chunk travels alone; a view is split along its
    first dimension). A view of `alone_bytes` or more (default ALONE_BYTES; 0: no such
    rule) shares no chunk. Depends on shapes and dtypes only (works on meta tensors), so
    both sides of a stream cut it alike."""
    alone_bytes = ALONE_BYTES if alone_bytes is None else alone_bytes
    return [[segment for _, segment, _ in chunk] for chunk in cut(views, chunk_bytes, alone_bytes)]


def plan_chunks(views: list, chunk_bytes: int, alone_bytes: Optional[int] = None,
                counts: Optional[list] = None) -> tuple:
    """The chunks of a stream, once per program: `views` are the pieces' regions as views
    of meta tensors of their local tensors' shapes (storage offset 0), cut as
    `chunk_views` cuts them; `counts[i]` (default 1): view i stands for that many views
    of the same shape (a piece of several tensors), planned as runs (chunks.plan), not
    one by one. `PeerStream.planned` turns them into views of the live tensors with one
    `as_strided` per segment and tensor, instead of slicing every piece and cutting the
    stream again on every execution."""
    alone_bytes = ALONE_BYTES if alone_bytes is None else alone_bytes
    return plan(views, chunk_bytes, alone_bytes, IN_PLACE, counts)


def in_place(segments: list, kind: str) -> bool:
    """Whether a chunk travels from or into its one segment itself: a single contiguous
    segment in the stream's memory (`kind`, the buffer's device type). Each side decides
    for its own view; the op's size is the segment's bytes either way."""
    return IN_PLACE and len(segments) == 1 and segments[0].is_contiguous() and segments[0].device.type == kind


def chunk_nbytes(segments: list) -> tuple:
    """(offsets, bytes on the wire) of a chunk: the aligned packed layout, or for one
    segment its exact bytes (what an in-place op of either side moves)."""
    if len(segments) == 1:
        return (0,), nbytes_of(segments[0])
    return packing.layout([nbytes_of(v) for v in segments])


def slot_sizes(chunks: list, kind: str, depth: int) -> list:
    """Bytes of each ring slot of a stream cut into `chunks` (see PeerStream): slot i holds
    the chunks i, i + depth, ... that do not travel in place."""
    return ring([0 if in_place(c, kind) else chunk_nbytes(c)[1] for c in chunks], depth)


@dataclass
class Chunk:
    views: Optional[list]  # None until PeerStream.chunk takes them (a planned stream)
    offsets: tuple
    nbytes: int
    fused: bool  # many small segments: the fused (Triton) pack pays; few large ones: plain copies
    crossing: bool = False  # some segment lives in another memory than the buffer (offloaded host shards)
    wire: Optional[torch.Tensor] = None  # in place: the one segment's bytes, sent from / received into directly


class PeerStream:
    """One direction of one round's stream with one peer: its chunks and ring slots."""

    # per chunk, a Replay that packs or unpacks it with no view taken, and the table of
    # this call's addresses it reads (replay.bind_stream sets them; None: the torch or
    # per-call kernel path of pack_chunk / unpack_chunk); `binder`, when set, sets them at
    # the first pack or unpack (a receive stream: after the first posts)
    replays: Optional[list] = None
    table: Optional[torch.Tensor] = None
    binder: Optional[Callable] = None

    def __init__(self, peer: int, views: list, device, chunk_bytes: int = CHUNK_BYTES, depth: int = DEPTH,
                 alone_bytes: Optional[int] = None):
        self.peer = peer
        self.chunks = []
        kind = torch.device(device).type
        for segments in chunk_views(views, chunk_bytes, alone_bytes):
            offsets, total = chunk_nbytes(segments)
            # segments in another memory than the buffer's (an offloaded unit's host shards)
            # cross PCIe through offload.pack/unpack: the fused kernels address one device
            crossing = any(v.device.type != kind for v in segments)
            wire = segments[0].reshape(-1).view(torch.uint8) if in_place(segments, kind) else None
            self.chunks.append(Chunk(segments, offsets, total, not crossing and fused(segments), crossing, wire))
        self.in_place = [c.wire is not None for c in self.chunks]
        self._ring_slots(device, depth)

    @classmethod
    def planned(cls, peer: int, plans: tuple, tensors: list, device, depth: int = DEPTH) -> "PeerStream":
        """The stream of `plan_chunks` plans over the live tensors: `tensors[i]` is the
        (contiguous) local tensor of the plan's view i, or a function of no arguments that
        allocates it on `device` (a destination the round deferred; never in a chunk that
        travels in place). The same chunks as the constructor gives for those views; a
        chunk's views are taken when the exchange first needs them (`chunk`: a receive
        when it unpacks the chunk), so taking them, and allocating deferred destinations,
        overlaps the transfers of the chunks before."""
        stream = cls.__new__(cls)
        stream.peer = peer
        kind = torch.device(device).type
        away = [not callable(t) and t.device.type != kind for t in tensors]
        stream.chunks, stream.in_place = [], []
        stream._plans, stream._tensors = plans, tensors  # views are taken from these by `chunk`
        for plan in plans:
            crossing = any(away[s.view + i] for s in plan.segments for i in range(s.count))
            stream.chunks.append(Chunk(None, plan.offsets, plan.nbytes, not crossing and plan.fused, crossing))
            stream.in_place.append(plan.single and not crossing)
        stream._ring_slots(device, depth)
        return stream

    def chunk(self, k: int) -> Chunk:
        """Chunk k, its views taken now if the stream was planned and they were not yet."""
        chunk = self.chunks[k]
        if chunk.views is None:
            tensors, views = self._tensors, []
            plan = self._plans[k]
            for s in plan.segments:
                for i in range(s.view, s.view + s.count):
                    tensor = tensors[i]
                    if callable(tensor):  # a deferred destination: allocated now, once
                        tensor = tensors[i] = tensor()
                    views.append(tensor.as_strided(s.shape, s.stride, tensor.storage_offset() + s.offset))
            chunk.views = views
            if plan.views != len(plan.segments):  # a segment of several views: each view's offset
                chunk.offsets = plan.member_offsets()
            if self.in_place[k]:  # its ring slot is sized 0
                chunk.wire = chunk.views[0].reshape(-1).view(torch.uint8)
        return chunk

    def _ring_slots(self, device, depth: int) -> None:
        self.depth = max(1, depth)
        # slot i holds chunks i, i + depth, ... that are not in place: sized for the largest
        # (the sum over slots stays within the stream's packed bytes)
        sizes = [0 if wired else c.nbytes for c, wired in zip(self.chunks, self.in_place)]
        self.slots = [torch.empty(n, dtype=torch.uint8, device=device) for n in ring(sizes, self.depth)]

    def _replay(self, k: int):
        """Chunk k's Replay (the stream bound first, once), or None."""
        if self.binder is not None:
            binder, self.binder = self.binder, None
            binder(self)
        return self.replays[k] if self.replays is not None else None

    def pack(self, k: int) -> None:
        """Pack chunk k into what it travels in (nothing for a chunk sent in place)."""
        replay = self._replay(k)
        if replay is not None:
            replay.run(self.table)
        else:
            pack_chunk(self.chunk(k), self.buffer(k))

    def unpack(self, k: int) -> Optional[offload.HostUnpack]:
        """Unpack received chunk k (see `unpack_chunk`)."""
        replay = self._replay(k)
        if replay is not None:
            replay.run(self.table)
            return None
        return unpack_chunk(self.chunk(k), self.buffer(k))

    @property
    def buffer_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def buffer(self, k: int) -> torch.Tensor:
        """What chunk k travels in: its one segment itself, or its ring slot (a planned
        chunk's views are not taken for this)."""
        if self.in_place[k]:
            return self.chunk(k).wire
        return self.slots[k % self.depth][:self.chunks[k].nbytes]


def pack_chunk(chunk: Chunk, buffer: torch.Tensor) -> None:
    if chunk.wire is not None:  # sent from the tensor itself
        return
    if chunk.crossing:  # host segments: packed in (pinned) host memory, then one PCIe copy (offload.py)
        offload.pack(chunk.views, chunk.offsets, buffer)
    elif chunk.fused:
        packing.pack(chunk.views, chunk.offsets, chunk.nbytes, out=buffer)
    else:
        packing.torch_pack(chunk.views, chunk.offsets, chunk.nbytes, out=buffer)


def unpack_chunk(chunk: Chunk, buffer: torch.Tensor) -> Optional[offload.HostUnpack]:
    """Unpack a received chunk; a chunk into host memory returns its HostUnpack, written
    only once the caller finishes it (the device→host copy is queued)."""
    if chunk.wire is not None:  # received into the tensor itself
        return None
    if chunk.crossing:  # one PCIe copy into pinned host memory, then unpacked there (offload.py)
        return offload.unpack(buffer, chunk.views, chunk.offsets)
    if chunk.fused:
        packing.unpack(buffer, chunk.views, chunk.offsets)
    else:
        packing.torch_unpack(buffer, chunk.views, chunk.offsets)
    return None


def exchange(sends: list, recvs: list, groups, depth: int = DEPTH,
             on_unpacked: Optional[Callable[[PeerStream, int], None]] = None,
             after_first: Optional[Callable[[], None]] = None) -> Optional[tuple]:
    """Collective among the streams' peers: move every chunk of `sends` and `recvs`
    (PeerStreams of one depth). Posts one batch per chunk index, on data group index % len(groups).
    Returns the first local failure as (step, peer, exception), or None; failures do not
    stop the posting. The exception comes without its traceback: kept in this frame, it
    would tie the frame (and its callers', the groups) into a reference cycle.
    `on_unpacked(stream, k)` runs after chunk k of a receive stream was unpacked (tests).
    `after_first()` runs once the first batch is posted (at once when there is none): the
    executor queues the round's same-GPU copies there, so their launches do not delay the
    first bytes on the link; it must not raise."""
    groups = list(groups) if isinstance(groups, (list, tuple)) else [groups]
    steps = max((len(s.chunks) for s in sends + recvs), default=0)
    batches: list = []
    failure = None
    into_host: list = []  # (HostUnpack, stream, k) in chunk order: copies into host memory under way

    def finish(wait: bool) -> None:  # host unpacks whose device→host copy is done (all: wait)
        nonlocal failure
        while into_host:
            job, r, k = into_host[0]
            try:  # nothing may escape: the posting goes on whatever fails
                if not (wait or job.ready()):
                    return
                del into_host[0]
                if failure is None:
                    job.finish()
                    if on_unpacked is not None:
                        on_unpacked(r, k)
            except Exception as error:  # noqa: BLE001 - reported after
                if into_host and into_host[0][0] is job:
                    del into_host[0]
                failure = failure or ("unpack recv", r.peer, error.with_traceback(None))

    def drain(k: int) -> None:  # batch k is done: its receive slots hold chunk k
        nonlocal failure
        for req in batches[k]:
            req.wait()
        batches[k] = []
        for r in recvs:
            if k < len(r.chunks) and failure is None:
                try:
                    job = r.unpack(k)
                    if job is not None:  # its slot is free for chunk k + depth: the copy out is queued before
                        into_host.append((job, r, k))
                    elif on_unpacked is not None:
                        on_unpacked(r, k)
                except Exception as error:  # noqa: BLE001 - keep posting; reported after
                    failure = ("unpack recv", r.peer, error.with_traceback(None))
        finish(wait=False)

    for k in range(steps):
        if k >= depth:  # the slots of chunk k are free once batch k - depth is done and unpacked
            drain(k - depth)
        group = groups[k % len(groups)]
        ops = []
        for s in sends:
            if k < len(s.chunks):
                if failure is None:
                    try:
                        s.pack(k)
                    except Exception as error:  # noqa: BLE001 - the (garbage) chunk is sent anyway
                        failure = ("pack send", s.peer, error.with_traceback(None))
                ops.append(dist.P2POp(dist.isend, s.buffer(k), s.peer, group, STREAM_TAG + k))
        for r in recvs:
            if k < len(r.chunks):
                ops.append(dist.P2POp(dist.irecv, r.buffer(k), r.peer, group, STREAM_TAG + k))
        batches.append(dist.batch_isend_irecv(ops) if ops else [])
        if k == 0 and after_first is not None:
            after_first()
    if steps == 0 and after_first is not None:
        after_first()
    for k in range(max(0, steps - depth), steps):
        drain(k)
    finish(wait=True)
    return failure
