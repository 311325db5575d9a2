"""Plan search: every model-stage's (dp, tp, pp) and placement minimising predicted step latency.

Input: a module (cluster, models), a workload, a GPU budget G (the lowest G ids, whole
nodes), a CostModel. Output: a SearchResult holding a `Plan` of the IR (printable as `.nir`).
Invariant: the returned plan is memory-feasible by `memory.plan_memory` (the feasibility
pass's rule, with generation waves when allowed) and no other plan of the search space
has a lower predicted step latency (brute force agrees on small cases, tests/controller).

Search space (placements in the colocated style of verl / the paper's S1: every
model-stage on GPUs 0..G−1, stages run one after another, model-stages of a stage one after
another on the shared GPUs):
  tp divides gpus_per_node (TP groups never straddle nodes: node alignment) and obeys the
  IR's head/kv-head/ffn/vocab rules; pp ≤ layers; tp·pp divides G (the divisor lattice),
  dp = G/(tp·pp) ≤ batch; inference units may be offloaded to host memory; training units
  with dp > 1 may shard their state with `zero 1` or `zero 3` (the compiler's memory model
  counts each replica's chunk; the search counts every replica as replica 0, whose chunk
  is the largest: an upper bound within a row per tensor). Not searched: expert
  parallelism and offloaded training or generation, which the cost model does not price
  (a plan holding them is still judged exactly by `memory.plan_memory`).

Decomposition: a model-stage's latency depends only on its own layout, except generation,
whose KV waves depend on what else is resident; memory couples all choices through per-GPU
sums, and offloaded units through each node's host memory (checked on complete
assignments). So: (1) per model-stage candidates with their times and per-GPU memory vectors over
one period Q = lcm(tp·pp) of GPU positions (every position ≡ q mod Q holds the same bytes);
(2) drop candidates dominated in time and in every memory entry; (3) enumerate (generation
layout, waves w) pairs cheapest first — fixing w makes the KV cache a fixed working set — and
under each, branch and bound over the other model-stages, bounding time by the sum of
remaining minima and memory by elementwise minima; stop when a pair's time plus the
remaining minima cannot beat the incumbent. (With several generation model-stages their
layouts are enumerated at the leaves instead.)

`search_plans(..., top=K)` (what `nereusc search` prints) is the same search for the K best
distinct plans: the bound is the K-th best time found, and step (2) drops a candidate only
when K others dominate it.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from nereus.ir.gpuset import items_for
from nereus.ir.model import ZERO_STAGES, Module, ModelStage, Placement, Plan, Workload

from .cost_model import CostModel, Layout
from .memory import active_stages, gpu_sequences, light, unit_memory, waves_for


@dataclass(frozen=True)
class Choice:
    model_stage: ModelStage
    dp: int
    tp: int
    pp: int
    offload: bool = False
    zero: int = 0  # ZeRO stage of a training unit (docs/ir.md)
    ep: int = 1  # expert parallelism: never searched, kept when a plan is rescaled


@dataclass(frozen=True)
class SearchResult:
    plan: Optional[Plan]  # None when nothing fits
    predicted_s: float  # predicted step latency (inf when nothing fits)
    stage_seconds: dict  # str(model_stage) -> predicted seconds
    waves: dict  # str(model_stage) -> generation waves
    candidates: int  # candidate layouts considered (before dominance pruning)
    leaves: int  # complete assignments evaluated
    search_s: float  # wall time of the search


def tp_allowed(model, tp: int, gpus_per_node: int) -> bool:
    """The IR's TP rules (docs/ir.md) plus node alignment."""
    if gpus_per_node % tp or model.heads % tp or model.ffn % tp:
        return False
    if model.head == "lm" and model.vocab % tp:
        return False
    if tp <= model.kv_heads:
        return model.kv_heads % tp == 0
    return tp % model.kv_heads == 0


def candidate_choices(module: Module, workload: Workload, model_stage: ModelStage, gpus: int,
                      allow_offload: bool = True) -> list[Choice]:
    """Every (dp, tp, pp[, offload]) of `model_stage` on `gpus` GPUs, in a fixed order."""
    model = module.model(model_stage.model)
    out = []
    for tp in range(1, module.cluster.gpus_per_node + 1):
        if not tp_allowed(model, tp, module.cluster.gpus_per_node):
            continue
        for pp in range(1, model.layers + 1):
            if gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            if dp > workload.batch:
                continue
            out.append(Choice(model_stage, dp, tp, pp, False))
            if model_stage.stage == "training" and dp > 1:
                out.extend(Choice(model_stage, dp, tp, pp, False, zero) for zero in ZERO_STAGES if zero)
            if allow_offload and model_stage.stage == "inference" and \
                    _fits_host(module, model, model_stage, tp, pp, min(gpus, module.cluster.gpus_per_node)):
                out.append(Choice(model_stage, dp, tp, pp, True))
    return out


def _fits_host(module: Module, model, model_stage: ModelStage, tp: int, pp: int, per_node: int) -> bool:
    """Whether this model-stage offloaded alone fits its nodes' host memory (the plan check
    counts every offloaded model-stage together; several that fit alone may not)."""
    from nereus.passes.feasibility import model_state_bytes_per_gpu

    largest = max(model_state_bytes_per_gpu(model, model_stage.stage, tp, pp, p)["weights"] for p in range(pp))
    return largest * per_node <= module.cluster.host_mem_bytes


def build_plan(module: Module, choices: dict, gpus: int, name: str, model_stages=None) -> Plan:
    """A Plan placing every model-stage (workload order; or those of `model_stages`) on GPUs
    0..gpus−1."""
    ids = tuple(range(gpus))
    items = items_for(ids)
    placements = tuple(
        Placement(ms, c.dp, c.tp, c.pp, ids, items, c.offload, c.zero, ep=c.ep)
        for ms in (module.workload.model_stages() if model_stages is None else model_stages)
        for c in [choices[ms]]
    )
    return Plan(name, None, placements, placements)


@dataclass
class _Candidate:
    choice: Choice
    seconds: float  # for generation: seconds at one wave
    resident: np.ndarray  # [stages, Q]
    working: np.ndarray  # [Q] (generation: per sequence)
    host: np.ndarray  # [nodes]: offloaded bytes in each node's host memory (zeros unless offloaded)


class _Space:
    """Candidates with times and memory vectors for one (workload, G, cost-model) search."""

    def __init__(self, module: Module, workload: Workload, cost: CostModel, gpus: int, allow_waves: bool,
                 allow_offload: bool, memo: Optional[dict] = None):
        self.module = light(module)
        self.workload = workload
        self.cost = cost
        self.gpus = gpus
        self.allow_waves = allow_waves
        self.stages = active_stages(workload)
        self.capacity = float(module.cluster.usable_gpu_bytes)
        self.host_capacity = float(module.cluster.host_mem_bytes)
        self._no_host = np.zeros(-(-gpus // module.cluster.gpus_per_node))
        self.spans_nodes = gpus > module.cluster.gpus_per_node
        self.model_stages = [ms for ms in workload.model_stages()]
        self.choices = {ms: candidate_choices(module, workload, ms, gpus, allow_offload) for ms in self.model_stages}
        sizes = [c.tp * c.pp for cs in self.choices.values() for c in cs] or [1]
        self.period = math.lcm(*sizes)
        self._gen_seconds: dict = {}
        self._candidates: dict = {}
        # memory vectors depend on the choice, the workload and the period, not on the cost
        # model: a caller's memo keeps them across searches (one memo per module)
        self._memo = memo if memo is not None else {}

    def candidate(self, choice: Choice) -> _Candidate:
        got = self._candidates.get(choice)
        if got is None:
            got = self._candidates[choice] = self._candidate(choice)
        return got

    def _candidate(self, choice: Choice) -> _Candidate:
        key = (choice, self.workload, self.period, self.stages)
        vectors = self._memo.get(key)
        if vectors is None:
            if len(self._memo) > 20_000:
                self._memo.clear()
            ms = choice.model_stage
            unit = unit_memory(self.module, self.workload, ms, choice.dp, choice.tp, choice.pp, choice.offload,
                               choice.zero, choice.ep, every_replica=False)
            res, work = unit.vectors(self.period)
            resident = np.zeros((len(self.stages), self.period))
            own = self.stages.index(ms.stage)
            for x in range(len(self.stages)):
                if not choice.offload or x == own:
                    resident[x] = res
            vectors = self._memo[key] = (resident, work, self._host(unit) if choice.offload else self._no_host)
        return _Candidate(choice, self.seconds(choice, 1), *vectors)

    def _host(self, unit) -> np.ndarray:
        """Bytes an offloaded unit on GPUs 0..G−1 keeps in each node's host memory."""
        width = self.module.cluster.gpus_per_node
        per_gpu = np.tile(unit.host_vector(self.period), self.gpus // self.period)
        return np.add.reduceat(per_gpu, np.arange(0, self.gpus, width))

    def host_fits(self, chosen) -> bool:
        """Whether the offloaded units among `chosen` (_Candidates) fit every node's host memory
        together (each was offered only if it fits alone)."""
        offloaded = [c.host for c in chosen if c.choice.offload]
        return len(offloaded) < 2 or bool((sum(offloaded) <= self.host_capacity).all())

    def seconds(self, choice: Choice, waves: int) -> float:
        key = (choice, waves)
        value = self._gen_seconds.get(key)
        if value is None:
            layout = Layout(choice.dp, choice.tp, choice.pp, choice.offload, waves, self.spans_nodes, choice.zero)
            value = self.cost.predict(self.workload, choice.model_stage, layout)
            self._gen_seconds[key] = value
        return value

    def finish(self, resident: np.ndarray, working: np.ndarray, generation: list[_Candidate]):
        """Complete an assignment: (seconds of the generation units, waves) or None if it does
        not fit. `resident` [stages, Q] and `working` [stages, Q] hold the other units."""
        resident = resident + sum(g.resident for g in generation) if generation else resident
        cap = self.capacity
        x_gen = self.stages.index("generation") if "generation" in self.stages else -1
        for x in range(len(self.stages)):
            if x != x_gen and (resident[x] + working[x] > cap).any():
                return None
        seconds, waves = 0.0, {}
        gen_working = np.zeros(self.period)
        for g in generation:
            sequences = gpu_sequences(self.workload.batch, g.choice.dp, g.choice.ep)
            w = waves_for(cap - resident[x_gen], g.working, sequences, self.allow_waves)
            if w == 0:
                return None
            gen_working = np.maximum(gen_working, g.working * math.ceil(sequences / w))
            waves[g.choice.model_stage] = w
            seconds += self.seconds(g.choice, w)
        if x_gen >= 0 and (resident[x_gen] + np.maximum(working[x_gen], gen_working) > cap).any():
            return None
        return seconds, waves


def _pareto(candidates: list[_Candidate], top: int = 1) -> list[_Candidate]:
    """The candidates fewer than `top` kept ones dominate (at least as good in time and in
    every memory entry), cheapest first; one vectorised comparison against all kept rows per
    candidate. A candidate that `top` others dominate is in none of the `top` best plans:
    swapping it for each of them gives `top` plans that fit and are at least as fast."""
    ordered = sorted(candidates, key=lambda c: c.seconds)
    if not ordered:
        return []
    rows = np.array([np.concatenate(([c.seconds], c.resident.ravel(), c.working.ravel(), c.host)) for c in ordered])
    kept: list[int] = []
    for i in range(len(ordered)):
        if not kept or int((rows[kept] <= rows[i]).all(axis=1).sum()) < top:
            kept.append(i)
    return [ordered[i] for i in kept]


class _Best:
    """The `top` fastest distinct assignments offered so far, and the bound they set: the
    `top`-th best seconds (inf while fewer are known). An assignment is its choices; offered
    again with more generation waves (a slower (layout, w) pair of the same plan) it is the
    same plan and is kept at its least time."""

    def __init__(self, top: int):
        self.top = top
        self.found: dict = {}  # frozenset of choices -> (seconds, choices, waves)
        self.seconds = math.inf

    def offer(self, seconds: float, choices: dict, waves: dict) -> None:
        if seconds >= self.seconds:
            return
        key = frozenset(choices.values())
        known = self.found.get(key)
        if known is not None and known[0] <= seconds:
            return
        self.found[key] = (seconds, choices, waves)
        if len(self.found) > self.top:
            del self.found[max(self.found, key=lambda k: self.found[k][0])]
        if len(self.found) == self.top:
            self.seconds = max(entry[0] for entry in self.found.values())

    def ranked(self) -> list:
        """(seconds, choices, waves), fastest first (ties in a fixed order: the choices)."""
        return sorted(self.found.values(), key=lambda e: (e[0], sorted(map(repr, e[1].values()))))


@lru_cache(maxsize=1024)
def _wave_counts(replica_batch: int) -> tuple[int, ...]:
    """Every distinct ⌈B/b⌉ for b = 1..B: the wave counts a replica of B sequences can need.
    O(√B) steps, not B (a batch of millions is a valid workload): from a b with
    ⌈B/b⌉ = q > 1, the next value starts at b = ⌈B/(q−1)⌉, the first b with ⌈B/b⌉ ≤ q − 1."""
    out, b = [], 1
    while b <= replica_batch:
        q = -(-replica_batch // b)
        out.append(q)
        if q == 1:
            break
        b = max(b + 1, -(-replica_batch // (q - 1)))
    return tuple(sorted(out))


def _incumbent(space: _Space, plan: Optional[Plan]):
    """(seconds, choices, waves) of `plan` evaluated exactly as the search evaluates its leaves,
    or None when it lies outside the search space (other GPUs, a layout not offered) or does
    not fit: a valid upper bound that only prunes."""
    if plan is None:
        return None
    ids = tuple(range(space.gpus))
    choices = {}
    for ms in space.model_stages:
        try:
            p = plan.placement(ms)
        except KeyError:
            return None
        choice = Choice(ms, p.dp, p.tp, p.pp, p.offload, p.zero if ms.stage == "training" else 0, p.ep)
        if p.gpus != ids or choice not in space.choices[ms]:
            return None
        choices[ms] = choice
    resident = np.zeros((len(space.stages), space.period))
    working = np.zeros((len(space.stages), space.period))
    seconds, gens = 0.0, []
    for ms, choice in choices.items():
        c = space.candidate(choice)
        if ms.stage == "generation":
            gens.append(c)
            continue
        resident += c.resident
        x = space.stages.index(ms.stage)
        working[x] = np.maximum(working[x], c.working)
        seconds += c.seconds
    done = space.finish(resident, working, gens)
    if done is None or not space.host_fits([space.candidate(c) for c in choices.values()]):
        return None
    return seconds + done[0], choices, done[1]


def _result(space: _Space, best, candidates: int, leaves: int, began: float, name: str) -> SearchResult:
    if best is None:
        return SearchResult(None, math.inf, {}, {}, candidates, leaves, time.perf_counter() - began)
    total, choices, waves = best
    stage_seconds = {str(ms): space.seconds(c, waves.get(ms, 1)) for ms, c in choices.items()}
    plan = build_plan(space.module, choices, space.gpus, name)
    return SearchResult(plan, total, stage_seconds, {str(k): v for k, v in waves.items()}, candidates, leaves,
                        time.perf_counter() - began)


def search_plan(module: Module, workload: Workload, cost: CostModel, gpus: int, name: str = "best",
                allow_waves: bool = True, allow_offload: bool = True, incumbents: tuple = (),
                memo: Optional[dict] = None) -> SearchResult:
    """The plan of least predicted step latency on GPUs 0..gpus−1 (see module docstring).

    `incumbents`: plans already known (the running plan, the last search's result): the best
    of them that fits is the starting bound, so branches that cannot beat it are cut from
    the start; it is returned when nothing is strictly faster (the optimum is unchanged).
    `memo`: a dict the caller keeps for one module: candidates' memory vectors are stored
    there and reused by later searches at the same workload (the controller's 1% grid).

    With one generation model-stage (the RL case) the search branches first on (generation
    layout, waves w), cheapest T_gen(w) first: fixing w turns the KV cache into a plain
    working set of ⌈B_r/w⌉ sequences, so the rest is a branch and bound with a fixed time for
    generation. An assignment's true waves are the least w that fits, and a larger w only
    costs more, so the minimum over (layout, w) is the true optimum."""
    return search_plans(module, workload, cost, gpus, 1, name, allow_waves, allow_offload, incumbents, memo)[0]


def search_plans(module: Module, workload: Workload, cost: CostModel, gpus: int, top: int, name: str = "best",
                 allow_waves: bool = True, allow_offload: bool = True, incumbents: tuple = (),
                 memo: Optional[dict] = None) -> list[SearchResult]:
    """The `top` plans of least predicted step latency, fastest first (`search_plan`'s search
    with the `top`-th best time as its bound; `nereusc search` prints them). Distinct plans:
    two results differ in some model-stage's layout. Fewer than `top` when fewer fit; one
    result with `plan` None when none does. Plans are named `name`, or `name`1, `name`2, ...
    when `top` > 1. Every result shares the search's counts and wall time."""
    began = time.perf_counter()
    space = _Space(module, workload, cost, gpus, allow_waves, allow_offload, memo)
    count = sum(len(c) for c in space.choices.values())
    gen_ms = [ms for ms in space.model_stages if ms.stage == "generation"]
    other_ms = [ms for ms in space.model_stages if ms.stage != "generation"]
    best = _Best(top)
    for plan in incumbents:
        known = _incumbent(space, plan)
        if known is not None:
            best.offer(*known)
    state = {"leaves": 0}

    def results() -> list[SearchResult]:
        ranked = best.ranked()
        if not ranked:
            return [_result(space, None, count, state["leaves"], began, name)]
        names = [name] if top == 1 else [f"{name}{k + 1}" for k in range(len(ranked))]
        return [_result(space, entry, count, state["leaves"], began, n) for entry, n in zip(ranked, names)]

    # a choice whose own time plus every other model-stage's fastest cannot beat the bound is
    # in none of the best plans: its memory vectors are never computed
    fastest = {ms: min((space.seconds(c, 1) for c in space.choices[ms]), default=math.inf)
               for ms in space.model_stages}
    floor = sum(fastest.values())
    useful = {ms: [c for c in space.choices[ms] if space.seconds(c, 1) + floor - fastest[ms] < best.seconds]
              for ms in space.model_stages}
    gen_lists = [sorted((space.candidate(c) for c in useful[ms]), key=lambda c: c.seconds) for ms in gen_ms]
    lists = [_pareto([space.candidate(c) for c in useful[ms]], top) for ms in other_ms]
    if any(not lst for lst in lists + gen_lists):
        return results()  # the incumbents alone, or none when nothing fits
    # branch on the model-stages whose choice matters most first
    order = sorted(range(len(lists)), key=lambda i: -(lists[i][-1].seconds - lists[i][0].seconds))
    lists = [lists[i] for i in order]
    n, stages, period = len(lists), len(space.stages), space.period
    cap = space.capacity
    min_seconds = [min(c.seconds for c in lst) for lst in lists]
    lb_seconds = [sum(min_seconds[i:]) for i in range(n + 1)]
    min_res = [np.min([c.resident for c in lst], axis=0) for lst in lists]
    lb_res = [sum(min_res[i:], np.zeros((stages, period))) for i in range(n + 1)]
    lb_work = []
    for i in range(n + 1):
        w = np.zeros((stages, period))
        for lst in lists[i:]:
            x = space.stages.index(lst[0].choice.model_stage.stage)
            w[x] = np.maximum(w[x], np.min([c.working for c in lst], axis=0))
        lb_work.append(w)
    stage_of = [space.stages.index(lst[0].choice.model_stage.stage) for lst in lists]
    chosen: list[_Candidate] = []

    def descend(i: int, seconds: float, resident: np.ndarray, working: np.ndarray, leaf):
        if seconds + lb_seconds[i] >= best.seconds:
            return
        if (resident + lb_res[i] + np.maximum(working, lb_work[i]) > cap).any():
            return
        if i == n:
            leaf(seconds, resident, working)
            return
        x = stage_of[i]
        for c in lists[i]:  # cheapest first: once one cannot beat the bound, none after it can
            if seconds + c.seconds + lb_seconds[i + 1] >= best.seconds:
                break
            new_working = working.copy()
            new_working[x] = np.maximum(new_working[x], c.working)
            chosen.append(c)
            descend(i + 1, seconds + c.seconds, resident + c.resident, new_working, leaf)
            chosen.pop()

    zeros = np.zeros((stages, period))
    if len(gen_lists) == 1 and "generation" in space.stages:
        x_gen = space.stages.index("generation")
        # (layout, w) pairs cheapest first, lazily: a layout's time grows with its waves, so
        # its next pair is priced only once its previous one has been taken off the heap
        # (most layouts' many wave counts are never priced at all)
        heap = []
        waves_of = []
        for k, g in enumerate(gen_lists[0]):
            replica_batch = gpu_sequences(workload.batch, g.choice.dp, g.choice.ep)
            waves_of.append((_wave_counts(replica_batch) if allow_waves else (1,), replica_batch))
            heapq.heappush(heap, (space.seconds(g.choice, waves_of[k][0][0]), waves_of[k][0][0], k, 0))
        while heap:
            gen_seconds, w, k, position = heapq.heappop(heap)
            if gen_seconds + lb_seconds[0] >= best.seconds:
                break
            g, (wave_counts, replica_batch) = gen_lists[0][k], waves_of[k]
            if position + 1 < len(wave_counts):
                nxt = wave_counts[position + 1]
                heapq.heappush(heap, (space.seconds(g.choice, nxt), nxt, k, position + 1))
            working = zeros.copy()
            working[x_gen] = g.working * math.ceil(replica_batch / w)

            def leaf(seconds, resident, work, g=g, w=w):
                state["leaves"] += 1
                # descend started from gen_seconds: `seconds` is the whole step
                if space.host_fits(chosen + [g]):
                    best.offer(seconds, {c.choice.model_stage: c.choice for c in chosen + [g]},
                               {g.choice.model_stage: w})

            descend(0, gen_seconds, g.resident.copy(), working, leaf)
        return results()

    def leaf(seconds, resident, working):
        for gens in itertools.product(*gen_lists):
            lower = seconds + sum(g.seconds for g in gens)
            if lower >= best.seconds:
                continue
            state["leaves"] += 1
            done = space.finish(resident, working, list(gens))
            if done is None or not space.host_fits(chosen + list(gens)):
                continue
            best.offer(seconds + done[0], {c.choice.model_stage: c.choice for c in chosen + list(gens)}, done[1])

    descend(0, 0.0, zeros.copy(), zeros.copy(), leaf)
    return results()


def brute_force_plan(module: Module, workload: Workload, cost: CostModel, gpus: int, name: str = "best",
                     allow_waves: bool = True, allow_offload: bool = True, top: int = 1):
    """Every combination of every model-stage's candidates, no pruning (for tests, small
    cases): the best SearchResult, or with `top` > 1 the list `search_plans` would give."""
    began = time.perf_counter()
    space = _Space(module, workload, cost, gpus, allow_waves, allow_offload)
    count = sum(len(c) for c in space.choices.values())
    cands = {ms: [space.candidate(c) for c in space.choices[ms]] for ms in space.model_stages}
    best, leaves = _Best(top), 0
    for combo in itertools.product(*(cands[ms] for ms in space.model_stages)):
        leaves += 1
        resident = np.zeros((len(space.stages), space.period))
        working = np.zeros((len(space.stages), space.period))
        gens = []
        seconds = 0.0
        for c in combo:
            if c.choice.model_stage.stage == "generation":
                gens.append(c)
                continue
            resident += c.resident
            x = space.stages.index(c.choice.model_stage.stage)
            working[x] = np.maximum(working[x], c.working)
            seconds += c.seconds
        if seconds + sum(g.seconds for g in gens) >= best.seconds:
            continue  # generation at one wave is its fastest: this combination cannot win
        done = space.finish(resident, working, gens)
        if done is not None and space.host_fits(combo):
            best.offer(seconds + done[0], {c.choice.model_stage: c.choice for c in combo}, done[1])
    ranked = best.ranked()
    if top == 1:
        return _result(space, ranked[0] if ranked else None, count, leaves, began, name)
    return [_result(space, entry, count, leaves, began, f"{name}{k + 1}") for k, entry in enumerate(ranked)]
