"""A round's same-GPU copies and packed stream chunks as replayed kernel launches (CUDA).

Why: the host's posting paced TP -> DP changes on the H200s. With no peer (one GPU,
benchmarks/multi_gpu/host_only.py) rank 0's posting of 32 8B-shaped layers took 15.5-23.4
ms for 11.8 ms of GPU work and 777 launches: per piece, a view of its tensor, a Python
step in `packing.copy_pairs` and a `copy_`; per chunk of a stream, a view per segment and a
`copy_` each. Here each round's copies, and each stream chunk's pack or unpack, are a
`Replay` (nereus.backends.triton.replay): its tables are built from the execution plan's
regions on first use and kept with the plan; a call reads one address per tensor,
uploads them in one table and launches once per access class.

Input: the ExecutionPlan, the round, the live tensors. Output: the copies or the chunk's
bytes queued on the current stream, byte for byte what the torch path writes. Where a
replay cannot run, the callers take the torch path: off CUDA (unless NEREUS_PACK_BACKEND
forces the kernels, under TRITON_INTERPRET), with Triton absent, a tensor in host memory
(an offloaded or staged-out unit) or on another device, a destination not allocated yet
(NEREUS_DEFER_DESTINATIONS), a program's first execution (its replays are built from
the second on, or by `Runtime.prepare`), a kernel variant not compiled yet under the default
"prepared" JIT (it compiles in the background once the transition is over, see
`compile_pending`; `Runtime.prepare` compiles them up front), and with
NEREUS_REPLAY=0 (for measuring what replaying gives).
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from nereus.ir.diagnostics import env_flag

from . import packing
from .wires import TORCH_DTYPES

ENABLED = env_flag("NEREUS_REPLAY", True)
# entries (replays, and each round's copy boxes) a plan keeps; past it the least recently
# used go. One execution needs one per stream (round x peer x direction) and two per round
# with copies: rank 0 of examples/moe-235b-256.nir's Train -> Generate needs 512
MAX_PER_PLAN = 4096


def packer_for(device) -> Optional[object]:
    """The Packer whose kernels replay on `device`, or None where they do not run."""
    kernels = packing.kernels()
    if not ENABLED or kernels is None:
        return None
    packer = kernels.default_packer()
    try:
        if packer.backend_for(torch.device(device)) != "triton":
            return None
    except (ImportError, ValueError):  # "triton" forced where it cannot run: the torch path
        return None
    return packer


def _addresses(tensors: list, device) -> Optional[list]:
    """Each tensor's address, or None when one is not a tensor yet (deferred) or lies
    elsewhere than `device` (host memory, another GPU)."""
    kind, index = _device_key(device)
    index = index if kind == "cuda" else -1  # get_device() of a CPU tensor
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.get_device() != index:
            return None
        out.append(t.data_ptr())
    return out


# a program's replays are built in its executions from this one on (or by `warm`, which
# Runtime.prepare runs): the first execution takes the per-piece path and pays nothing for
# replays, whose kernels could not run in it anyway (not compiled yet) (1 H200, a cold
# 32-layer TP -> DP: building them cost 0.1-0.3 s of a 0.15-0.25 s call)
BUILD_FROM_EXECUTION = 2


def _cached(plan, key: tuple, build, building: bool = True):
    """The plan's value of `key`, built now if missing and `building`; else None. The
    plan keeps MAX_PER_PLAN entries, least recently used out first."""
    cache, used, now = plan.launches, plan.launches_used, plan.executions[0]
    value = cache.get(key)
    if value is None:
        if not building:
            return None
        while len(cache) >= MAX_PER_PLAN:
            old = next(iter(cache))
            if used.pop(old, None) == now and torch.cuda.is_initialized():
                # used in this execution: a kernel queued on another stream than the
                # table's own (prepare builds on the current stream, copies run on a side
                # stream) may still read it. Earlier executions ended synchronized.
                torch.cuda.synchronize()
            del cache[old]
        value = cache[key] = build()
    else:
        cache.move_to_end(key)
    used[key] = now
    return value


def _box(region, info, slot: int):
    from nereus.backends.triton.replay import Box
    from nereus.backends.triton.segments import _contiguous_strides

    elem = TORCH_DTYPES[info.dtype].itemsize
    if region.whole:
        return Box(slot, tuple(info.shape), tuple(_contiguous_strides(info.shape)), 0, elem)
    return Box(slot, region.shape, region.stride, region.offset, elem)


def _device_key(device) -> tuple:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return ("cuda", torch.cuda.current_device())
    return (device.type, device.index)


def _building(plan) -> bool:
    return plan.executions[0] >= BUILD_FROM_EXECUTION


def _copy_replay(plan, prog, index: int, pieces, residues: tuple, device, building: bool = True):
    """The Replay of round `index`'s copies for these residues (None: not built, and not
    `building`). Slots 2f and 2f + 1: the source and destination shard of the copies'
    f-th tensor (a piece of several tensors: one entry of its count, slots 2 apart)."""
    from nereus.backends.triton import replay

    def boxes():
        regions = plan.rounds[index].copy_regions
        out, f = [], 0
        for p, (src, dst) in zip(pieces, regions):
            out.append((_box(src, prog.before[p.src_unit][p.tensors[0]], 2 * f),
                        _box(dst, prog.after[p.dst_unit][p.tensors[0]], 2 * f + 1), p.count, 2))
            f += p.count
        return out

    def build():
        entries = _cached(plan, ("copy boxes", index), boxes)
        return replay.Replay("copy", replay.copy_table(entries, residues), device)

    return _cached(plan, ("copy", index, _device_key(device), residues), build, building)


def copies(plan, prog, index: int, pieces, sources: dict, new: dict, device) -> bool:
    """Queue round `index`'s same-GPU copies (`pieces`, its work.copies) on the current
    stream as one replay; False, with nothing queued, where a replay cannot run."""
    packer = packer_for(device)
    if packer is None or not pieces:
        return False
    tensors = []
    for p in pieces:  # slot 2f: the f-th tensor's source shard, 2f + 1: its destination shard
        shards, slot = sources[p.src_unit], new.get(p.dst_unit, {})
        for name in p.tensors:
            tensors.append(shards.get(name))
            tensors.append(slot.get(name))
    addresses = _addresses(tensors, device)
    if addresses is None:
        return False
    from nereus.backends.triton import replay

    launches = _copy_replay(plan, prog, index, pieces, replay.residues(addresses), device, _building(plan))
    if launches is None or not _runnable(packer, launches.classes, device):
        return False
    launches.run(replay.table(addresses, device))
    return True


def _runnable(packer, classes, device) -> bool:
    """Whether launches of these kernel variants may run in this call (else they are
    queued to compile after it); marked compiled, as their first launch compiles them."""
    if not packer.ready(classes, torch.device(device), start=False):
        return False
    packer.compiled |= classes
    return True


def _stream_replays(plan, index: int, direction: str, stream_plan, depth: int, replayed: tuple, elems: list,
                    residues: tuple, device, building: bool = True) -> Optional[list]:
    """Per chunk of a stream, its Replay (None where `replayed` says no), cached in the
    plan (None: not built, and not `building`). Slots: the stream's ring slots
    (min(depth, chunks)), then its tensors."""
    from nereus.backends.triton import replay

    kind = "pack" if direction == "send" else "unpack"
    slots = min(depth, len(stream_plan.chunks))

    def build():
        out = []
        table = replay.residue_table(residues) if any(s.count >= replay.TABLE_MIN_BOXES for c in stream_plan.chunks
                                                     for s in c.segments) else None  # once for the stream's chunks
        for k, (chunk, wanted) in enumerate(zip(stream_plan.chunks, replayed)):
            if not wanted:
                out.append(None)
                continue
            entries = [(replay.Box(slots + s.view, s.shape, s.stride, s.offset, elems[s.view]), k % depth, at,
                        s.count, s.spacing) for s, at in zip(chunk.segments, chunk.offsets)]
            out.append(replay.Replay(kind, replay.message_table(kind, entries, residues, table)))
        replay.to_device([r for r in out if r is not None], device)  # one upload for the stream
        return out

    key = (direction, index, stream_plan.peer, depth, _device_key(device), replayed, residues)
    return _cached(plan, key, build, building)


def _classes(replays) -> frozenset:
    return frozenset().union(*(r.classes for r in replays if r is not None))


def bind_stream(plan, index: int, direction: str, device, stream, stream_plan) -> None:
    """Give a planned PeerStream (streams.PeerStream.planned) of round `index` its
    replays: `stream.replays[k]` packs (direction "send") or unpacks ("recv") chunk k,
    None for a chunk that travels in place or crosses memories, and `stream.table`
    the call's slot addresses (the ring slots', then each stream tensor's), uploaded
    now. Leaves the stream as it is where a replay cannot run."""
    packer = packer_for(device)
    if packer is None or not stream.chunks:
        return
    replayed = tuple(not (wired or c.crossing) for c, wired in zip(stream.chunks, stream.in_place))
    if not any(replayed):
        return
    addresses = _addresses(list(stream.slots) + list(stream._tensors), device)
    if addresses is None:
        return
    from nereus.backends.triton import replay

    chunks = _stream_replays(plan, index, direction, stream_plan, stream.depth, replayed,
                             [t.element_size() for t in stream._tensors], replay.residues(addresses), device,
                             _building(plan))
    if chunks is None:
        return
    if _runnable(packer, _classes(chunks), device):
        stream.replays, stream.table = chunks, replay.table(addresses, device)


def compile_pending() -> None:
    """After a transition: start compiling, in the background, the kernel variants its
    replays lacked (they took the per-piece path meanwhile; `ready(..., start=False)`
    kept the compiler's GIL-holding work out of the transition itself)."""
    kernels = packing.kernels()
    if kernels is not None:
        kernels.default_packer().compile_pending()


def warm(prog, plan, device, depth: int, offloaded=frozenset()) -> frozenset:
    """Build the replays of every round's copies and streams for tensors at 16-byte
    aligned addresses (as the caching allocator gives them), so a first execution finds
    them in the plan; returns the kernel variants they launch, for the caller to compile
    (empty where replays do not run). Copies and streams with a piece in host memory (a
    unit of `offloaded`, ("before" | "after", unit) pairs as offload.offloaded_units gives
    them) are left out: they are never replayed."""
    return frozenset().union(*warm_steps(prog, plan, device, depth, offloaded))


def warm_steps(prog, plan, device, depth: int, offloaded=frozenset()) -> Iterator[frozenset]:
    """`warm` one replay at a time: each item is one more replay built (a round's copies,
    or one stream's chunks, their tables uploaded on the current stream), given as the
    kernel variants it launches. Why: the lowering-ahead thread builds and compiles one
    replay per step, so a transition that waits for its step in progress waits for one
    replay, not a whole transition's (on one H200, the way back of a 6-layer Qwen3-30B-A3B
    change called right after the first waited 0.18-0.55 s for such a step, session 18)."""
    if packer_for(device) is None:
        return

    def on_host(p) -> bool:
        return ("before", p.src_unit) in offloaded or ("after", p.dst_unit) in offloaded

    for index, (work, planned) in enumerate(zip(prog.rounds, plan.rounds)):
        if work.copies and not any(on_host(p) for p in work.copies):
            zeros = (0,) * (2 * sum(p.count for p in work.copies))
            yield _copy_replay(plan, prog, index, work.copies, zeros, device).classes
        for direction, stream_plans in (("send", planned.send_streams), ("recv", planned.recv_streams)):
            for sp in stream_plans:
                if any(on_host(p) for p in sp.pieces):
                    continue
                side = [prog.before[p.src_unit][p.tensors[0]] if direction == "send" else
                        prog.after[p.dst_unit][p.tensors[0]] for p in sp.pieces]
                replayed = tuple(not c.single for c in sp.chunks)
                if not any(replayed):
                    continue
                elems = [TORCH_DTYPES[info.dtype].itemsize for info, p in zip(side, sp.pieces) for _ in p.tensors]
                zeros = (0,) * (min(depth, len(sp.chunks)) + len(elems))
                yield _classes(_stream_replays(plan, index, direction, sp, depth, replayed, elems, zeros, device))
