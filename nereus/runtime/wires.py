"""A round's tensors on one rank: destination shards, message views and stream buffers.

The executor's bookkeeping, apart from its control flow: `allocate`/`destination` make
after-shards (on the device and counted in `Live`, or in host memory for an offloaded
unit), `outgoing`/`incoming` cut a message into the pieces that travel in place and
those that join the peer's packed stream (`planned_streams`, streams.py), `copy_stream`
gives same-GPU copies their side stream, and `check_complete` proves every element of
every after-shard was produced. Input: a RankProgram's round and the live tensors.
Invariant: `Live` counts each storage once, so aliases never count twice, and it counts
device memory only (an offloaded unit's host shards are never device bytes).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch

from nereus.ir.diagnostics import ProgramError

from . import offload, streams
from .program import Message, RankProgram

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                "fp64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}



class Live:
    """Live bytes on this GPU, counted once per storage (aliases share one)."""

    def __init__(self, base: int):
        self.count: dict = {}
        self.bytes = base
        self.peak = base
        self.reserved: dict = {}  # (unit, tensor) -> bytes counted before the shard is allocated

    def reserve(self, key: tuple, nbytes: int) -> None:
        """Count a shard that will be allocated later in the round (deferred) from now on,
        so the peak is that of allocating it now, as the compiler's replay does."""
        if key not in self.reserved:
            self.reserved[key] = nbytes
            self.bytes += nbytes
            self.peak = max(self.peak, self.bytes)

    def claim(self, key: tuple) -> None:
        """Right before a reserved shard is allocated (and added): its reservation goes."""
        self.bytes -= self.reserved.pop(key, 0)

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()  # one storage object per call: thousands of shards in an EP transition
        key = storage.data_ptr()
        count = self.count.get(key, 0)
        if count == 0:
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        self.count[key] = count + 1

    def remove(self, tensor: torch.Tensor) -> None:
        key = tensor.untyped_storage().data_ptr()
        self.count[key] -= 1
        if self.count[key] == 0:
            self.bytes -= tensor.untyped_storage().nbytes()


@dataclass
class Wire:
    """A message on the wire: its direct pieces (sent from / received into the shards in
    place); its packed pieces travel in the peer's stream (streams.py, from the plan)."""

    msg: Message
    direct: list  # contiguous views sent from / received into in place
    bounce: list = field(default_factory=list)  # (device tensor, host view) of direct pieces into host memory


def outgoing(msg: Message, sources: dict, device, in_stream: list, regions: tuple, host_units=frozenset()) -> Wire:
    """regions: the pieces' source Regions (execution_plan). host_units: before-units read
    from host memory (offloaded or staged out). A piece of several tensors (a v2 range)
    gives one view per tensor, in order."""
    direct = []
    for p, streamed, r in zip(msg.pieces, in_stream, regions):
        if not streamed:
            shards = sources[p.src_unit]
            direct.extend(r.view(shards[name]) for name in p.tensors)
    # staged or offloaded: host → device, queued (a pinned source records its copy; a
    # pageable one is copied before `to` returns)
    direct = [v.to(device, non_blocking=True) for v in direct]
    if not all(v.is_contiguous() for v in direct):
        raise ProgramError("a direct piece is not contiguous in its source tensor")
    return Wire(msg, direct)


def incoming(msg: Message, prog: RankProgram, new: dict, live: "Live", device, in_stream: list, regions: tuple,
             host_units=frozenset(), deferred=frozenset()) -> Wire:
    """Allocates every piece's destination shard (where no alloc came first) but those in
    `deferred` (streamed pieces only: allocated when their chunk is unpacked); regions as
    in `outgoing`."""
    direct = []
    for p, streamed, r in zip(msg.pieces, in_stream, regions):
        for name in p.tensors:
            tensor = None if (p.dst_unit, name) in deferred else \
                destination(prog, new, live, device, p.dst_unit, name, host_units)
            if not streamed:
                direct.append(r.view(tensor))
    bounce = []
    if torch.device(device).type == "cuda":  # NCCL receives into device memory only
        bounce = [(torch.empty(v.shape, dtype=v.dtype, device=device), v) for v in direct if not v.is_cuda]
        landing = {id(v): b for b, v in bounce}
        direct = [landing.get(id(v), v) for v in direct]
    return Wire(msg, direct, bounce)


@dataclass(frozen=True)
class Region:
    """Where a piece lies in its local tensor, from the shapes alone: the tensor itself
    (`whole`) or its view of `shape` and `stride` starting `offset` elements past the
    tensor's storage offset. Holds for any contiguous tensor of the shard's shape (every
    before-shard is checked contiguous; after-shards are allocated so)."""

    whole: bool
    shape: tuple = ()
    stride: tuple = ()
    offset: int = 0

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.whole:
            return tensor
        return tensor.as_strided(self.shape, self.stride, tensor.storage_offset() + self.offset)


def region(piece, meta: torch.Tensor, source: bool) -> Region:
    """The Region of a piece's source (or destination) side, from a meta tensor of the
    shard's shape (storage offset 0)."""
    whole = piece.src_whole if source else piece.dst_whole
    if whole:
        return Region(True)
    view = src_region(piece, meta) if source else dst_region(piece, meta)
    return Region(False, tuple(view.shape), tuple(view.stride()), view.storage_offset())


def piece_region(tensor: torch.Tensor, slices: tuple, whole: bool, parts: int = 1, step: int = 0) -> torch.Tensor:
    """A piece's region of a local tensor: the tensor itself when whole, its slice, or
    for a piece of `parts` parts a view [rows, parts, *rest] whose part k lies `k x step`
    rows further (program.Piece). Rows stay the first dimension, so a stream still cuts
    the piece into rows of a few parts' rows each (streams.chunk_views), never into a
    whole part; both sides view their pieces alike, so the bytes travel in that order."""
    if whole:
        return tensor
    view = tensor[slices]
    if parts == 1:
        return view
    return view.as_strided((view.shape[0], parts) + tuple(view.shape[1:]),
                           (view.stride(0), step * tensor.stride(0)) + view.stride()[1:], view.storage_offset())


def src_region(piece, tensor: torch.Tensor) -> torch.Tensor:
    """`piece_region` of the piece's source side in `tensor` (its before-shard)."""
    return piece_region(tensor, piece.src_slices, piece.src_whole, piece.parts, piece.src_step)


def dst_region(piece, tensor: torch.Tensor) -> torch.Tensor:
    """`piece_region` of the piece's destination side in `tensor` (its after-shard)."""
    return piece_region(tensor, piece.dst_slices, piece.dst_whole, piece.parts, piece.dst_step)


def round_buffer_bytes(planned, work, depth: int, host_sources=frozenset(), host_after=frozenset()) -> int:
    """Device bytes a CUDA device allocates for a round's messages on this rank, from its
    plan (execution_plan.RoundPlan) alone: the ring slots of every packed stream
    (streams.slot_sizes; a chunk with a segment in host memory never travels in place),
    the direct pieces read from host memory (`outgoing` copies each to the device whole)
    and those written into host memory (`incoming`'s bounce tensors). host_sources:
    before-units read from host memory (offloaded or staged out); host_after: offloaded
    after-units. The executor counts this on every device, so a run on CPU accounts its
    buffers as a GPU allocates them; it never exceeds what the program's memory model
    proves (nereus.passes.memory_model; tests/runtime/test_memory_model_cuda.py measures
    it on a GPU)."""
    total = 0
    for plans, host, source in ((planned.send_streams, host_sources, True), (planned.recv_streams, host_after, False)):
        for plan in plans:
            def away(segment) -> bool:  # the segment's piece (its tensors) lies in host memory
                piece = plan.member(segment.view)[0]
                return (piece.src_unit if source else piece.dst_unit) in host

            sizes = [0 if c.single and not (host and any(away(s) for s in c.segments)) else c.nbytes
                     for c in plan.chunks]
            total += sum(streams.ring(sizes, depth))
    for messages, flags, host, source in ((work.sends, planned.send_in_stream, host_sources, True),
                                          (work.recvs, planned.recv_in_stream, host_after, False)):
        if host:  # nothing in host memory (the common case): no piece to scan
            total += sum(p.total_bytes for m, in_stream in zip(messages, flags) for p, s in zip(m.pieces, in_stream)
                         if not s and (p.src_unit if source else p.dst_unit) in host)
    return total


def planned_streams(plans: tuple, tensor_of, device, depth: int, bind=None) -> list:
    """One PeerStream per peer of a round's direction, from the execution plan's
    StreamPlans (the packed pieces of its messages, in message order: sender and receiver
    enumerate a round's messages to each other alike); `tensor_of(piece, tensor)` gives
    the local tensor a packed piece's tensor is read from (send) or written into
    (receive). `bind(stream, plan)` runs on each at its first pack or unpack
    (replay.bind_stream: the chunks' replayed launches; a receive stream's first unpack
    comes after the first posts, so reading its tensors' addresses is off the path to the
    first byte)."""
    out = []
    for plan in plans:
        stream = streams.PeerStream.planned(plan.peer, plan.chunks, [tensor_of(p, name) for p in plan.pieces
                                                                     for name in p.tensors], device, depth)
        if bind is not None:
            stream.binder = functools.partial(bind, stream_plan=plan)
        out.append(stream)
    return out


_COPY_STREAMS: dict = {}


def copy_stream(device: torch.device):
    """The side stream same-GPU copies run on (CUDA), after the work queued so far; None
    off CUDA (the copies then run inline)."""
    if device.type != "cuda":
        return None
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    side = _COPY_STREAMS[device]
    side.wait_stream(torch.cuda.current_stream(device))
    return side


@contextlib.contextmanager
def nothing():
    yield


def allocate(prog: RankProgram, unit: str, new: dict, live: Live, device, aliased: set,
              host_units=frozenset(), deferred=frozenset()) -> None:
    """Allocate an after-unit's shards (`alloc`) but those in `deferred` (the round has
    reserved them in `live`; `destination` allocates them when they are first written)."""
    shards = prog.after.get(unit)
    if shards is None:
        raise ProgramError(f"alloc of {unit}, which holds nothing on GPU {prog.gpu}")
    slot = new.setdefault(unit, {})
    for name, info in shards.items():
        if name not in slot and (unit, name) not in aliased and (unit, name) not in deferred:
            slot[name] = offload.new_shard(unit, info.shape, TORCH_DTYPES[info.dtype], live, device, host_units)


def destination(prog: RankProgram, new: dict, live: Live, device, unit: str, name: str,
                host_units=frozenset()) -> torch.Tensor:
    """The after-shard `name` of `unit`, allocated here if no alloc op came first (or the
    round deferred it: its reservation in `live` becomes the allocation)."""
    slot = new.setdefault(unit, {})
    tensor = slot.get(name)
    if tensor is None:
        info = prog.after[unit][name]
        live.claim((unit, name))
        tensor = slot[name] = offload.new_shard(unit, info.shape, TORCH_DTYPES[info.dtype], live, device, host_units)
    return tensor


def check_complete(prog: RankProgram, new: dict, written: dict) -> None:
    for unit, shards in prog.after.items():
        for name, info in shards.items():
            numel = 1
            for d in info.shape:
                numel *= d
            if written.get((unit, name), 0) != numel:
                raise ProgramError(f"after-unit {unit}: {written.get((unit, name), 0)} of {numel} elements "
                                   f"of {name} were produced")
