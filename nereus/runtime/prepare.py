"""Preparing a transition: the one-time work of a (source, target) pair, done before it runs.

`Runtime.prepare(target)` compiles and lowers the program (cached by the Runtime), then,
with this module: compiles the pack kernels for the message shapes of this rank's
program (`warm_kernels`), opens the point-to-point links to every peer of the program
and the data group's communicator (`warm_links`), and fills the pinned host allocator's
cache with blocks for the shards the program would park (`warm_parking`), and the
device caching allocator's with blocks of the sizes the transition allocates
(`reserve_memory`). `data_groups` creates the data communicators once per process and
connects every pair of ranks on each (`warm_groups`), and `warm_compiler` starts Triton
at a runtime's construction. After it,
`transition(target)` pays no first-use cost. Input of each: this rank's RankProgram;
output: a count for the report; invariant: no registered tensor is read or written.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import env_number

from . import packing, replay, streams
from .program import RankProgram
from .execution_plan import plan_for
from .parking import real_room
from .wires import dst_region, src_region

_WARM_TAG = 1 << 26
# data communicators on NCCL: NCCL runs the point-to-point ops of one communicator one
# after the other (measured on 2 H200s: 64 ops of 32 MB each way 198 GB/s per direction
# on one communicator, 288 GB/s over 4); override with NEREUS_P2P_GROUPS
P2P_GROUPS_NCCL = 4
P2P_GROUPS = env_number("NEREUS_P2P_GROUPS", 0, 0)  # 0: the default above (NCCL) or 1


def data_groups(device, timeout_s: float, count: Optional[int] = None):
    """Collective (every rank): the data groups a transition posts its ops on. None (the
    default group) off NCCL/CUDA or with count 1; else [None] + count - 1 new groups over
    every rank (created now, so their communicators exist before the first transition)."""
    from datetime import timedelta

    if count is None:
        count = P2P_GROUPS or \
            (P2P_GROUPS_NCCL if torch.device(device).type == "cuda" and dist.get_backend() == "nccl" else 1)
    if count <= 1:
        return None
    # one set per process and count: every Runtime (and WeightSync) of the job shares
    # communicators whose links are already open (every rank creates them in the same order)
    if count not in _GROUPS:
        _GROUPS[count] = [None] + [dist.new_group(timeout=timedelta(seconds=timeout_s)) for _ in range(count - 1)]
        warm_groups(_GROUPS[count], device)
    return _GROUPS[count]


def warm_groups(groups: list, device) -> None:
    """Collective: one tiny exchange with every other rank on each group, now. NCCL
    creates a communicator and its point-to-point connections on first use (about 0.2 s
    each on 2 H200s), which would otherwise land in the process's first transition."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for group in groups:
        ops = []
        for peer in range(world):
            if peer != rank:
                ops.append(dist.P2POp(dist.isend, torch.ones(1, device=device), peer, group, _WARM_TAG))
                ops.append(dist.P2POp(dist.irecv, torch.empty(1, device=device), peer, group, _WARM_TAG))
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


_GROUPS: dict = {}


def _meta(info, dtypes: dict) -> torch.Tensor:
    return torch.empty(info.shape, dtype=dtypes[info.dtype], device="meta")


def warm_compiler(device) -> bool:
    """Start Triton's compiler in the background (the packer's compile thread): compile
    the variants of a packed chunk of contiguous bytes (for any dtype: with the default
    tiles, ("pack" | "unpack", 8, 2, 2, 2048)), which the chunks and replays of most
    transitions launch. Why: a process's first variant compile also pays Triton's own
    start, 0.45-0.68 s on one H200 with a warm disk cache against 2-10 ms for each later
    one (benchmarks/RESULTS.md, session 18); a runtime starts it at construction, beside
    the communicators' creation, the lowering process's work and the job's registering,
    instead of in the lowering-ahead thread's first compile, which a first transition
    right after registering waited for. Whether any was left to compile (none off CUDA
    or Triton; queued only where a background compile runs already: Packer.compile_ahead)."""
    kernels = _pack_kernels(device)
    if kernels is None:
        return False
    packer = kernels.default_packer()  # (compile_ahead queues an unindexed device as the caller's GPU)
    chunk = torch.empty(streams.CHUNK_BYTES, dtype=torch.uint8, device="meta")
    return packer.compile_ahead(packer.launch_classes([("pack", [chunk], [0]), ("unpack", [chunk], [0])]), device)


def warm_kernels(prog: RankProgram, device: torch.device, dtypes: dict, offloaded=frozenset()) -> int:
    """Compile the pack/unpack kernel variants this rank's streams use and those of its
    replays (`kernel_classes`, which builds the replays into the execution plan). Returns
    the variants of each, summed."""
    streamed, replayed = kernel_classes(prog, device, dtypes, offloaded)
    kernels = packing.kernels()
    if streamed or replayed:
        kernels.default_packer().compile(streamed | replayed, torch.device(device))
    return len(streamed) + len(replayed)


def kernel_classes(prog: RankProgram, device: torch.device, dtypes: dict, offloaded=frozenset()) -> tuple:
    """(stream variants, replay variants): the pack/unpack kernel variants this rank's
    streams use (the chunks of strided pieces, cut as streams.py cuts them, on meta views
    of the real shard shapes; nothing is allocated at their size), with every chunk of a
    stream with pieces in host memory (offloaded units, `offloaded` as
    offload.offloaded_units gives it: the kernels address those in place, whatever their
    layout), and those of the replays of the rounds' copies and stream chunks
    (replay.py), which are built into the plan now. Nothing is compiled; empty sets off
    CUDA or Triton."""
    if _pack_kernels(device) is None:
        return frozenset(), frozenset()
    streamed = stream_classes(prog, device, dtypes, offloaded)
    replayed = replay.warm(prog, plan_for(prog, streams.CHUNK_BYTES), device, streams.DEPTH, offloaded)
    return streamed, replayed


def stream_classes(prog: RankProgram, device: torch.device, dtypes: dict, offloaded=frozenset()) -> frozenset:
    """The first half of kernel_classes: the stream variants alone (no replay is built)."""
    kernels = _pack_kernels(device)
    if kernels is None:
        return frozenset()
    packer = kernels.default_packer()
    if packer.backend_for(torch.device(device)) != "triton":
        return frozenset()
    return chunk_classes(prog, packer, dtypes, offloaded)


def chunk_classes(prog: RankProgram, packer, dtypes: dict, offloaded=frozenset()) -> frozenset:
    """The kernel variants (`packer`'s names) of the chunks the executor packs or unpacks
    with the kernels when no replay runs: chunks with pieces in host memory and fused
    ones (many segments, some strided). Each chunk's pieces as a table of its segments
    (replay.message_table: a segment of a range's tensors is cut once), as
    segments.view_pieces cuts the views the executor takes (PeerStream.chunk) of tensors
    at 16-byte aligned addresses."""
    from nereus.backends.triton.replay import Box, message_table

    classes: set = set()
    for kind, sp, on_host in stream_plans(prog, offloaded):
        for chunk in sp.chunks:
            if not (on_host or chunk.fused):  # the other chunks are plain copies
                continue
            entries = []  # every entry's views from slot 1 on, all at residue 0
            for s, at in zip(chunk.segments, chunk.offsets):
                piece, name = sp.member(s.view)
                info = prog.before[piece.src_unit][name] if kind == "pack" else prog.after[piece.dst_unit][name]
                entries.append((Box(1, s.shape, s.stride, s.offset, dtypes[info.dtype].itemsize), 0, at, s.count,
                                s.spacing))
            residues = (0,) * (1 + max(s.count for s in chunk.segments))
            classes |= packer.classes_of(kind, message_table(kind, entries, residues))
    return frozenset(classes)


def _pack_kernels(device):
    """The Triton kernels package where its variants compile for `device` (CUDA), else None."""
    kernels = packing.kernels()
    if kernels is None or not hasattr(kernels, "warm") or torch.device(device).type != "cuda":
        return None
    return kernels


def stream_plans(prog: RankProgram, offloaded=frozenset()) -> list:
    """[(kind "pack" | "unpack", execution_plan.StreamPlan, on_host)]: per round, peer and
    direction, the stream of packed pieces as the executor plans it, and whether some of
    them lie in host memory (a unit of `offloaded`, ("before" | "after", unit id) pairs)."""
    out = []
    for planned in plan_for(prog, streams.CHUNK_BYTES).rounds:
        for kind, plans in (("pack", planned.send_streams), ("unpack", planned.recv_streams)):
            for sp in plans:
                away = [("before", p.src_unit) if kind == "pack" else ("after", p.dst_unit) for p in sp.pieces]
                out.append((kind, sp, any(a in offloaded for a in away)))
    return out


def stream_views(prog: RankProgram, dtypes: dict, offloaded=frozenset()) -> list:
    """[(kind "pack" | "unpack", views, on_host)]: `stream_plans` with each stream's packed
    pieces as views (in message order, a view per tensor of a piece) on meta tensors of
    the shards' shapes."""
    out = []
    for kind, sp, on_host in stream_plans(prog, offloaded):
        views = []
        for p in sp.pieces:
            if kind == "pack":  # as the executor views it (wires: two-part pieces too)
                view = src_region(p, _meta(prog.before[p.src_unit][p.tensors[0]], dtypes))
            else:
                view = dst_region(p, _meta(prog.after[p.dst_unit][p.tensors[0]], dtypes))
            views += [view] * p.count
        out.append((kind, views, on_host))
    return out


def peers(prog: RankProgram) -> list:
    """Every rank this rank sends to or receives from in the program (symmetric: a peer
    of mine counts me among its peers)."""
    return sorted({m.peer for w in prog.rounds for m in w.sends + w.recvs})


def warm_links(prog: RankProgram, group, device: torch.device) -> int:
    """Collective over `group` (or each group of a list): one tiny all_reduce (creates the
    communicator where the backend creates it lazily), then one small exchange with each
    peer of the program (NCCL connects a pair on its first point-to-point op), and on
    CUDA one exchange of a stream chunk's size with each peer in turn (a large op runs on
    more channels than a tiny one, and NCCL connects each channel on its first use), then
    the copy kernels the rounds launch (`warm_copies`). Returns the peers warmed."""
    mine = peers(prog)
    cuda = torch.device(device).type == "cuda"
    groups = group if isinstance(group, (list, tuple)) else [group]
    for g in groups:
        flag = torch.ones(1, device=device)
        dist.all_reduce(flag, group=g)
        _exchange(g, mine, torch.ones(1, device=device), torch.empty(1, device=device))
    if cuda:
        size = streams.CHUNK_BYTES
        # only where every rank has room for the two buffers (twice over): prepare must not
        # fail or crowd a full GPU, and a rank that skipped the exchange while its peer
        # posted it would leave the peer waiting, so the ranks decide together
        if all_have_room(4 * size, real_room(device), groups[0], device) and mine:
            # what the buffers hold does not matter: one pair serves every peer, one peer at
            # a time in rank order (both ends of a pair reach it in the same order)
            out = torch.empty(size, dtype=torch.uint8, device=device)
            into = torch.empty(size, dtype=torch.uint8, device=device)
            for g in groups:
                for peer in mine:
                    _exchange(g, [peer], out, into)
            del out, into
        warm_copies(prog, device)
        torch.cuda.current_stream(device).synchronize()
    return len(mine)


def all_have_room(need: int, room: Optional[int], group, device) -> bool:
    """Collective over `group`: whether every rank has `room` >= `need` bytes (None: no
    limit known, counts as room). The same answer on every rank."""
    flag = torch.tensor([1 if room is None or room >= need else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _exchange(group, peers: list, out: torch.Tensor, into: torch.Tensor) -> None:
    ops = []
    for peer in peers:
        ops.append(dist.P2POp(dist.isend, out, peer, group, _WARM_TAG))
        ops.append(dist.P2POp(dist.irecv, into, peer, group, _WARM_TAG))
    for req in dist.batch_isend_irecv(ops) if ops else []:
        req.wait()


def warm_copies(prog: RankProgram, device: torch.device) -> None:
    """Launch once, on tiny tensors of each dtype the program moves, the copy kernels a
    round uses (a contiguous and a strided `copy_`, a `_foreach_copy_` list, on the
    same-GPU copies' side stream too): CUDA loads a kernel's module on its first launch
    in the process, a cost that would land in the first transition."""
    from .wires import TORCH_DTYPES, copy_stream

    dtypes = {TORCH_DTYPES[i.dtype] for part in (prog.before, prog.after) for shards in part.values()
              for i in shards.values()}
    side = copy_stream(device)
    for stream in (torch.cuda.current_stream(device), side):
        with torch.cuda.stream(stream):
            for dtype in dtypes:
                a, b = torch.zeros(4, 4, dtype=dtype, device=device), torch.zeros(4, 8, dtype=dtype, device=device)
                a.copy_(b[:, :4])
                b[:, 4:].copy_(a)
                packing.copy_pairs([a.reshape(-1)[i:i + 1] for i in range(16)],
                                   [b.reshape(-1)[i:i + 1] for i in range(16)])
    torch.cuda.current_stream(device).wait_stream(side)


def warm_parking(prog: RankProgram, units: Optional[set], dtypes: dict) -> int:
    """Allocate and free pinned host blocks of the sizes the program will park (`units`:
    the park plan; None: every released unit), so the transition's copies find them in the
    host allocator's cache instead of paying cudaHostAlloc. Returns the bytes pinned."""
    if not torch.cuda.is_available():
        return 0
    kept = {(a.src_unit, name) for w in prog.rounds for a in w.aliases for name in a.tensors}
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


def warm_data_path(prog: RankProgram, data_group, device, dtypes: dict, offloaded=frozenset()) -> dict:
    """What `Runtime.prepare` and `WeightSync.prepare` both do once the ranks agreed:
    compile the pack kernels (`warm_kernels`), open the links (`warm_links`) and leave
    device blocks of the transition's sizes in the allocator, within the room the device
    has (`reserve_memory`; the new shards a keep hands over in place are the execution
    plan's `aliased`). Returns {"kernels", "peers", "reserved_bytes"}."""
    aliased = plan_for(prog, streams.CHUNK_BYTES).aliased
    return {"kernels": warm_kernels(prog, device, dtypes, offloaded), "peers": warm_links(prog, data_group, device),
            "reserved_bytes": reserve_memory(prog, aliased, device, dtypes, real_room(device))}


def reserve_memory(prog: RankProgram, aliased: set, device, dtypes: dict, room: Optional[int]) -> int:
    """Allocate and free, on a CUDA device, blocks of the sizes the transition will
    allocate (the new shards that are not kept in place, and the streams' ring buffers),
    so its allocations come from the caching allocator's cache instead of cudaMalloc.
    Stops at `room` bytes (what the device can still give; None: no limit) and on an
    out-of-memory error: a reservation never costs the transition memory it needs.
    Returns the bytes reserved."""
    if torch.device(device).type != "cuda":
        return 0
    sizes = [info.nbytes for unit, shards in prog.after.items() for name, info in shards.items()
             if (unit, name) not in aliased]
    for _, sp, _ in stream_plans(prog):  # the ring slots (a chunk of one contiguous segment travels in place)
        sizes += [n for n in streams.ring([0 if c.single else c.nbytes for c in sp.chunks], streams.DEPTH) if n]
    blocks, total = [], 0
    try:
        for size in sorted(sizes, reverse=True):
            if room is not None and total + size > room:
                break
            blocks.append(torch.empty(size, dtype=torch.uint8, device=device))
            total += size
    except torch.cuda.OutOfMemoryError:
        pass
    del blocks
    return total

