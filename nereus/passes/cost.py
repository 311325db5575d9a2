"""cost: Program → CostEstimate (predicted seconds, bytes by link class, peak memory).

Input: a lowered `Program`. Output: a `CostEstimate`. (`schedule_seconds` / `RoundClock`
give the same seconds from a `Schedule` alone, for the default pipeline: the resources
pass compares two schedules with them.) Model (bandwidth plus a per-message
latency; the runtime corrects it with measured times):
  - a round lasts as long as its most loaded link; rounds run one after another;
  - a send inside a node loads its source GPU's NVLink egress and its destination's
    ingress, each at `intra` bytes/s; across nodes it loads the source node's and the
    destination node's network port, each direction at `inter` bytes/s (so 8 GPUs of a node
    sending off-node share one port: per-link contention);
  - every message also costs `MESSAGE_LATENCY_S` on the link of each of its ends (the
    launch and rendezvous of one NCCL point-to-point pair, serialized per link), so
    splitting the same bytes into more messages (a smaller fusion bucket) costs time;
  - a local copy reads and writes HBM: 2·bytes / hbm; a keep costs nothing;
  - a host staging moves bytes over PCIe at `host_bytes_per_s` (default 50 GB/s, PCIe 5 x16),
    and so do sends read from host memory (staged or offloaded shards, on the source GPU's
    PCIe link) and sends into offloaded after units (on the destination's);
  - host work per piece (`piece_s`, default 0): the runtime handles every piece it sends,
    receives or copies in Python (views, allocation, pack and unpack calls), so a round
    also lasts `piece_s` x the pieces of its busiest GPU (`pieces_per_gpu`), after its
    link time; a transition adds `fixed_s` (the agreement and commit collectives).
    Both are 0 by default; `Calibration` holds values fitted on device measurements
    (benchmarks/calibrate_cost.py), with the measured per-direction NVLink bandwidth in
    place of the cluster's `intra`.
Bytes: total = copy + send + staged; local = copy; intra / inter by node of the endpoints;
lower_bound = bytes whose owner GPU changes (computed from layouts, independently of the
DAG's source choices): after-shard bytes not already on the same GPU in the same
model-stage's before layout. Sends can never move fewer bytes than that.

Peak memory (`memory_peak`) replays the rounds as the resources pass scheduled them and as
`nereus.passes.verify` checks them: resident bytes of untouched model-stages + before
shards still on the GPU + allocations + the round's send buffers (what each send costs on
its two GPUs under the schedule's device memory model, `nereus.passes.memory_model`: on
CUDA its packed bytes on both, a send out of a staged or offloaded shard included),
measured after each round's allocs and transfers; stage_outs and frees then release.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from .dag import COPY, SEND, TransitionDag
from .layout import (box_volume, held_boxes, is_sharded, kind_volume, slot_counts, slot_specs, stage_slots,
                     zero_kind_volume)
from .memory_model import xfer_costs

HOST_BYTES_PER_S = 50e9
# Per-message latency: an NCCL send/recv pair costs of the order of 10-30 µs before its
# first byte moves (kernel launch, rendezvous, protocol setup; nccl-tests' sendrecv_perf at
# small sizes on NVLink). An assumed constant, not a measurement of this machine; the
# controller's calibration corrects the whole estimate with measured transition times.
MESSAGE_LATENCY_S = 20e-6


@dataclass(frozen=True)
class CostEstimate:
    seconds: float
    round_seconds: tuple[float, ...]
    bytes_total: int
    bytes_local: int
    bytes_intra: int
    bytes_inter: int
    bytes_staged: int
    bytes_kept: int
    lower_bound: int  # bytes whose owner changes
    messages: int = 0
    peak: "MemoryPeak | None" = None
    pieces: int = 0  # pieces of the busiest GPU, summed over rounds (pieces_per_gpu; 0 when not counted)


@dataclass(frozen=True)
class Calibration:
    """Cost-model constants fitted on measured transitions (benchmarks/calibrate_cost.py):
    `intra_bytes_per_s` replaces the cluster's NVLink figure (None: keep it), `piece_s`
    and `fixed_s` as in the module docstring. `inter_bytes_per_s` stays the cluster's:
    no inter-node link was measured. `source` says what the fit was made on."""

    intra_bytes_per_s: float | None = None
    piece_s: float = 0.0
    fixed_s: float = 0.0
    source: str = ""

    def estimate(self, program, host_bytes_per_s: float = HOST_BYTES_PER_S) -> "CostEstimate":
        return estimate(program, host_bytes_per_s, 0.0, piece_s=self.piece_s, fixed_s=self.fixed_s,
                        intra_bytes_per_s=self.intra_bytes_per_s)


@dataclass(frozen=True)
class MemoryPeak:
    """The highest memory of the worst GPU during a transition (the replay in the module
    docstring) against its usable memory (`cluster.usable_gpu_bytes`)."""

    gpu: int
    round: int  # the round at whose allocs and transfers the peak is reached; -1: before the first
    bytes: int
    capacity_bytes: int
    memory_model: str = "cuda"  # the device memory model of the replay (nereus.passes.memory_model)

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.bytes

    @property
    def fraction(self) -> float:
        return self.bytes / self.capacity_bytes


def memory_peak(program) -> MemoryPeak:
    """The peak of the per-GPU memory replay of `program` (module docstring)."""
    dag = program.dag
    model = program.schedule.memory_model
    in_host = {i for i, f in enumerate(dag.frees) if dag.stages[f.stage].before.offload}
    mem = list(dag.resident)
    for i, f in enumerate(dag.frees):
        if i not in in_host:
            mem[f.gpu] += f.shard_bytes
    best = max(range(len(mem)), key=lambda g: (mem[g], -g))
    peak = (mem[best], -1, best)
    for k, (rnd, messages) in enumerate(zip(program.schedule.rounds, program.messages)):
        for a in rnd.allocs:
            alloc = dag.allocs[a]
            if not dag.stages[alloc.stage].after.offload:
                mem[alloc.gpu] += alloc.bytes
        used = list(mem)
        for m in messages:
            for x in m.xfers:
                src_bytes, dst_bytes = xfer_costs(model, dag, x, x.free in in_host)
                used[m.src] += src_bytes
                used[m.dst] += dst_bytes
        for g, b in enumerate(used):
            if b > peak[0]:
                peak = (b, k, g)
        for f in rnd.stage_outs:
            mem[dag.frees[f].gpu] -= dag.frees[f].bytes
            in_host.add(f)
        for f in rnd.frees:
            if f not in in_host:
                mem[dag.frees[f].gpu] -= dag.frees[f].bytes
    return MemoryPeak(peak[2], peak[1], peak[0], dag.module.cluster.usable_gpu_bytes, model)


def _intersection(x, y) -> int:
    n = 1
    for (a, b), (c, d) in zip(x, y):
        lo, hi = max(a, c), min(b, d)
        if hi <= lo:
            return 0
        n *= hi - lo
    return n


def owner_change_bytes(dag: TransitionDag) -> int:
    """Bytes of after shards not held on the same GPU by the same model-stage before
    (per state group: under ZeRO the optimizer chunk of the GPU's own replica)."""
    total = 0
    for info in dag.stages:
        model, before, after = info.model, info.before, info.after
        here = {before.gpu_of(r, p, t): (r, p, t) for r in range(before.dp) for p in range(before.pp)
                for t in range(before.stage_width)}
        missing: dict = {}
        for states in info.groups:
            element_bytes = info.xfer_element_bytes(states)
            zb, za = is_sharded(before, states), is_sharded(after, states)
            for r in range(after.dp):
                for q in range(after.pp):
                    for u in range(after.stage_width):
                        held = here.get(after.gpu_of(r, q, u))
                        if held is not None:
                            held = (held[0] if zb else 0,) + held[1:]
                        key = (states, r if za else 0, q, u, held)
                        if key not in missing:
                            missing[key] = _missing_elements(model, before, after, states, *key[1:])
                        total += missing[key] * element_bytes
    return total


def _missing_elements(model, before, after, states, r: int, q: int, u: int, held) -> int:
    """Elements of `states` the after GPU at (r, q, u) needs that its own before shard
    `held` = (replica, p, t) lacks."""
    specs = slot_specs(model)
    lo, hi = stage_slots(model.layers, after.pp, q)
    counts = slot_counts(model, lo, hi)
    if after.layout is None:  # per kind, the cached volumes held_boxes' boxes add up to
        volume = zero_kind_volume(model, after.tp, u, after.dp, r) if is_sharded(after, states) else \
            kind_volume(model, after.tp, u, after.ep)
        need = sum(counts[k] * volume[k] for k in counts)
    else:
        need = sum(counts[s.kind] * sum(box_volume(b) for b in held_boxes(s.spec, after, r, u, states))
                   for s in specs)
    if held is None:
        return need
    d, p, t = held
    blo, bhi = stage_slots(model.layers, before.pp, p)
    if max(lo, blo) >= min(hi, bhi):
        return need
    both = slot_counts(model, max(lo, blo), min(hi, bhi))
    present = 0
    for s in specs:
        if both[s.kind]:
            mine = set(held_boxes(s.spec, before, d, t, states))
            present += both[s.kind] * sum(_intersection(a, b) for a in held_boxes(s.spec, after, r, u, states)
                                          for b in mine)
    return need - present


# nereus.runtime.program.JOIN_PARTS (the runtime's lowering, which the compiler does not
# import): whether the two halves of a TP-split fused tensor travel as one piece
JOIN_PARTS = False


def xfer_pieces(dag: TransitionDag, x, join: bool = True) -> int:
    """Runtime pieces of a transfer: one per (slot, state, joined box run) of its pieces;
    the runtime's lowering (nereus.runtime.program) cuts a segment by the shards' boxes
    and joins the parts of a tensor that continue each other, which for these layouts
    gives the same count (tests/passes/test_cost_pieces.py checks it on MoE programs).
    join=False: every box its own piece (the runtime before it joined parts)."""
    model = dag.stages[x.stage].model
    kinds = _spec_kinds(model)
    counts = slot_counts(model, *x.slots)
    per_kind = (counts["first"], counts["layer"], counts["last"])
    if not join:
        return len(x.states) * sum(per_kind[kinds[p.spec]] for p in x.pieces)
    # as the runtime joins: in order, a box that continues the latest one-part piece of its
    # pattern along dim 0 (same ranges elsewhere) extends it, one that repeats it further
    # down (same extent) makes it a two-part piece (with JOIN_PARTS); anything else is a new piece
    latest: dict = {}
    n = 0
    for p in x.pieces:
        box, prev = p.box, latest.get(p.spec)
        if prev is not None and prev[1] == 1 and prev[0][1:] == box[1:]:
            (lo, hi), (start, stop) = prev[0][0], box[0]
            if hi == start:
                latest[p.spec] = (((lo, stop),) + box[1:], 1)
                continue
            if JOIN_PARTS and stop - start == hi - lo and start > lo:
                latest[p.spec] = (prev[0], 2)
                continue
        n += per_kind[kinds[p.spec]]
        latest[p.spec] = (box, 1)
    return len(x.states) * n


_KINDS: dict = {}


def _spec_kinds(model) -> tuple:
    """Per tensor pattern of `model` (slot_specs order), its slot kind as 0 first, 1
    layer, 2 last (cached: a program has thousands of transfers)."""
    held = _KINDS.get(id(model))  # by identity (hashing a Model per call costs); the model is kept alive
    if held is None or held[0] is not model:
        held = _KINDS[id(model)] = (model, tuple(("first", "layer", "last").index(s.kind) for s in slot_specs(model)))
    return held[1]


def pieces_per_gpu(program, join: bool = True) -> list:
    """Per round, {gpu: pieces it sends, receives or copies} (`xfer_pieces`)."""
    dag = program.dag
    out = []
    for rnd, messages in zip(program.schedule.rounds, program.messages):
        counts: dict = defaultdict(int)
        for m in messages:
            for x in m.xfers:
                n = xfer_pieces(dag, x, join)
                counts[m.src] += n
                counts[m.dst] += n
        for x in rnd.xfers:
            if x.kind == COPY:
                counts[x.dst_gpu] += xfer_pieces(dag, x, join)
        out.append(dict(counts))
    return out


def estimate(program, host_bytes_per_s: float = HOST_BYTES_PER_S,
             message_latency_s: float = MESSAGE_LATENCY_S, *, piece_s: float = 0.0, fixed_s: float = 0.0,
             intra_bytes_per_s: float | None = None, count_pieces: bool = False) -> CostEstimate:
    """Predicted seconds, byte counts and peak memory of `program` (module docstring)."""
    dag = program.dag
    cluster = dag.module.cluster
    # counted only when asked (a piece term, or count_pieces): at 256 GPUs a program has
    # millions of pieces, and the default pipeline's estimate does not need them
    pieces = pieces_per_gpu(program) if piece_s or count_pieces else [{} for _ in program.schedule.rounds]
    seconds = []
    local = intra = inter = staged = kept = 0
    in_host = {i for i, f in enumerate(dag.frees) if dag.stages[f.stage].before.offload}
    for rnd, messages in zip(program.schedule.rounds, program.messages):
        copy_g, host_g = defaultdict(int), defaultdict(int)
        for m in messages:
            for x in m.xfers:  # reads from / writes to host memory cross PCIe
                if x.free in in_host:
                    host_g[m.src] += x.bytes
                if dag.stages[x.stage].after.offload:
                    host_g[m.dst] += x.bytes
        for x in rnd.xfers:
            if x.kind == COPY:
                copy_g[x.dst_gpu] += x.bytes
                local += x.bytes
            elif x.kind == "keep":
                kept += x.bytes
        for f in rnd.stage_outs:
            host_g[dag.frees[f].gpu] += dag.frees[f].bytes
            staged += dag.frees[f].bytes
            in_host.add(f)
        t, round_intra, round_inter = _round_seconds(cluster, ((m.src, m.dst, m.bytes) for m in messages), copy_g,
                                                     host_g, host_bytes_per_s, message_latency_s, intra_bytes_per_s)
        intra += round_intra
        inter += round_inter
        seconds.append(t + piece_s * max(pieces[len(seconds)].values(), default=0))
    busiest = defaultdict(int)
    for counts in pieces:
        for g, n in counts.items():
            busiest[g] += n
    return CostEstimate(sum(seconds) + (fixed_s if seconds else 0.0), tuple(seconds), local + intra + inter + staged,
                        local, intra, inter, staged, kept, owner_change_bytes(dag),
                        sum(len(m) for m in program.messages), memory_peak(program),
                        max(busiest.values(), default=0))


def _round_seconds(cluster, messages, copy_g: dict, host_g: dict, host_bytes_per_s: float,
                   message_latency_s: float, intra_bytes_per_s: float | None = None) -> tuple[float, int, int]:
    """(seconds, intra bytes, inter bytes) of one round: its most loaded link (module
    docstring) for `messages` as (src, dst, bytes), local copies' bytes per GPU and bytes
    over PCIe per GPU; `intra_bytes_per_s` (a Calibration's measured bandwidth) replaces
    the cluster's."""
    per_node = cluster.gpus_per_node  # (cluster.node_of inline: ~10^4 messages a round, dozens of rounds a compile)
    out_g, in_g, out_n, in_n = (defaultdict(int) for _ in range(4))
    sends_g, sends_n = defaultdict(int), defaultdict(int)  # messages per GPU link / node port
    intra = inter = 0
    for src, dst, nbytes in messages:
        src_node, dst_node = src // per_node, dst // per_node
        if src_node == dst_node:
            out_g[src] += nbytes
            in_g[dst] += nbytes
            sends_g[("out", src)] += 1
            sends_g[("in", dst)] += 1
            intra += nbytes
        else:
            out_n[src_node] += nbytes
            in_n[dst_node] += nbytes
            sends_n[("out", src_node)] += 1
            sends_n[("in", dst_node)] += 1
            inter += nbytes
    alpha = message_latency_s
    hbm = cluster.gpu.hbm_bytes_per_s
    intra_bw = intra_bytes_per_s or cluster.intra_bytes_per_s
    t = max([0.0]
            + [out_g[g] / intra_bw + alpha * sends_g[("out", g)] for g in out_g]
            + [in_g[g] / intra_bw + alpha * sends_g[("in", g)] for g in in_g]
            + [out_n[n] / cluster.inter_bytes_per_s + alpha * sends_n[("out", n)] for n in out_n]
            + [in_n[n] / cluster.inter_bytes_per_s + alpha * sends_n[("in", n)] for n in in_n]
            + [2 * b / hbm for b in copy_g.values()]
            + [b / host_bytes_per_s for b in host_g.values()])
    return t, intra, inter


def schedule_seconds(dag: TransitionDag, schedule, host_bytes_per_s: float = HOST_BYTES_PER_S,
                     message_latency_s: float = MESSAGE_LATENCY_S) -> float:
    """`estimate(program).seconds` of the program that the default pipeline lowers
    `schedule` into, from the schedule alone (`RoundClock`)."""
    clock = RoundClock(dag, host_bytes_per_s, message_latency_s)
    for rnd in schedule.rounds:
        clock.add(rnd)
    return clock.seconds


class RoundClock:
    """The predicted seconds of a schedule's rounds, added one at a time (a scheduler can
    stop once it is slower than an alternative). Fusion without a bucket (the default
    pipeline) sends one message per (src, dst) pair and round, so the links carry the
    bytes and messages that `estimate` charges; with a bucket, fusion splits large pairs
    into more messages, each `message_latency_s` more."""

    def __init__(self, dag: TransitionDag, host_bytes_per_s: float = HOST_BYTES_PER_S,
                 message_latency_s: float = MESSAGE_LATENCY_S):
        self.dag = dag
        self.host_bytes_per_s = host_bytes_per_s
        self.message_latency_s = message_latency_s
        self.in_host = {i for i, f in enumerate(dag.frees) if dag.stages[f.stage].before.offload}
        self.offloaded = [info.after.offload for info in dag.stages]
        self.seconds = 0.0

    def add(self, rnd) -> float:
        """Adds round `rnd` (a `resources.Round`); returns its seconds."""
        dag, in_host, offloaded = self.dag, self.in_host, self.offloaded
        pairs, copy_g, host_g = defaultdict(int), defaultdict(int), defaultdict(int)
        for x in rnd.xfers:
            if x.kind == SEND:
                pairs[(x.src_gpu, x.dst_gpu)] += x.bytes
                if x.free in in_host:
                    host_g[x.src_gpu] += x.bytes
                if offloaded[x.stage]:
                    host_g[x.dst_gpu] += x.bytes
            elif x.kind == COPY:
                copy_g[x.dst_gpu] += x.bytes
        for f in rnd.stage_outs:
            host_g[dag.frees[f].gpu] += dag.frees[f].bytes
            in_host.add(f)
        t = _round_seconds(dag.module.cluster, ((src, dst, b) for (src, dst), b in pairs.items()), copy_g, host_g,
                           self.host_bytes_per_s, self.message_latency_s)[0]
        self.seconds += t
        return t


@dataclass(frozen=True)
class LinkBounds:
    """Lower bounds on a program's time from its bytes alone (any schedule, same sources):
    `aggregate_seconds` spreads the inter-node bytes over every node's port (each
    direction at `inter`), `busiest_nic_seconds` is the most loaded port's own bytes
    (out or in, summed over rounds) at `inter`, `busiest_gpu_seconds` the same for
    NVLink at `intra`. The predicted time is at least the largest of them."""

    aggregate_seconds: float
    busiest_nic_seconds: float
    busiest_node: int
    busiest_gpu_seconds: float
    predicted_seconds: float

    def to_json(self) -> dict:
        return {"aggregate_s": self.aggregate_seconds, "busiest_nic_s": self.busiest_nic_seconds,
                "busiest_node": self.busiest_node, "busiest_gpu_s": self.busiest_gpu_seconds,
                "predicted_s": self.predicted_seconds,
                "predicted_over_busiest": (self.predicted_seconds / self.busiest_nic_seconds
                                           if self.busiest_nic_seconds else None)}


def link_bounds(program, estimate_: CostEstimate | None = None) -> LinkBounds:
    """`LinkBounds` of `program` (a lowered Program)."""
    cluster = program.dag.module.cluster
    node_of = cluster.node_of
    out_n, in_n, out_g, in_g = (defaultdict(int) for _ in range(4))
    inter = 0
    for messages in program.messages:
        for m in messages:
            if node_of(m.src) == node_of(m.dst):
                out_g[m.src] += m.bytes
                in_g[m.dst] += m.bytes
            else:
                out_n[node_of(m.src)] += m.bytes
                in_n[node_of(m.dst)] += m.bytes
                inter += m.bytes
    busiest = max(((max(out_n.get(n, 0), in_n.get(n, 0)), n) for n in set(out_n) | set(in_n)), default=(0, 0))
    gpu = max(list(out_g.values()) + list(in_g.values()), default=0)
    seconds = (estimate_ or estimate(program)).seconds
    return LinkBounds(inter / (cluster.nodes * cluster.inter_bytes_per_s), busiest[0] / cluster.inter_bytes_per_s,
                      busiest[1], gpu / cluster.intra_bytes_per_s, seconds)
