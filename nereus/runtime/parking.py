"""Parking: where a transition keeps the old shards it has released from the GPU.

A transition is all or nothing, so every old shard must stay restorable until the commit.
Three ways to do that (`rollback=`):

- "device": nothing is parked; an old shard stays on its device until the commit, so a
  GPU holds old + new, above the compiler's memory replay wherever the program frees
  old shards early to make room.
- "host": every before-shard the program frees (or stages out) on a parked device type
  is copied to (pinned) host memory and the device tensor is dropped, so GPU memory
  follows the replay. The copies run on a side CUDA stream and overlap the next rounds'
  transfers (the caching allocator reuses the memory only once the copy is done:
  `record_stream`).
- "auto" (the default on CUDA): "device" for every freed shard whose stay on the GPU
  still fits the replay (`park_plan`: the replay's later peaks plus the shards kept so
  far stay within the GPU's capacity and its real free memory), "host" for the rest. On
  a GPU with room nothing is copied and the transition runs at link speed; on a full
  GPU only what must leave does.

An abort copies the parked shards back; a commit drops them. Shards kept on the device
are released by the caller's registry at the commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from nereus.passes.memory_model import packed

from .allocator import unused_bytes
from .control import Failure, TransitionAborted
from .program import RankProgram

ROLLBACK_MODES = ("auto", "device", "host")
# fraction of the device's real free memory the kept old shards may use (allocator
# fragmentation and the caller's own allocations during the transition take the rest)
REAL_ROOM_FRACTION = 0.9


def default_rollback(device) -> str:
    """The rollback mode used when none is given: "auto" for CUDA tensors (old shards stay
    on the GPU where the replay leaves room, the rest leaves as the compiler's replay
    assumes), "device" otherwise (on CPU a host copy would only double the memory)."""
    return "auto" if torch.device(device).type == "cuda" else "device"


def restore_parked(parking: "Parking", error: BaseException, prog: RankProgram) -> None:
    try:
        parking.restore()
    except Exception as failed:  # noqa: BLE001 - say where the old state is
        failures = list(error.failures) if isinstance(error, TransitionAborted) else \
            [Failure(dist.get_rank(), -1, "execute", None, f"{type(error).__name__}: {error}")]
        failures.append(Failure(dist.get_rank(), -1, "restore", None,
                                f"{type(failed).__name__}: {failed}; the old shards are intact in host "
                                f"memory (in the before-state) but could not return to the device"))
        raise TransitionAborted(failures, prog.source, prog.target) from error


def _released(prog: RankProgram) -> list:
    """[(round, unit, bytes)] of the before-units this rank releases (first free or
    stage_out), in round order; bytes exclude shards a keep hands over in place."""
    kept = {(a.src_unit, name) for w in prog.rounds for a in w.aliases for name in a.tensors}
    seen, out = set(), []
    for work in prog.rounds:
        for unit in work.stage_outs + work.frees:
            if unit not in seen:
                seen.add(unit)
                size = sum(i.nbytes for n, i in prog.before[unit].items() if (unit, n) not in kept)
                out.append((work.index, unit, size))
    return out


def replay(prog: RankProgram, resident_bytes: int = 0, offloaded: frozenset = frozenset()) -> tuple[list, int]:
    """This rank's memory replay of the program: ([peak bytes of each round], bytes live
    after the last round). A round's peak = resident + live shards after its allocations
    + its message buffers, before its frees; aliased shards count once. Buffers as a GPU
    allocates them (nereus.passes.memory_model): the packed bytes of the pieces that do not
    travel in place (a bound on the ring slots), and the pieces that do but are read from
    host memory (staged out in an earlier round, or of an offloaded before-unit: copied to
    the device whole) or written into it (an offloaded after-unit: a bounce tensor).
    offloaded: {("before" | "after", unit id)} of the units in host memory. Offloaded
    shards count as live here (an overcount: they are host memory). A piece of several
    tensors counts once per tensor."""
    host_before = {unit for phase, unit in offloaded if phase == "before"}
    host_after = {unit for phase, unit in offloaded if phase == "after"}
    kept = {(a.src_unit, name) for w in prog.rounds for a in w.aliases for name in a.tensors}
    aliased_dst = {(a.dst_unit, name) for w in prog.rounds for a in w.aliases for name in a.tensors}
    live = resident_bytes + sum(i.nbytes for shards in prog.before.values() for i in shards.values())
    allocated: set = set()
    released: set = set()
    peaks = []

    def alloc(unit, name):
        nonlocal live
        if (unit, name) not in allocated and (unit, name) not in aliased_dst:
            allocated.add((unit, name))
            live += prog.after[unit][name].nbytes

    for work in prog.rounds:
        for unit in work.allocs:
            for name in prog.after.get(unit, {}):
                alloc(unit, name)
        for piece in work.copies:
            for name in piece.tensors:
                alloc(piece.dst_unit, name)
        for msg in work.recvs:
            for p in msg.pieces:
                for name in p.tensors:
                    alloc(p.dst_unit, name)
        buffers = sum(p.count * (packed(p.nbytes) if not p.direct else p.nbytes if p.src_unit in host_before else 0)
                      for m in work.sends for p in m.pieces)
        buffers += sum(p.count * (packed(p.nbytes) if not p.direct else p.nbytes if p.dst_unit in host_after else 0)
                       for m in work.recvs for p in m.pieces)
        peaks.append(live + buffers)
        host_before.update(work.stage_outs)  # later sends read them from host memory
        for unit in work.stage_outs + work.frees:
            if unit not in released:
                released.add(unit)
                live -= sum(i.nbytes for n, i in prog.before[unit].items() if (unit, n) not in kept)
    return peaks, live


@dataclass(frozen=True)
class ParkReplay:
    """What `park_plan` reads from the program (and the resident bytes) alone."""

    start: int  # resident + before-shards: the replay's bytes before the first round
    staged: frozenset  # before-units some round stages out
    released: tuple  # [(round, unit, bytes)] as `_released`
    later: tuple  # per released unit: the largest replay peak after its round (or the final state)


def park_replay(prog: RankProgram, resident_bytes: int = 0, offloaded: frozenset = frozenset()) -> ParkReplay:
    peaks, final = replay(prog, resident_bytes, offloaded)
    # suffix maxima: later_from[i] = max(peaks[i:] + [final])
    later_from = [final] * (len(peaks) + 1)
    for i in range(len(peaks) - 1, -1, -1):
        later_from[i] = max(peaks[i], later_from[i + 1])
    released = tuple(_released(prog))
    return ParkReplay(start=resident_bytes + sum(i.nbytes for shards in prog.before.values() for i in shards.values()),
                      staged=frozenset(u for w in prog.rounds for u in w.stage_outs), released=released,
                      later=tuple(later_from[index + 1] for index, _, _ in released))


def park_plan(prog: RankProgram, resident_bytes: int, capacity_bytes: Optional[int],
              real_room_bytes: Optional[int] = None, replayed: Optional[ParkReplay] = None,
              offloaded: frozenset = frozenset()) -> set:
    """rollback="auto": the before-units this rank must park (host memory) at their
    release; every other released unit stays on the device until the commit.

    Greedy in release order: a unit released at round r stays when, with it and every
    unit kept so far, each later round's replay peak (and the final state) stays within
    `capacity_bytes` (the program's capacity of this GPU) and the growth over the start
    stays within `real_room_bytes` (what the device can still give now). None: no limit.
    Stage_outs always park (later sends read them from host memory). `replayed`: this
    program's `park_replay(prog, resident_bytes)` when computed before (it depends on
    the program alone; the executor keeps it per program)."""
    replayed = park_replay(prog, resident_bytes, offloaded) if replayed is None else replayed
    held = 0
    out = set()
    for (_, unit, size), later in zip(replayed.released, replayed.later):
        fits = (capacity_bytes is None or later + held + size <= capacity_bytes) and \
               (real_room_bytes is None or later - replayed.start + held + size <= real_room_bytes)
        if unit in replayed.staged or not fits:
            out.add(unit)
        else:
            held += size
    return out


def real_room(device) -> Optional[int]:
    """Bytes the caching allocator can still hand out on a CUDA device (free device memory
    plus its own unused reserve), times REAL_ROOM_FRACTION; None off CUDA. An allocator
    that cannot report its reserve (another backend, a pluggable allocator) counts none:
    less room, never a failed transition."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(REAL_ROOM_FRACTION * (free + (unused_bytes(device) or 0)))


class Parking:
    """Host copies of the before-shards a transition released from their device
    (rollback="host" or "auto"); they replace the device tensors in the caller's `before`
    dicts. `units`: the before-units to park (None: every released one)."""

    def __init__(self, before: dict, device_types, units: Optional[set] = None, *, kept: frozenset):
        self.before = before
        self.device_types = frozenset(device_types)
        self.units = units
        # a kept shard becomes an after shard in place: its memory is never released
        # (`kept`: those (unit, tensor), from the execution plan)
        self.kept = kept
        self.devices: dict = {}  # (unit, name) → device the shard was parked from
        self.streams: dict = {}  # CUDA device → the side stream the copies run on
        self.bytes = 0
        self.held_bytes = 0  # released shards that stayed on their device (auto)

    def parks(self, unit: str) -> bool:
        return self.units is None or unit in self.units

    def release(self, unit: str, names, wait: bool = False) -> dict:
        """Copy the shards `names` of `unit` that live on a parked device type to host
        memory and replace their entries in `before` by the copies. Returns {name: copy}.
        CUDA copies are queued on a side stream after the work queued so far, and the
        device tensor is handed to the allocator with `record_stream`, so its memory is
        reused only after the copy; `wait=True` returns when the copies are complete."""
        held = self.before[unit]
        todo = [n for n in names if (unit, n) not in self.kept and (unit, n) not in self.devices
                and held[n].device.type in self.device_types]
        if not self.parks(unit):
            self.held_bytes += sum(held[n].numel() * held[n].element_size() for n in todo)
            return {}
        copies = {}
        for name in todo:
            tensor = held[name]
            copies[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            if tensor.is_cuda:
                stream = self._stream(tensor.device)
                with torch.cuda.stream(stream):
                    copies[name].copy_(tensor, non_blocking=True)
                tensor.record_stream(stream)
            else:
                copies[name].copy_(tensor)
        if wait:
            self.synchronize()
        for name in todo:
            self.devices[(unit, name)] = held[name].device
            self.bytes += copies[name].numel() * copies[name].element_size()
            held[name] = copies[name]
        return copies

    def _stream(self, device: torch.device):
        if device not in self.streams:
            stream = torch.cuda.Stream(device)
            self.streams[device] = stream
        stream = self.streams[device]
        stream.wait_stream(torch.cuda.current_stream(device))  # the shard's last writes and reads first
        return stream

    def synchronize(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()

    def restore(self) -> None:
        """After an abort: device copies of every parked shard replace the host copies in
        `before` (all or none: on an error `before` keeps the host copies)."""
        self.synchronize()
        restored = {}
        for (unit, name), device in self.devices.items():
            host = self.before[unit][name]
            restored[(unit, name)] = torch.empty(host.shape, dtype=host.dtype, device=device)
            restored[(unit, name)].copy_(host, non_blocking=device.type == "cuda")
        synchronize(self.devices.values())
        for (unit, name), tensor in restored.items():
            self.before[unit][name] = tensor
        self.devices.clear()

    def drop(self) -> None:
        """After the commit: remove the host copies from `before` (a copy still in flight
        keeps its pinned block busy until done: the host allocator records the stream)."""
        for unit, name in self.devices:
            del self.before[unit][name]
        self.devices.clear()


def synchronize(devices) -> None:
    for device in set(devices):
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
