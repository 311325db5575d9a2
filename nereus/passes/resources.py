"""resources: TransitionDag → Schedule (rounds) with resource edges, chunking and host staging.

Input: a `TransitionDag`. Output: a `Schedule`: for every round the allocs, transfers,
host stagings and frees it runs, plus the resource-dependency edges free → alloc that
memory forced, each classified. Invariant: replaying the rounds (allocs first, then
transfers, then stagings and frees) never puts more on a GPU than its usable memory:
resident bytes + unfreed before-shards + allocations + the round's transient message
buffers (what a send costs on its source and its destination GPU under the schedule's
device memory model, `nereus.passes.memory_model`: on CUDA its packed bytes on both, also
when its source shard is staged or offloaded to host memory); host memory per node never
exceeds `host_mem`.

Greedy list scheduling, deterministic: each round admits every pending alloc that fits (in
DAG order), runs every transfer whose destination is allocated and whose buffers fit
(a transfer that does not fit sends the longest leading run of whole slots that does, the
rest waits for the next round; when a round would otherwise make no progress, the reserve
is lent to allocations, then a slot is cut by pieces and rows), then frees every
before-shard whose readers are done. A transfer whose room this round is below the least it
can send (`_pending`) waits without being cut.
Where a stall with allocations waiting would lend them the reserve, `schedule` also
runs the alternative that stages their GPUs' before-shards to host memory instead
(`_stage_for_reserve`) and keeps the schedule with the lower predicted time
(`cost.schedule_seconds`), the lending one on a tie.
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
from dataclasses import dataclass, replace

from nereus.ir.diagnostics import InfeasibleError
from nereus.ir.units import human_bytes

from .cost import RoundClock, schedule_seconds
from .dag import SEND, TransitionDag, Xfer
from .fitting import _KIND_INDEX, _fit, _pending, _slot_kind, _spec_kinds, _split_slot, xfer_slice
from .memory_model import CUDA, DEFAULT, check_kind, packed, padding_per_kind, state_bytes, xfer_costs

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
    memory_model: str = DEFAULT  # the device memory model it is memory-safe under (memory_model.py)


def edge_kind(dag: TransitionDag, free: int, alloc: int) -> str:
    a = dag.stages[dag.frees[free].stage].name.split(".")
    b = dag.stages[dag.allocs[alloc].stage].name.split(".")
    if a == b:
        return SAME_STAGE
    if a[0] == b[0]:
        return SM_CS
    return CM_SS if a[1] == b[1] else CM_CS


def schedule(dag: TransitionDag, *, independent: bool = False, staging: bool = True,
             memory_model: str = DEFAULT) -> Schedule:
    """Schedule `dag` into rounds memory-safe under `memory_model` (module docstring)."""
    check_kind(memory_model)
    if not independent:
        return _cheaper(dag, staging, memory_model)
    parts = [_schedule(dag, [s], staging=False, memory_model=memory_model)[0] for s in range(len(dag.stages))]
    depth = max((len(p.rounds) for p in parts), default=0)
    rounds = []
    for k in range(depth):
        pieces = [p.rounds[k] for p in parts if k < len(p.rounds)]
        rounds.append(Round(tuple(i for r in pieces for i in r.allocs), tuple(x for r in pieces for x in r.xfers),
                            (), tuple(i for r in pieces for i in r.frees)))
    return Schedule(tuple(rounds), tuple(e for p in parts for e in p.edges), sum(p.chunked for p in parts), 0,
                    True, tuple(n for p in parts for n in p.notes), memory_model)


def _cheaper(dag: TransitionDag, staging: bool, memory_model: str = DEFAULT) -> Schedule:
    """The joint schedule. With staging allowed it is first scheduled staging before-shards
    where a stall would lend the transient reserve (`_stage_for_reserve`); if that staged
    nothing it is the lending schedule itself. Otherwise the lending schedule is built
    too, stopped as soon as its predicted time (`cost.RoundClock`, the cost pass's
    estimate for the default pipeline) exceeds the staging one's, and kept if it was not:
    never predicted slower than lending alone, the lending one on a tie. A schedule of
    several rounds is then built again paced (`_pace`), kept only if predicted faster."""
    best, options = _unpaced(dag, staging, memory_model)
    if len(best.rounds) <= 1:
        return best
    seconds = schedule_seconds(dag, best)
    try:
        paced, _ = _schedule(dag, range(len(dag.stages)), paced=True, seconds_cap=seconds, **options)
    except InfeasibleError:  # a pace that leaves a cycle to staging may find host memory short
        return best
    paced_seconds = None if paced is None else schedule_seconds(dag, paced)
    if paced_seconds is None or paced_seconds >= seconds:
        return best
    note = (f"paced rounds (every GPU spreads its transfers over the rounds its tightest peer needs): predicted"
            f" {paced_seconds:.3g} s, unpaced {seconds:.3g} s")
    return replace(paced, notes=paced.notes + (note,))


def _unpaced(dag: TransitionDag, staging: bool, memory_model: str = DEFAULT) -> tuple[Schedule, dict]:
    """The schedule `_cheaper` picked before pacing, and the options that built it."""
    stages = range(len(dag.stages))
    model = {"memory_model": memory_model}
    if not staging:
        return _schedule(dag, stages, staging=False, **model)[0], {"staging": False, **model}
    try:
        staging_instead, reserve_staged = _schedule(dag, stages, staging=True, stage_for_reserve=True, **model)
    except InfeasibleError:  # host memory taken by the reserve's staging may be missing for a cycle
        return _schedule(dag, stages, staging=True, **model)[0], {"staging": True, **model}
    if not reserve_staged:
        return staging_instead, {"staging": True, "stage_for_reserve": True, **model}
    seconds = schedule_seconds(dag, staging_instead)
    lending, _ = _schedule(dag, stages, staging=True, seconds_cap=seconds, **model)
    if lending is not None:
        return lending, {"staging": True, **model}
    note = f"staging instead of lending the reserve: predicted {seconds:.3g} s, less than lending's"
    return replace(staging_instead, notes=staging_instead.notes + (note,)), {"staging": True,
                                                                           "stage_for_reserve": True, **model}


def _schedule(dag: TransitionDag, stage_ids, *, staging: bool, stage_for_reserve: bool = False,
              seconds_cap: float | None = None, paced: bool = False,
              memory_model: str = DEFAULT) -> tuple[Schedule | None, int]:
    """(schedule, bytes staged instead of lending the reserve). `stage_for_reserve`: where a
    stall would lend the transient reserve, stage before-shards instead where possible.
    `seconds_cap`: the schedule is None once its predicted seconds exceed it. `paced`:
    transfers are taken in shift order and each GPU's buffers per round are held to its
    share of the rounds its tightest peer needs (`_pace`)."""
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
    # (transfer, _pending's thresholds, its buffer bytes on source and destination): the
    # thresholds computed when a transfer first does not fit whole (most never need them: at
    # 4,096 GPUs computing them up front cost ~0.1 s per compile), the bytes when it starts
    # waiting and again when its source is staged (a send waits ~10 rounds: asking
    # `xfer_costs` every round was a third of the pass)
    ready: list[tuple] = []

    def wait_entry(x: Xfer, whole_slot=None, row=None) -> tuple:
        if x.kind != SEND:
            return x, whole_slot, row, 0, 0
        return (x, whole_slot, row, *xfer_costs(memory_model, dag, x, staged[x.free]))

    chunked = staged_bytes = reserve_staged = 0
    clock = RoundClock(dag) if seconds_cap is not None else None
    notes: list[str] = []
    check = [i for i in live if readers[i] == 0]
    unfreed = len(live)
    reserve = int(cap * TRANSIENT_RESERVE)
    fine = False
    shifted = False  # paced: `ready` is in shift order
    pace_forced = None  # paced: (rounds, tight GPUs) as the first paced round saw them
    pace_off = False  # a paced round that makes no progress is run again unpaced
    while allocs or ready or unfreed:
        k = len(rounds)
        took, waiting = [], []
        joined = len(ready)
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
                ready.extend(wait_entry(x) for x in incoming.get(a, ()))
            elif mem[alloc.gpu] + alloc.bytes + reserve <= cap:
                mem[alloc.gpu] += alloc.bytes
                took.append(a)
                ready.extend(wait_entry(x) for x in incoming.get(a, ()))
                if a in blocked_since:
                    for f in last_release.get(alloc.gpu, ()):
                        edges.append(ResourceEdge(f, a, alloc.gpu, edge_kind(dag, f, a)))
            else:
                blocked_since.setdefault(a, k)
                waiting.append(a)
        allocs = waiting
        shifted = shifted and len(ready) == joined  # (the new sends joined at the end)
        done, later = [], []
        limit = None
        # room[g]: the buffer bytes GPU g can still take this round (in a paced round at
        # most its pace); each send taken subtracts its bytes
        room = [cap - m for m in mem]
        if paced and not pace_off:
            if not shifted:  # stable; a round keeps the order (a cut's tails take its place)
                ready.sort(key=lambda e, n=len(mem): (e[0].dst_gpu - e[0].src_gpu) % n)  # shift order
                shifted = True
            limit, forced = _pace(ready, mem, cap)
            if forced is not None and pace_forced is None:
                pace_forced = forced
            for g, most in limit.items():
                room[g] = min(room[g], most)
        for entry in ready:
            x, whole_slot, row, src_extra, dst_extra = entry
            if x.kind != SEND:
                done.append(x)
                continue
            room_src, room_dst = room[x.src_gpu], room[x.dst_gpu]
            if src_extra <= room_src and dst_extra <= room_dst:
                head, tail = x, None
            else:
                budget = room_dst if not src_extra or room_dst < room_src else room_src
                if budget > 0 and whole_slot is None:
                    _, whole_slot, row = _pending(dag, x, spec_kinds)
                    entry = (x, whole_slot, row, src_extra, dst_extra)
                # the least a cut can carry is known: a transfer that cannot move waits
                # without being cut (it used to be offered to _fit up to 3 times a round);
                # most waiting sends stop here each round, so the test is inline. (The cuda
                # model's padding only raises whole_slot: no cut either way.)
                if budget <= 0 or (budget < whole_slot and not fine):
                    later.append(entry)
                    continue
                cut = _cut_to_fit(dag, x, budget, whole_slot, row, fine, spec_kinds, memory_model)
                if cut is None:
                    later.append(entry)
                    continue
                head, tail = cut
                chunked += 1
                readers[x.free] += 1
                src_extra, dst_extra = xfer_costs(memory_model, dag, head, staged[x.free])
            room[x.src_gpu] -= src_extra
            room[x.dst_gpu] -= dst_extra
            done.append(head)
            if isinstance(tail, tuple):
                later.extend(wait_entry(t) for t in tail)
                readers[x.free] += 1
            elif tail is not None:
                later.append(wait_entry(tail))
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
            if limit:  # the pace held back what could move: this round without it
                pace_off = True
                continue
            if reserve and allocs and stage_for_reserve:
                outs = _stage_for_reserve(dag, allocs, mem, cap, reserve, host, host_cap, freed, staged, live)
                reserve_staged += sum(dag.frees[i].bytes for i in outs)
            if not outs:  # staged instead: the allocations fit next round with the reserve kept
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
                outs = _break_cycle(dag, allocs, [entry[0] for entry in ready], mem, cap, host, host_cap, freed,
                                    staged, live, memory_model)
                staged_bytes += sum(dag.frees[i].bytes for i in outs)
        if outs:  # their sends now read from host memory: what they cost may change
            moved = set(outs)
            ready = [wait_entry(*entry[:3]) if entry[0].free in moved else entry for entry in ready]
        check = []
        reserve = int(cap * TRANSIENT_RESERVE)
        fine = pace_off = False
        last_release = defaultdict(list)
        for i in releases + outs:
            last_release[dag.frees[i].gpu].append(i)
        rounds.append(Round(tuple(took), tuple(done), tuple(outs), tuple(releases)))
        if clock is not None:
            clock.add(rounds[-1])
            if clock.seconds > seconds_cap:  # slower than the alternative already
                return None, reserve_staged
    if staged_bytes:
        notes.append(f"cycle broken by staging {human_bytes(staged_bytes)} through host memory")
    if reserve_staged:
        notes.append(f"staged {human_bytes(reserve_staged)} through host memory instead of lending the transient reserve")
    if chunked:
        notes.append(f"{chunked} transfer split(s) to fit transient buffers")
    if pace_forced is not None:
        notes.append(memory_note(dag, tuple(rounds), pace_forced))
    return Schedule(tuple(rounds), tuple(edges), chunked, staged_bytes + reserve_staged, False, tuple(notes),
                    memory_model), reserve_staged


def _cut_to_fit(dag, x, budget: int, whole_slot: int, row: int, fine: bool, spec_kinds, memory_model: str):
    """(head, tail) of send `x` whose head costs at most `budget` on each GPU under
    `memory_model`, or None when no cut can move this round: whole leading slots
    (`_fit`), or once `fine` the pieces and rows of one (`_split_slot`). `whole_slot`,
    `row`: `_pending`'s least budgets in raw bytes (`budget` is at least `whole_slot`
    unless `fine`: the caller tests that); the cuda model counts every segment at its
    packed size, so the cuts and those thresholds add the padding."""
    padding, sizes = (0, 0, 0), ()
    if memory_model == CUDA:
        padding, sizes = padding_per_kind(dag, x), state_bytes(dag, x)
        whole_slot += padding[_KIND_INDEX[_slot_kind(dag, x)]]
        if row < 1 << 62:  # one row of the first piece, each state's segment packed
            row = sum(packed(row // sum(sizes) * size) for size in sizes)
    if budget >= whole_slot:
        head, tail = _fit(dag, x, budget, padding=padding)
    elif fine and budget >= row:
        head, tail = _split_slot(dag, x, budget, spec_kinds, sizes)
    else:
        return None
    return None if head is None else (head, tail)


PACE_SLACK = 1.2  # a paced GPU may take this much more than its even share (cuts are by layer)


def _pace(ready: list, mem: list, cap: int) -> dict:
    """{gpu: most buffer bytes it takes this round} of a paced round: the GPU whose
    remaining sends and receives (`ready`'s entries: buffer bytes at both ends as the
    memory model charges them) fill its free memory the most times over sets the rounds
    still needed, K; every other GPU spreads its own over K rounds (its share, with
    PACE_SLACK) instead of finishing early and leaving the tight GPU's rounds to run alone:
    each round then moves a like share on every link (module docstring)."""
    load: dict = defaultdict(int)
    for x, _, _, src_bytes, dst_bytes in ready:
        if x.kind == SEND:
            load[x.dst_gpu] += dst_bytes
            load[x.src_gpu] += src_bytes
    rounds, need = 1, {}
    for g, n in load.items():
        room = cap - mem[g]
        if room > 0:
            need[g] = -(-n // room)
            rounds = max(rounds, need[g])
    if rounds <= 1:
        return {}, None
    tight = tuple((g, cap - mem[g], load[g]) for g in sorted(need) if need[g] == rounds)
    return {g: int(n / rounds * PACE_SLACK) + 1 for g, n in load.items()}, (rounds, tight)


def memory_note(dag: TransitionDag, rounds: tuple, forced) -> str:
    """What sets a paced schedule's rounds: the GPUs whose free memory their buffers fill
    the most times over, and the after units (TP groups) that wait for their data, with
    the last round that brings it."""
    k, tight = forced
    gpus = [g for g, _, _ in tight]
    room, load = min(r for _, r, _ in tight), max(n for _, _, n in tight)
    holders = sorted({dag.stages[f.stage].name + f" pp stage {f.pos[0]}" for f in dag.frees if f.gpu in set(gpus)})
    last: dict = {}
    for i, rnd in enumerate(rounds):
        for x in rnd.xfers:
            if x.kind == SEND and x.src_gpu in set(gpus):
                a = dag.allocs[x.alloc]
                last[(dag.stages[a.stage].name, a.replica)] = i
    waits = defaultdict(list)
    for (name, replica), i in sorted(last.items()):
        waits[(name, i)].append(replica)
    listing = "; ".join(f"{name} replicas {_ranges(reps)} until round {i}" for (name, i), reps in sorted(
        waits.items(), key=lambda item: (-item[0][1], item[0][0]))[:4])
    return (f"memory sets {k} rounds: GPU(s) {_ranges(gpus)} ({', '.join(holders[:3])}) have"
            f" {human_bytes(room)} free for {human_bytes(load)} of send and receive buffers; the TP groups"
            f" that wait for their data: {listing}")


def _ranges(values) -> str:
    """1, 2, 3, 5 -> '1-3, 5'."""
    out: list = []
    for v in sorted(set(values)):
        if out and out[-1][1] == v - 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in out)


def _break_cycle(dag, allocs, ready, mem, cap, host, host_cap, freed, staged, live, memory_model) -> list[int]:
    """Stage before-shards of the least-blocked GPU to host memory; returns the frees staged."""
    needs: dict[int, int] = {}

    def short(g: int, nbytes: int) -> None:
        deficit = mem[g] + nbytes - cap
        if deficit > 0:
            needs[g] = min(needs.get(g, deficit), deficit)

    for a in allocs:
        short(dag.allocs[a].gpu, dag.allocs[a].bytes)
    for x in ready:
        if x.kind == SEND:  # the smallest step forward: one slot of the transfer
            src_one, dst_one = xfer_costs(memory_model, dag, xfer_slice(dag, x, x.slots[0], x.slots[0] + 1),
                                          staged[x.free])
            short(x.dst_gpu, dst_one)
            if src_one:
                short(x.src_gpu, src_one)
    pick = next(_staging_picks(dag, needs, freed, staged, live), None)
    if pick is None:
        worst = sorted(needs.items(), key=lambda item: (item[1], item[0]))[:4]
        listing = ", ".join(f"GPU {g} short of {human_bytes(d)}" for g, d in worst) or "no GPU can make progress"
        raise InfeasibleError(f"transition {dag.source} -> {dag.target} cannot fit: {listing} even with every"
                              " movable shard staged to host memory",
                              hint="the target plan does not fit next to the state that stays; check it with `nereusc check`")
    gpu, deficit, picked, covered = pick
    node = dag.module.cluster.node_of(gpu)
    if host[node] + covered > host_cap:
        raise InfeasibleError(
            f"transition {dag.source} -> {dag.target} cannot break a memory cycle: GPU {gpu} needs {human_bytes(deficit)}"
            f" more and staging {human_bytes(covered)} exceeds node {node}'s host memory"
            f" ({human_bytes(host_cap - host[node])} left)",
            hint="free GPUs for the transition, or add host memory")
    _stage(dag, gpu, picked, covered, mem, host, staged)
    return picked


def _stage_for_reserve(dag, allocs, mem, cap, reserve, host, host_cap, freed, staged, live) -> list[int]:
    """The staging alternative to lending the transient reserve: every GPU with a waiting
    allocation stages before-shards (largest first) to host memory until the allocation
    fits with the reserve kept (also one that would not fit in the reserve: lending it
    would leave it waiting and the transfers cut below a layer). Returns the frees staged;
    [] where no such GPU's unstaged before-shards cover its deficit within its node's host
    memory (the caller lends the reserve instead)."""
    needs: dict[int, int] = {}
    for a in allocs:
        alloc = dag.allocs[a]
        if dag.stages[alloc.stage].after.offload:
            continue
        deficit = mem[alloc.gpu] + alloc.bytes + reserve - cap
        needs[alloc.gpu] = min(needs.get(alloc.gpu, deficit), deficit)
    outs: list[int] = []
    node_of = dag.module.cluster.node_of
    for gpu, _, picked, covered in _staging_picks(dag, needs, freed, staged, live):
        if host[node_of(gpu)] + covered <= host_cap:
            _stage(dag, gpu, picked, covered, mem, host, staged)
            outs.extend(picked)
    return outs


def _staging_picks(dag, needs: dict[int, int], freed, staged, live):
    """Yields (gpu, deficit, frees, their bytes) for the GPUs of `needs` (GPU → bytes
    short), least deficit first, whose unstaged before-shards cover the deficit: the
    largest of them that do (largest first). GPUs they cannot cover are skipped."""
    on_gpu: dict[int, list[int]] = defaultdict(list)
    if needs:
        for i in live:
            f = dag.frees[i]
            if f.gpu in needs and not freed[i] and not staged[i] and f.bytes > 0:
                on_gpu[f.gpu].append(i)
    for gpu, deficit in sorted(needs.items(), key=lambda item: (item[1], item[0])):
        candidates = sorted(on_gpu.get(gpu, ()), key=lambda i: (-dag.frees[i].bytes, i))
        if sum(dag.frees[i].bytes for i in candidates) < deficit:
            continue
        picked, covered = [], 0
        for i in candidates:
            if covered >= deficit:
                break
            picked.append(i)
            covered += dag.frees[i].bytes
        yield gpu, deficit, picked, covered


def _stage(dag, gpu: int, picked: list[int], covered: int, mem, host, staged) -> None:
    host[dag.module.cluster.node_of(gpu)] += covered
    for i in picked:
        staged[i] = True
        mem[gpu] -= dag.frees[i].bytes
