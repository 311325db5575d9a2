"""verify: JSON program v1 → VerifyReport, or ProgramError naming the round and op.

Input: a program dict (docs/program.md). Output: a `VerifyReport` (rounds, ops, bytes,
per-GPU peak memory). A symbolic replay proves:
  - layouts: every unit's shards lie inside their tensors, boxes of one shard differ only
    in dim 0 (local shard contract), and per unit the boxes of each tensor its model-stage
    holds tile the tensor (replicated copies identical, others disjoint); under `zero` the
    optimizer tensors (`#` names) are tiled by the model-stage's units together instead;
  - every box of every after-unit shard is written exactly once (keep, copy or send), from a
    before-unit shard that holds it (box inside one of its boxes) and is not yet freed, into
    an allocated after shard (box inside one of its boxes); a keep hands a whole identical
    shard over on one GPU;
  - ops of a round come in phase order (alloc; keep, copy, send; stage_out, free); a send has
    distinct GPUs (its receive is the same record, so it is matched in the same round);
  - declared bytes equal segment volumes × dtype sizes; alloc bytes equal the after shard
    minus what is kept into it; free and stage_out bytes equal the before shard minus what
    is kept out of it; every after shard allocated once, every before shard freed once;
  - memory on every GPU after each round's allocs and transfers — resident_bytes + before
    shards still on the GPU + allocations + the round's send buffers (on both GPUs; a send
    from a host-staged shard packs in host memory) — stays ≤ capacity_bytes (mem_bytes if
    absent); host memory per node ≤ host_mem_bytes.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from dataclasses import dataclass

from nereus.ir.diagnostics import ProgramError
from nereus.ir.program import program_from_json
from nereus.ir.model import DTYPE_BYTES
from nereus.ir.units import human_bytes

PHASE = {"alloc": 0, "keep": 1, "copy": 1, "send": 1, "stage_out": 2, "free": 2}


@dataclass(frozen=True)
class VerifyReport:
    rounds: int
    ops: int
    segments: int
    bytes_moved: int  # copy + send bytes
    peak_bytes: dict  # gpu -> highest memory seen
    worst_gpu: int
    worst_fraction: float  # peak / capacity on the worst GPU

    def __str__(self) -> str:
        return (f"ok: {self.rounds} rounds, {self.ops} ops, {self.segments} segments, {human_bytes(self.bytes_moved)} moved;"
                f" peak {self.worst_fraction:.1%} of capacity on GPU {self.worst_gpu}")


def _volume(box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _inside(inner, outer) -> bool:
    return all(a >= c and b <= d for (a, b), (c, d) in zip(inner, outer))


def _overlap(x, y) -> bool:
    return all(a < d and c < b for (a, b), (c, d) in zip(x, y))


def _tb(box) -> tuple:
    return tuple((int(lo), int(hi)) for lo, hi in box)


def _fail(message: str, hint: str | None = None):
    raise ProgramError(message, hint=hint)


def _check_units(units, tensors, where: str) -> dict:
    """{unit id: {gpu: {tensor: tuple(boxes)}}} after checking shapes, contract and coverage."""
    out: dict = {}
    sharded: dict = defaultdict(lambda: defaultdict(set))  # model-stage -> optimizer tensor -> boxes
    for unit in units:
        uid = unit["id"]
        if uid in out:
            _fail(f"{where} unit {uid} listed twice")
        shards: dict = defaultdict(dict)
        gpus = set(unit["gpus"])
        for shard in unit["shards"]:
            name, g = shard["tensor"], shard["gpu"]
            if name not in tensors:
                _fail(f"{where} unit {uid}: unknown tensor {name}")
            if g not in gpus:
                _fail(f"{where} unit {uid}: shard of {name} on GPU {g}, not one of the unit's GPUs")
            shape = tensors[name][0]
            boxes = tuple(_tb(b) for b in shard["boxes"])
            for box in boxes:
                if len(box) != len(shape) or any(not (0 <= lo < hi <= n) for (lo, hi), n in zip(box, shape)):
                    _fail(f"{where} unit {uid}: box {box} outside {name} {list(shape)}")
                if box[1:] != boxes[0][1:]:
                    _fail(f"{where} unit {uid}: boxes of {name} on GPU {g} differ beyond dim 0",
                          hint="the local shard contract concatenates boxes along dim 0")
            if name in shards[g]:
                _fail(f"{where} unit {uid}: two shards of {name} on GPU {g}")
            shards[g][name] = boxes
        model, _, stage = unit["model_stage"].partition(".")
        zero = bool(unit.get("zero"))
        if zero:  # every chunk of a GPU may be empty (dim 0 shorter than dp): it still has its ops
            for g in unit["gpus"]:
                shards.setdefault(g, {})
        expected = {n for n in tensors if n.startswith(model + "/") and ("#" not in n or stage == "training" and not zero)
                    and not (zero and unit["zero"] >= 3)}
        boxes_of: dict = defaultdict(set)
        for per_gpu in shards.values():
            for name, boxes in per_gpu.items():
                split = zero and ("#" in name or unit["zero"] >= 3)  # zero 3: the weights too
                (sharded[unit["model_stage"]][name] if split else boxes_of[name]).update(boxes)
        if set(boxes_of) != expected:
            missing = sorted(expected - set(boxes_of))[:3]
            _fail(f"{where} unit {uid} does not cover its tensors (missing {missing or 'none'},"
                  f" extra {sorted(set(boxes_of) - expected)[:3] or 'none'})")
        _check_tiling(boxes_of, tensors, f"{where} unit {uid}")
        out[uid] = shards
    for model_stage, boxes_of in sharded.items():
        model = model_stage.partition(".")[0]
        every = any(u.get("zero", 0) >= 3 for u in units if u["model_stage"] == model_stage)
        missing = {n for n in tensors if n.startswith(model + "/") and ("#" in n or every)} - set(boxes_of)
        if missing:
            _fail(f"{where} units of {model_stage} (zero) hold no chunk of {sorted(missing)[:3]}")
        _check_tiling(boxes_of, tensors, f"{where} units of {model_stage} (zero)")
    return out


def _check_tiling(boxes_of: dict, tensors: dict, who: str) -> None:
    """The boxes of each tensor tile it: identical or disjoint, covering every element."""
    for name, boxes in boxes_of.items():
        distinct = sorted(boxes)
        for i, x in enumerate(distinct):
            for y in distinct[i + 1:]:
                if _overlap(x, y):
                    _fail(f"{who}: boxes {x} and {y} of {name} overlap without being identical")
        shape = tensors[name][0]
        if sum(_volume(b) for b in distinct) != _volume(tuple((0, n) for n in shape)):
            _fail(f"{who}: the boxes of {name} do not cover the tensor")


def verify_program(program_json: dict) -> VerifyReport:
    """Replay `program_json` symbolically (module docstring); raise ProgramError on the
    first violation, naming its round and op index."""
    enabled = gc.isenabled()
    gc.disable()  # many small acyclic tuples: cycle collection only costs time here
    try:
        return _verify(program_json)
    finally:
        if enabled:
            gc.enable()


def _verify(program_json: dict) -> VerifyReport:
    data = program_from_json(program_json).data
    tensors = {t["name"]: (tuple(t["shape"]), DTYPE_BYTES[t["dtype"]]) for t in data["tensors"]}
    before = _check_units(data["units"]["before"], tensors, "before")
    after = _check_units(data["units"]["after"], tensors, "after")
    capacity = {g["id"]: g.get("capacity_bytes", g["mem_bytes"]) for g in data["gpus"]}
    node_of = {g["id"]: g["node"] for g in data["gpus"]}
    host_cap = {n["id"]: n["host_mem_bytes"] for n in data.get("nodes", [])}

    def shard_bytes(shards) -> int:
        return sum(_volume(b) * tensors[name][1] for name, boxes in shards.items() for b in boxes)

    mem = defaultdict(int)
    for g, b in data["resident_bytes"].items():
        mem[int(g)] += b
    status = {}
    host = defaultdict(int)
    offloaded = {u["id"] for u in data["units"]["after"] if u.get("offload")}
    for unit in data["units"]["before"]:
        uid = unit["id"]
        for g, shards in before[uid].items():
            if unit.get("offload"):  # state of an offloaded model-stage waits in host memory
                host[node_of[g]] += shard_bytes(shards)
                status[(uid, g)] = "host"
            else:
                mem[g] += shard_bytes(shards)
                status[(uid, g)] = "gpu"
    kept_into, kept_out = defaultdict(int), defaultdict(int)
    for rnd in data["rounds"]:
        for op in rnd["ops"]:
            if op["op"] == "keep":
                for s in op["segments"]:
                    b = _volume(s["box"]) * tensors[s["tensor"]][1] if s["tensor"] in tensors else 0
                    kept_into[(s["dst_unit"], op["gpu"])] += b
                    kept_out[(s["src_unit"], op["gpu"])] += b
    allocated = set()
    written: dict = defaultdict(list)
    peak = dict(mem)
    ops = segments = moved = 0
    for k, rnd in enumerate(data["rounds"]):
        phase = 0
        transient = defaultdict(int)
        keeps = defaultdict(list)
        for i, op in enumerate(rnd["ops"]):
            kind = op["op"]
            where = f"round {k}, op {i} ({kind})"
            if kind not in PHASE:
                _fail(f"{where}: unknown op", hint="ops are alloc, keep, copy, send, stage_out, free")
            if PHASE[kind] < phase:
                _fail(f"{where}: out of phase order", hint="a round runs allocs, then transfers, then frees")
            if PHASE[kind] > 1 and phase <= 1:
                _check_memory(k, mem, transient, capacity, peak)
            phase = PHASE[kind]
            ops += 1
            if kind == "alloc":
                key = (op["unit"], op["gpu"])
                if op["unit"] not in after or op["gpu"] not in after[op["unit"]]:
                    _fail(f"{where}: {op['unit']} holds nothing on GPU {op['gpu']} in the target layout")
                if key in allocated:
                    _fail(f"{where}: {op['unit']} allocated twice on GPU {op['gpu']}")
                expected = shard_bytes(after[op["unit"]][op["gpu"]]) - kept_into[key]
                if op["bytes"] != expected:
                    _fail(f"{where}: declares {op['bytes']} bytes, the shard needs {expected}")
                allocated.add(key)
                if op["unit"] in offloaded:
                    node = node_of[op["gpu"]]
                    host[node] += op["bytes"]
                    if host[node] > host_cap.get(node, float("inf")):
                        _fail(f"{where}: host memory of node {node} overflows ({human_bytes(host[node])})")
                else:
                    mem[op["gpu"]] += op["bytes"]
            elif kind in ("free", "stage_out"):
                key = (op["unit"], op["gpu"])
                state = status.get(key)
                if state is None:
                    _fail(f"{where}: {op['unit']} holds nothing on GPU {op['gpu']} in the source layout")
                if state == "freed" or (kind == "stage_out" and state == "host"):
                    _fail(f"{where}: {op['unit']} on GPU {op['gpu']} already {state}")
                expected = shard_bytes(before[op["unit"]][op["gpu"]]) - kept_out[key]
                if op["bytes"] != expected:
                    _fail(f"{where}: declares {op['bytes']} bytes, the shard has {expected} not kept")
                node = node_of[op["gpu"]]
                if kind == "stage_out":
                    mem[op["gpu"]] -= op["bytes"]
                    host[node] += op["bytes"]
                    if host[node] > host_cap.get(node, float("inf")):
                        _fail(f"{where}: host memory of node {node} overflows ({human_bytes(host[node])})")
                    status[key] = "host"
                else:
                    if state == "host":
                        host[node] -= op["bytes"]
                    else:
                        mem[op["gpu"]] -= op["bytes"]
                    status[key] = "freed"
            else:
                if kind == "send":
                    src, dst = op["src"], op["dst"]
                    if src == dst:
                        _fail(f"{where}: a send from GPU {src} to itself", hint="use a copy")
                else:
                    src = dst = op["gpu"]
                total = from_gpu = 0
                for s in op["segments"]:
                    nbytes = _transfer(where, s, src, dst, tensors, before, after, status, allocated, written)
                    total += nbytes
                    if status[(s["src_unit"], src)] != "host":
                        from_gpu += nbytes
                    segments += 1
                    if kind == "keep":
                        keeps[(s["src_unit"], s["dst_unit"], src, s["tensor"])].append(_tb(s["box"]))
                if kind != "keep":
                    if op.get("bytes") != total:
                        _fail(f"{where}: declares {op.get('bytes')} bytes, its segments hold {total}")
                    moved += total
                if kind == "send":  # pack / unpack buffers; host-staged segments pack in host memory
                    transient[src] += from_gpu
                    transient[dst] += total
        if phase <= 1:
            _check_memory(k, mem, transient, capacity, peak)
        for (su, du, g, name), boxes in keeps.items():
            if sorted(boxes) != sorted(before[su][g][name]) or sorted(boxes) != sorted(after[du][g][name]):
                _fail(f"round {k}: keep of {name} on GPU {g} is not a whole identical shard",
                      hint="a partial shard on the same GPU is a copy")
    for uid, per_gpu in after.items():
        for g, shards in per_gpu.items():
            if (uid, g) not in allocated:
                _fail(f"after unit {uid} is never allocated on GPU {g}")
            for name, boxes in shards.items():
                need = sum(_volume(b) for b in boxes)
                got = sum(_volume(b) for b in written.get((uid, g, name), ()))
                if got != need:
                    _fail(f"after unit {uid} on GPU {g}: {name} has {got} of {need} elements written (missing box)")
    for key, state in status.items():
        if state != "freed":
            _fail(f"before unit {key[0]} on GPU {key[1]} is never freed")
    worst = max(peak, key=lambda g: (peak[g] / capacity[g], -g)) if peak else 0
    return VerifyReport(len(data["rounds"]), ops, segments, moved, dict(peak), worst,
                        peak.get(worst, 0) / capacity[worst] if peak else 0.0)


def _transfer(where, s, src, dst, tensors, before, after, status, allocated, written) -> int:
    name, box = s["tensor"], _tb(s["box"])
    if name not in tensors:
        _fail(f"{where}: unknown tensor {name}")
    su, du = s["src_unit"], s["dst_unit"]
    state = status.get((su, src))
    if state is None:
        _fail(f"{where}: source {su} holds nothing on GPU {src}")
    if state == "freed":
        _fail(f"{where}: reads {name} from {su} on GPU {src} after its free (read after free)")
    if not any(_inside(box, b) for b in before[su][src].get(name, ())):
        _fail(f"{where}: source {su} on GPU {src} does not hold {name} {list(box)}")
    if (du, dst) not in allocated:
        _fail(f"{where}: writes into {du} on GPU {dst} before its alloc")
    if not any(_inside(box, b) for b in after[du][dst].get(name, ())):
        _fail(f"{where}: {du} on GPU {dst} has no box of {name} containing {list(box)}")
    done = written[(du, dst, name)]
    for other in done:
        if _overlap(box, other):
            _fail(f"{where}: {name} {list(box)} on GPU {dst} written twice (double write)")
    done.append(box)
    return _volume(box) * tensors[name][1]


def _check_memory(k, mem, transient, capacity, peak) -> None:
    for g in set(mem) | set(transient):
        used = mem[g] + transient.get(g, 0)
        peak[g] = max(peak.get(g, 0), used)
        if used > capacity[g]:
            _fail(f"round {k}: GPU {g} needs {human_bytes(used)}, capacity {human_bytes(capacity[g])}"
                  f" (over by {human_bytes(used - capacity[g])})",
                  hint="memory = resident + unfreed before-shards + allocations + send buffers")
