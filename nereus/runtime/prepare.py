"""Preparing a transition: the one-time work of a (source, target) pair, done before it runs.

`Runtime.prepare(target)` compiles and lowers the program (cached by the Runtime), then,
with this module: compiles the pack kernels for the message shapes of this rank's
program (`warm_kernels`), opens the point-to-point links to every peer of the program
and the data group's communicator (`warm_links`), and fills the pinned host allocator's
cache with blocks for the shards the program would park (`warm_parking`). After it,
`transition(target)` pays no first-use cost. Input of each: this rank's RankProgram;
output: a count for the report; invariant: no registered tensor is read or written.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from . import packing
from .program import RankProgram

_WARM_TAG = 1 << 26
# data communicators on NCCL: NCCL runs the point-to-point ops of one communicator one
# after the other (measured on 2 H200s: 64 ops of 32 MB each way 198 GB/s per direction
# on one communicator, 288 GB/s over 4); override with NEREUS_P2P_GROUPS
P2P_GROUPS_NCCL = 4


def data_groups(device, timeout_s: float, count: Optional[int] = None):
    """Collective (every rank): the data groups a transition posts its ops on. None (the
    default group) off NCCL/CUDA or with count 1; else [None] + count - 1 new groups over
    every rank (created now, so their communicators exist before the first transition)."""
    from datetime import timedelta

    if count is None:
        count = int(os.environ.get("NEREUS_P2P_GROUPS", "0")) or \
            (P2P_GROUPS_NCCL if torch.device(device).type == "cuda" and dist.get_backend() == "nccl" else 1)
    if count <= 1:
        return None
    # one set per process and count: every Runtime (and WeightSync) of the job shares
    # communicators whose links are already open (every rank creates them in the same order)
    if count not in _GROUPS:
        _GROUPS[count] = [None] + [dist.new_group(timeout=timedelta(seconds=timeout_s)) for _ in range(count - 1)]
    return _GROUPS[count]


_GROUPS: dict = {}


def _meta(info, dtypes: dict) -> torch.Tensor:
    return torch.empty(info.shape, dtype=dtypes[info.dtype], device="meta")


def warm_kernels(prog: RankProgram, device: torch.device, dtypes: dict) -> int:
    """Compile the pack/unpack kernel variants this rank's messages use (meta views of
    the real shard shapes; nothing is allocated at their size). Returns the variants run."""
    kernels = packing.kernels()
    if kernels is None or not hasattr(kernels, "warm") or torch.device(device).type != "cuda":
        return 0
    calls = []
    for work in prog.rounds:
        for kind, messages in (("pack", work.sends), ("unpack", work.recvs)):
            for msg in messages:
                packed = [p for p in msg.pieces if not p.direct]
                if not packed:
                    continue
                if kind == "pack":
                    views = [_meta(prog.before[p.src_unit][p.tensor], dtypes)[p.src_slices] for p in packed]
                else:
                    views = [_meta(prog.after[p.dst_unit][p.tensor], dtypes)[p.dst_slices] for p in packed]
                offsets, _ = packing.layout([p.nbytes for p in packed])
                calls.append((kind, views, offsets))
    return kernels.warm(calls, device)


def peers(prog: RankProgram) -> list:
    """Every rank this rank sends to or receives from in the program (symmetric: a peer
    of mine counts me among its peers)."""
    return sorted({m.peer for w in prog.rounds for m in w.sends + w.recvs})


def warm_links(prog: RankProgram, group, device: torch.device) -> int:
    """Collective over `group` (or each group of a list): one tiny all_reduce (creates the
    communicator where the backend creates it lazily), then one small exchange with each
    peer of the program (NCCL connects a pair on its first point-to-point op). Returns
    the peers warmed."""
    mine = peers(prog)
    for g in (group if isinstance(group, (list, tuple)) else [group]):
        flag = torch.ones(1, device=device)
        dist.all_reduce(flag, group=g)
        ops = []
        for peer in mine:
            ops.append(dist.P2POp(dist.isend, torch.ones(1, device=device), peer, g, _WARM_TAG))
            ops.append(dist.P2POp(dist.irecv, torch.empty(1, device=device), peer, g, _WARM_TAG))
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return len(mine)


def warm_parking(prog: RankProgram, units: Optional[set], dtypes: dict) -> int:
    """Allocate and free pinned host blocks of the sizes the program will park (`units`:
    the park plan; None: every released unit), so the transition's copies find them in the
    host allocator's cache instead of paying cudaHostAlloc. Returns the bytes pinned."""
    if not torch.cuda.is_available():
        return 0
    kept = {(a.src_unit, a.tensor) for w in prog.rounds for a in w.aliases}
    blocks = []
    for work in prog.rounds:
        for unit in work.stage_outs + work.frees:
            if units is not None and unit not in units:
                continue
            for name, info in prog.before[unit].items():
                if (unit, name) not in kept:
                    blocks.append(torch.empty(info.shape, dtype=dtypes[info.dtype], pin_memory=True))
    total = sum(b.numel() * b.element_size() for b in blocks)
    del blocks
    return total
