"""Parking: where a transition keeps the old shards it has released from the GPU.

With rollback="host", a before-shard that the program frees (or stages out) on a CUDA
device is copied to (pinned) host memory and the device tensor is dropped, so GPU memory
follows the compiler's memory replay; an abort copies the parked shards back, a commit
drops them. With rollback="device" nothing is parked and old shards stay on the device
until the commit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .control import Failure, TransitionAborted
from .program import RankProgram

ROLLBACK_MODES = ("device", "host")


def default_rollback(device) -> str:
    """The rollback mode used when none is given: "host" for CUDA tensors (shards the
    program frees leave the GPU as the compiler's memory replay assumes), "device"
    otherwise (on CPU a host copy would only double the memory, nothing is gained)."""
    return "host" if torch.device(device).type == "cuda" else "device"


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


class Parking:
    """Host copies of the before-shards a transition released from their device
    (rollback="host"); they replace the device tensors in the caller's `before` dicts."""

    def __init__(self, prog: RankProgram, before: dict, device_types):
        self.before = before
        self.device_types = frozenset(device_types)
        # a kept shard becomes an after shard in place: its memory is never released
        self.kept = {(a.src_unit, a.tensor) for w in prog.rounds for a in w.aliases}
        self.devices: dict = {}  # (unit, name) → device the shard was parked from
        self.bytes = 0

    def release(self, unit: str, names) -> dict:
        """Copy the shards `names` of `unit` that live on a parked device type to host
        memory and replace their entries in `before` by the copies. Returns {name: copy}."""
        held = self.before[unit]
        todo = [n for n in names if (unit, n) not in self.kept and (unit, n) not in self.devices
                and held[n].device.type in self.device_types]
        copies = {}
        for name in todo:
            tensor = held[name]
            copies[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            copies[name].copy_(tensor, non_blocking=tensor.is_cuda)
        synchronize([held[n].device for n in todo])  # the copies are complete before the device tensors go
        for name in todo:
            self.devices[(unit, name)] = held[name].device
            self.bytes += copies[name].numel() * copies[name].element_size()
            held[name] = copies[name]
        return copies

    def restore(self) -> None:
        """After an abort: device copies of every parked shard replace the host copies in
        `before` (all or none: on an error `before` keeps the host copies)."""
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
        """After the commit: remove the host copies from `before`."""
        for unit, name in self.devices:
            del self.before[unit][name]
        self.devices.clear()


def synchronize(devices) -> None:
    for device in set(devices):
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
