"""resources: TransitionDag → Schedule (rounds) with resource edges, chunking and host staging.

Input: a `TransitionDag`. Output: a `Schedule`: for every round the allocs, transfers,
host stagings and frees it runs, plus the resource-dependency edges free → alloc that
memory forced, each classified. Invariant: replaying the rounds (allocs first, then
transfers, then stagings and frees) never puts more on a GPU than its usable memory:
resident bytes + unfreed before-shards + allocations + the round's transient message
buffers (a send's bytes count on its source and its destination GPU); host memory per node
never exceeds `host_mem`.

Greedy list scheduling, deterministic: each round admits every pending alloc that fits (in
DAG order), runs every transfer whose destination is allocated and whose buffers fit
(a transfer that does not fit sends the longest leading run of whole slots that does, the
rest waits for the next round; when a round would otherwise make no progress, the reserve
is lent to allocations, then a slot is cut by pieces and rows), then frees every
before-shard whose readers are done. A transfer whose room this round is below the least it
can send (`_pending`) waits without being cut.
When a round makes no progress, units are trading places on full GPUs (a cycle): the
blocked GPU with the smallest deficit stages before-shards to host memory (`stage_out`,
largest first) until the deficit is covered; their readers then read from host memory.
If even host memory cannot take them, the transition is infeasible: the error names the
GPUs and bytes.

`independent=True` is the per-component baseline (DynaRL-style): every model-stage is
scheduled alone, seeing only its own allocations and frees (other model-stages' moves are
invisible to it), and the local schedules run side by side, round k with round k. No
cross-model-stage edges, no staging; the result may overflow (the verifier says so).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from nereus.ir.diagnostics import InfeasibleError
from nereus.ir.units import human_bytes

from .dag import SEND, Piece, TransitionDag, Xfer
from .layout import box_volume as _volume
from .layout import slot_specs

_KIND_INDEX = {"first": 0, "layer": 1, "last": 2}

SAME_STAGE, SM_CS, CM_SS, CM_CS = "same-model-stage", "same-model-cross-stage", "cross-model-same-stage", \
    "cross-model-cross-stage"


# Allocations leave this fraction of a GPU free for message buffers while any other work can
# proceed (fewer, larger chunks, fewer rounds); when nothing else can, they may use it.
TRANSIENT_RESERVE = 1 / 16


@dataclass(frozen=True)
class ResourceEdge:
    free: int  # index into dag.frees (the shard released, on GPU `gpu`)
    alloc: int  # index into dag.allocs (the acquisition that waited for it)
    gpu: int
    kind: str  # SAME_STAGE | SM_CS | CM_SS | CM_CS


@dataclass(frozen=True)
class Round:
    allocs: tuple[int, ...]
    xfers: tuple[Xfer, ...]
    stage_outs: tuple[int, ...]  # indices into dag.frees: shards moved to host memory
    frees: tuple[int, ...]


@dataclass(frozen=True)
class Schedule:
    rounds: tuple[Round, ...]
    edges: tuple[ResourceEdge, ...]
    chunked: int  # transfers split to fit transient buffers
    staged_bytes: int  # bytes staged through host memory to break cycles
    independent: bool = False
    notes: tuple[str, ...] = ()


def edge_kind(dag: TransitionDag, free: int, alloc: int) -> str:
    a = dag.stages[dag.frees[free].stage].name.split(".")
    b = dag.stages[dag.allocs[alloc].stage].name.split(".")
    if a == b:
        return SAME_STAGE
    if a[0] == b[0]:
        return SM_CS
    return CM_SS if a[1] == b[1] else CM_CS


def xfer_slice(dag: TransitionDag, x: Xfer, lo: int, hi: int) -> Xfer:
    """`x` restricted to slots [lo, hi), bytes recomputed."""
    info = dag.stages[x.stage]
    last = info.model.layers + 1
    first_v, layer_v, last_v = x.volumes
    elements = (first_v if lo <= 0 < hi else 0) + layer_v * max(0, min(hi, last) - max(lo, 1)) + \
        (last_v if lo <= last < hi else 0)
    return Xfer(x.kind, x.stage, x.alloc, x.free, x.src_gpu, x.dst_gpu, (lo, hi), x.pieces,
                elements * info.xfer_element_bytes(x.states), x.volumes, x.states)


def schedule(dag: TransitionDag, *, independent: bool = False, staging: bool = True) -> Schedule:
    """Schedule `dag` into memory-safe rounds (module docstring)."""
    if not independent:
        return _schedule(dag, range(len(dag.stages)), staging=staging)
    parts = [_schedule(dag, [s], staging=False) for s in range(len(dag.stages))]
    depth = max((len(p.rounds) for p in parts), default=0)
    rounds = []
    for k in range(depth):
        pieces = [p.rounds[k] for p in parts if k < len(p.rounds)]
        rounds.append(Round(tuple(i for r in pieces for i in r.allocs), tuple(x for r in pieces for x in r.xfers),
                            (), tuple(i for r in pieces for i in r.frees)))
    return Schedule(tuple(rounds), tuple(e for p in parts for e in p.edges), sum(p.chunked for p in parts), 0,
                    True, tuple(n for p in parts for n in p.notes))


def _schedule(dag: TransitionDag, stage_ids, *, staging: bool) -> Schedule:
    cluster = dag.module.cluster
    cap = cluster.usable_gpu_bytes
    host_cap = cluster.host_mem_bytes
    chosen = set(stage_ids)
    mem = list(dag.resident)
    host = defaultdict(int)
    staged = [False] * len(dag.frees)
    for i, f in enumerate(dag.frees):
        if dag.stages[f.stage].before.offload:  # offloaded state waits in host memory
            staged[i] = True
            host[cluster.node_of(f.gpu)] += f.shard_bytes
        else:
            mem[f.gpu] += f.shard_bytes
    over = [g for g in range(len(mem)) if mem[g] > cap]
    if over:
        g = over[0]
        raise InfeasibleError(
            f"plan {dag.source} does not fit before the transition: GPU {g} holds {human_bytes(mem[g])}, usable {human_bytes(cap)}"
            f" ({len(over)} GPU(s) over)", hint="check the source plan's feasibility with `nereusc check`")
    allocs = [i for i, a in enumerate(dag.allocs) if a.stage in chosen]
    incoming: dict[int, list[Xfer]] = defaultdict(list)
    readers = [0] * len(dag.frees)
    for x in dag.xfers:
        if x.stage in chosen:
            incoming[x.alloc].append(x)
            readers[x.free] += 1
    live = [i for i, f in enumerate(dag.frees) if f.stage in chosen]
    freed = [False] * len(dag.frees)
    blocked_since: dict[int, int] = {}
    last_release: dict[int, list[int]] = {}
    rounds: list[Round] = []
    edges: list[ResourceEdge] = []
    spec_kinds = _spec_kinds(dag)
    ready: list[tuple[Xfer, int, int]] = []  # (transfer, _pending's thresholds)
    chunked = staged_bytes = 0
    notes: list[str] = []
    check = [i for i in live if readers[i] == 0]
    unfreed = len(live)
    reserve = int(cap * TRANSIENT_RESERVE)
    fine = False
    while allocs or ready or unfreed:
        k = len(rounds)
        took, waiting = [], []
        for a in allocs:
            alloc = dag.allocs[a]
            if dag.stages[alloc.stage].after.offload:
                node = cluster.node_of(alloc.gpu)
                if host[node] + alloc.bytes > host_cap:
                    raise InfeasibleError(
                        f"transition {dag.source} -> {dag.target}: offloaded state overflows node {node}'s host"
                        f" memory ({human_bytes(host[node] + alloc.bytes)}, {human_bytes(host_cap)} available)",
                        hint="offload fewer model-stages or add host memory")
                host[node] += alloc.bytes
                took.append(a)
                ready.extend(_pending(dag, x, spec_kinds) for x in incoming.get(a, ()))
            elif mem[alloc.gpu] + alloc.bytes + reserve <= cap:
                mem[alloc.gpu] += alloc.bytes
                took.append(a)
                ready.extend(_pending(dag, x, spec_kinds) for x in incoming.get(a, ()))
                if a in blocked_since:
                    for f in last_release.get(alloc.gpu, ()):
                        edges.append(ResourceEdge(f, a, alloc.gpu, edge_kind(dag, f, a)))
            else:
                blocked_since.setdefault(a, k)
                waiting.append(a)
        allocs = waiting
        transient = defaultdict(int)
        done, later = [], []
        for entry in ready:
            x, whole_slot, row = entry
            if x.kind != SEND:
                done.append(x)
                continue
            src_extra = 0 if staged[x.free] else x.bytes
            room_src = cap - mem[x.src_gpu] - transient[x.src_gpu]
            room_dst = cap - mem[x.dst_gpu] - transient[x.dst_gpu]
            if src_extra <= room_src and x.bytes <= room_dst:
                head, tail = x, None
            elif room_dst <= 0 or (src_extra and room_src <= 0):
                later.append(entry)
                continue
            else:
                budget = min(room_dst, room_src if src_extra else room_dst)
                # the least a cut can carry is known: a transfer that cannot move waits
                # without being cut (it used to be offered to _fit up to 3 times a round)
                if budget >= whole_slot:
                    head, tail = _fit(dag, x, budget)
                elif fine and budget >= row:
                    head, tail = _split_slot(dag, x, budget, spec_kinds)
                else:
                    later.append(entry)
                    continue
                chunked += 1
                readers[x.free] += 1
            transient[x.src_gpu] += 0 if staged[x.free] else head.bytes
            transient[x.dst_gpu] += head.bytes
            done.append(head)
            if isinstance(tail, tuple):
                later.extend(_pending(dag, t, spec_kinds) for t in tail)
                readers[x.free] += 1
            elif tail is not None:
                later.append(_pending(dag, tail, spec_kinds))
        ready = later
        for x in done:
            readers[x.free] -= 1
            if readers[x.free] == 0:
                check.append(x.free)
        releases = []
        for i in sorted(set(check)):
            if not freed[i] and readers[i] == 0:
                freed[i] = True
                unfreed -= 1
                releases.append(i)
                f = dag.frees[i]
                if staged[i]:
                    host[cluster.node_of(f.gpu)] -= f.bytes
                else:
                    mem[f.gpu] -= f.bytes
        outs: list[int] = []
        if not took and not done and not releases:
            if reserve:
                reserve = 0  # try once more letting allocations use the transient reserve
                if allocs:  # (transfers never use it: without allocations the pass would repeat)
                    continue
            if not fine:
                fine = True  # then once more cutting transfers below one layer
                continue
            if not staging:
                notes.append(f"deadlock in round {k}: {len(allocs)} allocation(s) can never fit")
                rounds.append(Round((), (), (), ()))
                break
            outs = _break_cycle(dag, allocs, [entry[0] for entry in ready], mem, cap, host, host_cap, freed, staged, live)
            staged_bytes += sum(dag.frees[i].bytes for i in outs)
        check = []
        reserve = int(cap * TRANSIENT_RESERVE)
        fine = False
        last_release = defaultdict(list)
        for i in releases + outs:
            last_release[dag.frees[i].gpu].append(i)
        rounds.append(Round(tuple(took), tuple(done), tuple(outs), tuple(releases)))
    if staged_bytes:
        notes.append(f"cycle broken by staging {human_bytes(staged_bytes)} through host memory")
    if chunked:
        notes.append(f"{chunked} transfer split(s) to fit transient buffers")
    return Schedule(tuple(rounds), tuple(edges), chunked, staged_bytes, False, tuple(notes))


def _pending(dag: TransitionDag, x: Xfer, spec_kinds: list) -> tuple[Xfer, int, int]:
    """(x, whole_slot, row): the least budget with which `_fit` cuts a head of whole slots
    (the first slot's bytes) and with which `_split_slot` cuts one below a slot (one row of
    the first slot's first piece; a very large number when it has none). Below them a
    transfer cannot move in this round, whatever the cut."""
    if x.kind != SEND:
        return x, 0, 0
    element_bytes = dag.stages[x.stage].xfer_element_bytes(x.states)
    kind = _slot_kind(dag, x)
    whole_slot = x.volumes[_KIND_INDEX[kind]] * element_bytes
    kinds = spec_kinds[x.stage]
    first = next((p for p in x.pieces if kinds[p.spec] == kind), None)
    if first is None:
        return x, whole_slot, 1 << 62
    volume = _volume(first.box)
    (r0, r1) = first.box[0]
    row = volume // (r1 - r0) if r1 > r0 else 0
    return x, whole_slot, (row or volume) * element_bytes


def _fit(dag: TransitionDag, x: Xfer, budget: int, fine: bool = False) -> tuple:
    """Split send `x` into (head, tail): the longest leading slot range whose bytes fit in
    `budget` (head None when not even one slot fits; tail None when nothing is left)."""
    lo, hi = x.slots
    info = dag.stages[x.stage]
    last = info.model.layers + 1
    first_v, layer_v, last_v = x.volumes
    room = budget // info.xfer_element_bytes(x.states)
    end = lo
    if end == 0:
        if first_v > room:
            return _split_slot(dag, x, budget) if fine else (None, x)
        room -= first_v
        end = 1
    layers = max(0, min(hi, last) - end)
    take = layers if layer_v == 0 else min(layers, room // layer_v)
    room -= take * layer_v
    end += take
    if take == layers and end == last and hi > last and last_v <= room:
        end = hi
    if end == lo:
        return _split_slot(dag, x, budget) if fine else (None, x)
    if end >= hi:
        return x, None
    return xfer_slice(dag, x, lo, end), xfer_slice(dag, x, end, hi)


def _spec_kinds(dag: TransitionDag) -> list[tuple[str, ...]]:
    """Per stage of `dag`: the slot kind of every spec index (looked up per piece)."""
    return [tuple(spec.kind for spec in slot_specs(info.model)) for info in dag.stages]


def _slot_kind(dag: TransitionDag, x: Xfer) -> str:
    lo = x.slots[0]
    return "first" if lo == 0 else ("last" if lo == dag.stages[x.stage].model.layers + 1 else "layer")


def _one_slot(x: Xfer, pieces: tuple, elements: int, kind: str, element_bytes: int) -> Xfer:
    """The first slot of `x` carrying only `pieces` (all of the slot's kind, `elements` in all)."""
    volumes = [0, 0, 0]
    volumes[_KIND_INDEX[kind]] = elements
    lo = x.slots[0]
    return Xfer(x.kind, x.stage, x.alloc, x.free, x.src_gpu, x.dst_gpu, (lo, lo + 1), pieces,
                elements * element_bytes, tuple(volumes), x.states)


def _split_slot(dag: TransitionDag, x: Xfer, budget: int, spec_kinds=None) -> tuple:
    """Less than one slot fits: send the first slot's pieces that fit, cutting the piece
    that straddles the budget along dim 0 (any row range of a box is a valid segment).
    Only the head's pieces are measured: the rest of the slot has x's elements of that
    kind minus the head's (`Xfer.volumes` sums its pieces). `spec_kinds`: `_spec_kinds(dag)`."""
    lo, hi = x.slots
    info = dag.stages[x.stage]
    kinds = (spec_kinds or _spec_kinds(dag))[x.stage]
    kind = _slot_kind(dag, x)
    element_bytes = info.xfer_element_bytes(x.states)
    pieces = [p for p in x.pieces if kinds[p.spec] == kind]
    room = budget // element_bytes
    head: list = []
    taken = 0
    for i, piece in enumerate(pieces):
        volume = _volume(piece.box)
        if volume <= room:
            head.append(piece)
            room -= volume
            taken += volume
            continue
        (r0, r1), others = piece.box[0], piece.box[1:]
        row = volume // (r1 - r0)
        rows = room // row if row else 0
        tail = pieces[i + 1:]
        if rows:
            head.append(Piece(piece.spec, ((r0, r0 + rows),) + others))
            taken += rows * row
            tail = [Piece(piece.spec, ((r0 + rows, r1),) + others)] + tail
        else:
            tail = [piece] + tail
        break
    else:
        tail = []
    if not head:
        return None, x
    rest = xfer_slice(dag, x, lo + 1, hi) if hi > lo + 1 else None
    first = _one_slot(x, tuple(head), taken, kind, element_bytes)
    if not tail:
        return first, rest
    left = _one_slot(x, tuple(tail), x.volumes[_KIND_INDEX[kind]] - taken, kind, element_bytes)
    return first, (left if rest is None else (left, rest))


def _break_cycle(dag, allocs, ready, mem, cap, host, host_cap, freed, staged, live) -> list[int]:
    """Stage before-shards of the least-blocked GPU to host memory; returns the frees staged."""
    cluster = dag.module.cluster
    needs: dict[int, int] = {}

    def short(g: int, nbytes: int) -> None:
        deficit = mem[g] + nbytes - cap
        if deficit > 0:
            needs[g] = min(needs.get(g, deficit), deficit)

    for a in allocs:
        short(dag.allocs[a].gpu, dag.allocs[a].bytes)
    for x in ready:
        if x.kind == SEND:  # the smallest step forward: one slot of the transfer
            one = xfer_slice(dag, x, x.slots[0], x.slots[0] + 1).bytes
            short(x.dst_gpu, one)
            if not staged[x.free]:
                short(x.src_gpu, one)
    for gpu, deficit in sorted(needs.items(), key=lambda item: (item[1], item[0])):
        candidates = sorted((i for i in live if dag.frees[i].gpu == gpu and not freed[i] and not staged[i]
                             and dag.frees[i].bytes > 0), key=lambda i: (-dag.frees[i].bytes, i))
        if sum(dag.frees[i].bytes for i in candidates) < deficit:
            continue
        node = cluster.node_of(gpu)
        picked, covered = [], 0
        for i in candidates:
            if covered >= deficit:
                break
            picked.append(i)
            covered += dag.frees[i].bytes
        if host[node] + covered > host_cap:
            raise InfeasibleError(
                f"transition {dag.source} -> {dag.target} cannot break a memory cycle: GPU {gpu} needs {human_bytes(deficit)}"
                f" more and staging {human_bytes(covered)} exceeds node {node}'s host memory"
                f" ({human_bytes(host_cap - host[node])} left)",
                hint="free GPUs for the transition, or add host memory")
        host[node] += covered
        for i in picked:
            staged[i] = True
            mem[gpu] -= dag.frees[i].bytes
        return picked
    worst = sorted(needs.items(), key=lambda item: (item[1], item[0]))[:4]
    listing = ", ".join(f"GPU {g} short of {human_bytes(d)}" for g, d in worst) or "no GPU can make progress"
    raise InfeasibleError(f"transition {dag.source} -> {dag.target} cannot fit: {listing} even with every"
                          " movable shard staged to host memory",
                          hint="the target plan does not fit next to the state that stays; check it with `nereusc check`")
