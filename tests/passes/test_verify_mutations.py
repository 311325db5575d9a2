"""Mutation suite: corrupt compiled programs one way at a time; the verifier rejects every
corruption with a message naming the round and op (or the header field).

Programs: fig5 Extend+Merge (tp_up), Destroy and Split; three model-stages moving at once
(colocated); units trading places on full GPUs (host staging, stage_out); an offloaded
model-stage (offload) and one flipping offload (offload_flip). Each corruption is applied
to every program it fits; `fix_bytes` re-declares bytes where a corruption would otherwise
be caught only by a byte count, so the check aimed at is the one that must catch it.
Corruptions marked `needs_plans` are consistent programs of another world: only the
comparison with the plans (`against`) can reject them.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import pytest

from builders import colocated_module, fig5_module, offload_module, ring_module
from nereus.backends.json_program import program_json
from nereus.ir.diagnostics import ProgramError
from nereus.passes import compile_transition
from nereus.passes.verify import verify_program

LOCATED = r"round \d+|header field '|'format'|program version|required field '"

CASES = {
    "tp_up": (fig5_module, "S1", "tp_up"),
    "destroy": (fig5_module, "S1", "destroy"),
    "split": (fig5_module, "S1", "split"),
    "colocated": (colocated_module, "A", "B"),
    "staging": (lambda: ring_module(2)[0], "S", "T"),
    "offload": (offload_module, "S", "T"),
    "offload_flip": (offload_module, "S", "U"),
    "zero": (lambda: _zero_module(2, 4), "S", "T"),
}


def _zero_module(dp_before: int, dp_after: int):
    """actor.training under zero 1 from dp `dp_before` to `dp_after` (tp 2): units with `dp` and `zero`."""
    import dataclasses

    from builders import cluster, llama, module, place, workload

    plans = {name: [dataclasses.replace(place("actor.training", dp, 2, 1, range(dp * 2)), zero=1)]
             for name, dp in (("S", dp_before), ("T", dp_after))}
    return module(cluster(2, 4, 10**9), [llama("actor", 4, 64, 8, 2, 128, 256)], workload({"training": ["actor"]}),
                  plans)


@pytest.fixture(scope="module")
def programs():
    out = {}
    for name, (build, source, target) in CASES.items():
        module = build()
        out[name] = (module, program_json(compile_transition(module, source, target, check_fit=False), version=1))
    return out


# ---------------------------------------------------------------- helpers


def _volume(box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _ops(p, kind=None):
    for k, rnd in enumerate(p["rounds"]):
        for i, op in enumerate(rnd["ops"]):
            if kind is None or op["op"] == kind or (isinstance(kind, tuple) and op["op"] in kind):
                yield k, i, op


def _first(p, kind, where: Callable = lambda op: True):
    return next((op for _, _, op in _ops(p, kind) if where(op)), None)


def _apply(corrupt, program) -> Optional[dict]:
    try:
        return corrupt.apply(copy.deepcopy(program))
    except NotApplicable:
        return None


def _segments(p, kinds=("send", "copy")):
    for _, _, op in _ops(p, kinds):
        for s in op["segments"]:
            yield op, s


def _element_bytes(p) -> dict:
    return {t["name"]: 4 if t["dtype"] == "fp32" else 2 for t in p["tensors"]}


def _shape(p, name):
    return next(t["shape"] for t in p["tensors"] if t["name"] == name)


def fix_bytes(p) -> dict:
    """Re-declare every op's bytes from the program's own header and segments."""
    eb = _element_bytes(p)

    def shard(side, uid, g):
        unit = next(u for u in p["units"][side] if u["id"] == uid)
        return sum(_volume(b) * eb[s["tensor"]] for s in unit["shards"] if s["gpu"] == g for b in s["boxes"])

    kept_into, kept_out = {}, {}
    for _, _, op in _ops(p, "keep"):
        for s in op["segments"]:
            b = _volume(s["box"]) * eb[s["tensor"]]
            kept_into[(s["dst_unit"], op["gpu"])] = kept_into.get((s["dst_unit"], op["gpu"]), 0) + b
            kept_out[(s["src_unit"], op["gpu"])] = kept_out.get((s["src_unit"], op["gpu"]), 0) + b
    for _, _, op in _ops(p):
        if op["op"] == "alloc":
            op["bytes"] = shard("after", op["unit"], op["gpu"]) - kept_into.get((op["unit"], op["gpu"]), 0)
        elif op["op"] in ("free", "stage_out"):
            op["bytes"] = shard("before", op["unit"], op["gpu"]) - kept_out.get((op["unit"], op["gpu"]), 0)
        elif op["op"] in ("send", "copy"):
            op["bytes"] = sum(_volume(s["box"]) * eb[s["tensor"]] for s in op["segments"])
    return p


def _move_to_new_round(p, op, position):
    for rnd in p["rounds"]:
        if op in rnd["ops"]:
            rnd["ops"].remove(op)
    if position == "first":
        p["rounds"].insert(0, {"ops": [op]})
    else:
        p["rounds"].append({"ops": [op]})


# ---------------------------------------------------------------- corruptions
# each takes a deep copy of a program and returns it corrupted, or None where it does not fit


@dataclass(frozen=True)
class Corruption:
    name: str
    apply: Callable[[dict], Optional[dict]]
    needs_plans: bool = False


CORRUPTIONS: list[Corruption] = []


def corruption(needs_plans: bool = False):
    def register(function):
        CORRUPTIONS.append(Corruption(function.__name__, function, needs_plans))
        return function
    return register


class NotApplicable(Exception):
    """The program has nothing this corruption changes."""


def _seg_box(p, predicate=lambda box, shape: True):
    for op, s in _segments(p):
        if predicate(s["box"], _shape(p, s["tensor"])):
            return op, s
    raise NotApplicable


@corruption()
def segment_box_bounds_swapped(p):
    op, s = _seg_box(p, lambda box, shape: len(box) == 2)
    s["box"] = [[hi, lo] for lo, hi in s["box"]]  # volume positive again: bytes still match
    return p


@corruption()
def segment_box_extra_dimension(p):
    op, s = _seg_box(p)
    s["box"] = s["box"] + [[0, 1]]  # same volume, same bytes: only the rank tells
    return p


@corruption()
def segment_box_extra_dimension_replacing_dropped_half(p):
    op, s = _seg_box(p, lambda box, shape: box[0][1] - box[0][0] >= 2 and (box[0][1] - box[0][0]) % 2 == 0)
    lo, hi = s["box"][0]
    s["box"] = [[lo, (lo + hi) // 2]] + s["box"][1:] + [[0, 2]]  # half the rows × 2 = same volume
    return p


@corruption()
def segment_box_dimension_dropped(p):
    op, s = _seg_box(p, lambda box, shape: len(box) == 2)
    s["box"] = s["box"][:1]
    return fix_bytes(p)


@corruption()
def segment_box_negative_lower_bound(p):
    op, s = _seg_box(p)
    s["box"][0] = [-1, s["box"][0][1]]
    return fix_bytes(p)


@corruption()
def segment_box_past_the_end(p):
    op, s = _seg_box(p)
    s["box"][0] = [s["box"][0][0], _shape(p, s["tensor"])[0] + 1]
    return fix_bytes(p)


@corruption()
def segment_box_empty(p):
    op, s = _seg_box(p)
    s["box"][0] = [s["box"][0][0], s["box"][0][0]]
    return fix_bytes(p)


@corruption()
def segment_box_float_bounds(p):
    op, s = _seg_box(p)
    s["box"] = [[lo + 0.5, hi] for lo, hi in s["box"]]
    return p


@corruption()
def segment_box_not_a_list(p):
    op, s = _seg_box(p)
    s["box"] = "0:4"
    return p


@corruption()
def segment_box_enlarged(p):
    op, s = _seg_box(p, lambda box, shape: box[0][1] < shape[0])
    s["box"][0] = [s["box"][0][0], _shape(p, s["tensor"])[0]]
    return fix_bytes(p)


def _after_shard(p, predicate=lambda shard: True):
    for unit in p["units"]["after"]:
        for shard in unit["shards"]:
            if predicate(shard):
                return unit, shard
    raise NotApplicable


@corruption()
def unit_box_bounds_swapped(p):
    unit, shard = _after_shard(p, lambda s: len(s["boxes"][0]) == 2)
    shard["boxes"][0] = [[hi, lo] for lo, hi in shard["boxes"][0]]
    return p


@corruption()
def unit_box_extra_dimension(p):
    unit, shard = _after_shard(p)
    shard["boxes"][0] = shard["boxes"][0] + [[0, 1]]
    return p


@corruption()
def unit_box_past_the_end(p):
    unit, shard = _after_shard(p)
    shard["boxes"][0][0] = [shard["boxes"][0][0][0], _shape(p, shard["tensor"])[0] + 4]
    return p


@corruption()
def unit_boxes_differ_beyond_dim0(p):
    unit, shard = _after_shard(p, lambda s: len(s["boxes"]) > 1 and len(s["boxes"][0]) == 2)
    lo, hi = shard["boxes"][1][1]
    shard["boxes"][1][1] = [lo, hi - 1] if hi - lo > 1 else [lo, hi + 1]
    return p


@corruption()
def unit_shard_dropped(p):
    unit, shard = _after_shard(p, lambda s: s["tensor"].endswith("embed.weight"))
    unit["shards"].remove(shard)
    return fix_bytes(p)


@corruption()
def unit_id_not_its_replica(p):
    unit = p["units"]["after"][0]
    unit["replica"] += 7
    return p


@corruption()
def unit_on_unknown_gpu(p):
    unit = p["units"]["after"][0]
    unit["gpus"][0] = 99
    return p


@corruption()
def unit_offload_flag_flipped_on_one_replica(p):
    units = p["units"]["before"]
    if len(units) < 2 or units[0]["model_stage"] != units[1]["model_stage"]:
        return None
    units[1]["offload"] = not units[1]["offload"]
    return p


@corruption(needs_plans=True)
def zero_unit_dp_changed(p):
    """The runtime does not read a unit's `dp`, but the header must still be the plans'."""
    units = [u for u in p["units"]["before"] + p["units"]["after"] if "dp" in u]
    if not units:
        return None
    for unit in units:
        unit["dp"] = "x"
    return p


@corruption(needs_plans=True)
def zero_unit_zero_changed(p):
    units = [u for u in p["units"]["after"] if u.get("zero")]
    if not units:
        return None
    units[0]["zero"] = 3 if units[0]["zero"] == 1 else 1
    return p


@corruption(needs_plans=True)
def unit_gpu_order_permuted(p):
    unit = next((u for u in p["units"]["after"] if len(u["gpus"]) > 1), None)
    if unit is None:
        return None
    unit["gpus"] = unit["gpus"][::-1]
    return p


@corruption()
def training_weights_sourced_from_generation(p):
    gen = {u["id"]: u for u in p["units"]["before"] if u["model_stage"] == "actor.generation"}
    if not gen:
        return None
    holds = {(s["gpu"], s["tensor"], tuple(map(tuple, b))) for u in gen.values() for s in u["shards"] for b in s["boxes"]}
    for op, s in _segments(p):
        if not s["src_unit"].startswith("actor.training/") or "#" in s["tensor"]:
            continue
        src = op.get("src", op.get("gpu"))
        for uid, unit in gen.items():
            for shard in unit["shards"]:
                if shard["gpu"] == src and shard["tensor"] == s["tensor"] and any(
                        all(a >= c and b <= d for (a, b), (c, d) in zip(s["box"], box)) for box in shard["boxes"]):
                    s["src_unit"] = uid  # the generation copy holds the box on that GPU: only sourcing tells
                    return p
    op, s = next((o, s) for o, s in _segments(p) if s["src_unit"].startswith("actor.training/") and "#" not in s["tensor"])
    s["src_unit"] = next(iter(gen))
    assert holds
    return p


@corruption()
def segment_from_unknown_unit(p):
    op, s = _seg_box(p)
    s["src_unit"] = "nobody.training/0"
    return p


@corruption()
def segment_into_unknown_unit(p):
    op, s = _seg_box(p)
    s["dst_unit"] = "nobody.training/0"
    return p


@corruption()
def segment_of_unknown_tensor(p):
    op, s = _seg_box(p)
    s["tensor"] = s["tensor"] + ".bogus"
    return p


@corruption()
def segment_of_another_models_tensor(p):
    names = {t["name"] for t in p["tensors"]}
    for op, s in _segments(p):
        model, _, rest = s["tensor"].partition("/")
        other = next((n for n in names if n.endswith("/" + rest) and not n.startswith(model + "/")), None)
        if other:
            s["tensor"] = other
            return p
    return None


@corruption()
def double_write(p):
    op, s = _seg_box(p)
    op["segments"].append(dict(s))
    return fix_bytes(p)


@corruption()
def missing_box(p):
    op = _first(p, ("send", "copy"))
    if op is None:
        return None
    op["segments"].pop()
    if not op["segments"]:
        for rnd in p["rounds"]:
            if op in rnd["ops"]:
                rnd["ops"].remove(op)
    return fix_bytes(p)


@corruption()
def read_after_free(p):
    op = _first(p, ("send", "copy"))
    if op is None:
        return None
    src = op.get("src", op.get("gpu"))
    free = _first(p, "free", lambda f: f["unit"] == op["segments"][0]["src_unit"] and f["gpu"] == src)
    _move_to_new_round(p, free, "first")
    return p


@corruption()
def write_before_alloc(p):
    op = _first(p, ("send", "copy", "keep"))
    dst = op.get("dst", op.get("gpu"))
    alloc = _first(p, "alloc", lambda a: a["unit"] == op["segments"][0]["dst_unit"] and a["gpu"] == dst)
    _move_to_new_round(p, alloc, "last")
    return p


@corruption()
def alloc_removed(p):
    alloc = _first(p, "alloc")
    for rnd in p["rounds"]:
        if alloc in rnd["ops"]:
            rnd["ops"].remove(alloc)
    return p


@corruption()
def alloc_duplicated(p):
    k, i, alloc = next(_ops(p, "alloc"))
    p["rounds"][k]["ops"].insert(i, dict(alloc))
    return p


@corruption()
def free_removed(p):
    free = _first(p, "free")
    for rnd in p["rounds"]:
        if free in rnd["ops"]:
            rnd["ops"].remove(free)
    return p


@corruption()
def free_duplicated(p):
    k, i, free = next(_ops(p, "free"))
    p["rounds"][k]["ops"].insert(i, dict(free))
    return p


@corruption()
def alloc_bytes_wrong(p):
    _first(p, "alloc")["bytes"] += 2
    return p


@corruption()
def free_bytes_wrong(p):
    _first(p, "free")["bytes"] -= 2
    return p


@corruption()
def send_bytes_wrong(p):
    op = _first(p, "send")
    if op is None:
        return None
    op["bytes"] += 2
    return p


@corruption()
def copy_bytes_wrong(p):
    op = _first(p, "copy")
    if op is None:
        return None
    op["bytes"] -= 2
    return p


@corruption()
def send_to_itself(p):
    op = _first(p, "send")
    if op is None:
        return None
    op["dst"] = op["src"]
    return p


@corruption()
def send_to_another_gpu(p):
    op = _first(p, "send")
    if op is None:
        return None
    op["dst"] = next(g["id"] for g in p["gpus"] if g["id"] not in (op["src"], op["dst"]))
    return p


@corruption()
def partial_keep(p):
    op = _first(p, "keep", lambda o: o["segments"][0]["box"][0][1] - o["segments"][0]["box"][0][0] > 1)
    if op is None:
        return None
    lo, _ = op["segments"][0]["box"][0]
    op["segments"][0]["box"][0] = [lo, lo + 1]
    return fix_bytes(p)


@corruption()
def keep_turned_into_copy(p):
    op = _first(p, "keep")
    if op is None:
        return None
    op["op"] = "copy"  # the alloc and the free still declare the shard minus the kept bytes
    op["bytes"] = sum(_volume(s["box"]) * _element_bytes(p)[s["tensor"]] for s in op["segments"])
    return p


@corruption()
def unknown_op(p):
    _first(p, "alloc")["op"] = "move"
    return p


@corruption()
def free_before_transfers_in_its_round(p):
    for rnd in p["rounds"]:
        frees = [op for op in rnd["ops"] if op["op"] == "free"]
        if frees and len(rnd["ops"]) > len(frees):
            rnd["ops"].remove(frees[0])
            rnd["ops"].insert(0, frees[0])
            return p
    return None


@corruption()
def all_rounds_merged(p):
    if len(p["rounds"]) < 2:
        return None
    ops = [op for rnd in p["rounds"] for op in rnd["ops"]]
    phase = {"alloc": 0, "keep": 1, "copy": 1, "send": 1, "stage_out": 2, "free": 2}
    p["rounds"] = [{"ops": sorted(ops, key=lambda op: phase[op["op"]])}]
    return p


@corruption()
def stage_out_removed(p):
    op = _first(p, "stage_out")
    if op is None:
        return None
    for rnd in p["rounds"]:
        if op in rnd["ops"]:
            rnd["ops"].remove(op)
    return p


@corruption()
def stage_out_duplicated(p):
    found = next(_ops(p, "stage_out"), None)
    if found is None:
        return None
    k, i, op = found
    p["rounds"][k]["ops"].insert(i, dict(op))
    return p


@corruption()
def op_without_gpu(p):
    del _first(p, "alloc")["gpu"]
    return p


@corruption()
def op_bytes_as_text(p):
    op = _first(p, "alloc")
    op["bytes"] = str(op["bytes"])
    return p


@corruption()
def segments_not_a_list(p):
    op = _first(p, ("send", "copy", "keep"))
    op["segments"] = {"0": op["segments"][0]}
    return p


@corruption()
def segment_without_box(p):
    op, s = _seg_box(p)
    del s["box"]
    return p


@corruption(needs_plans=True)
def after_unit_deleted_with_its_allocs_and_writes(p):
    stage = p["units"]["after"][-1]["model_stage"]
    if sum(u["model_stage"] == stage for u in p["units"]["after"]) < 2:
        return None
    victim = p["units"]["after"].pop()["id"]
    for rnd in p["rounds"]:
        for op in rnd["ops"]:
            if "segments" in op:
                op["segments"] = [s for s in op["segments"] if s["dst_unit"] != victim]
        rnd["ops"] = [op for op in rnd["ops"] if op.get("unit") != victim or op["op"] != "alloc"]
        rnd["ops"] = [op for op in rnd["ops"] if op.get("segments", True)]
    return fix_bytes(p)


@corruption(needs_plans=True)
def before_unit_deleted_with_its_frees(p):
    after_ids = {u["id"] for u in p["units"]["after"]}
    read = {s["src_unit"] for _, s in _segments(p, ("send", "copy", "keep"))}
    victim = next((u for u in p["units"]["before"] if u["id"] not in read and u["id"] not in after_ids), None)
    if victim is None:
        return None
    p["units"]["before"].remove(victim)
    for rnd in p["rounds"]:
        rnd["ops"] = [op for op in rnd["ops"] if op.get("unit") != victim["id"]]
    return p


@corruption()
def capacity_ten_times_mem_without_stage_out(p):
    if stage_out_removed(p) is None:
        return None
    for g in p["gpus"]:
        g["capacity_bytes"] = 10 * g["mem_bytes"]
    return p


@corruption(needs_plans=True)
def mem_and_capacity_ten_times_without_stage_out(p):
    if stage_out_removed(p) is None:
        return None
    for g in p["gpus"]:
        g["mem_bytes"] *= 10
        g["capacity_bytes"] *= 10
    return p


@corruption(needs_plans=True)
def resident_zero_with_capacity_just_below_the_peak(p):
    if not any(p["resident_bytes"].values()):
        return None
    for g in p["gpus"]:
        g["capacity_bytes"] -= p["resident_bytes"][str(g["id"])]
    p["resident_bytes"] = {g: 0 for g in p["resident_bytes"]}
    return p


@corruption(needs_plans=True)
def trading_units_offloaded_without_stage_out(p):
    if _first(p, "stage_out") is None:
        return None
    for side in ("before", "after"):
        for unit in p["units"][side]:
            unit["offload"] = True
    for rnd in p["rounds"]:
        rnd["ops"] = [op for op in rnd["ops"] if op["op"] != "stage_out"]
    return fix_bytes(p)


@corruption(needs_plans=True)
def nodes_deleted_with_host_memory_in_use(p):
    if _first(p, "stage_out") is None and not any(u["offload"] for u in p["units"]["before"] + p["units"]["after"]):
        return None
    del p["nodes"]
    return p


@corruption(needs_plans=True)
def nodes_deleted(p):
    del p["nodes"]
    return p


@corruption()
def node_of_a_gpu_undeclared(p):
    p["nodes"] = [n for n in p["nodes"] if n["id"] != p["gpus"][0]["node"]]
    return p


@corruption()
def host_memory_too_small(p):
    if _first(p, "stage_out") is None and not any(u["offload"] for u in p["units"]["before"]):
        return None
    for n in p["nodes"]:
        n["host_mem_bytes"] = 1
    return p


@corruption(needs_plans=True)
def host_memory_changed(p):
    for n in p["nodes"]:
        n["host_mem_bytes"] *= 2
    return p


@corruption()
def gpu_removed(p):
    used = {g for u in p["units"]["after"] for g in u["gpus"]}
    p["gpus"] = [g for g in p["gpus"] if g["id"] != min(used)]
    return p


@corruption(needs_plans=True)
def idle_gpu_removed(p):
    used = {g for side in ("before", "after") for u in p["units"][side] for g in u["gpus"]}
    used |= {int(g) for g, b in p["resident_bytes"].items() if b}
    idle = [g for g in p["gpus"] if g["id"] not in used]
    if not idle:
        return None
    p["gpus"].remove(idle[-1])
    del p["resident_bytes"][str(idle[-1]["id"])]
    return p


@corruption()
def gpu_listed_twice(p):
    p["gpus"].append(dict(p["gpus"][0]))
    return p


@corruption(needs_plans=True)
def gpu_moved_to_another_node(p):
    p["gpus"][0]["node"] += 1
    p.setdefault("nodes", []).append({"id": p["gpus"][0]["node"], "host_mem_bytes": 10**10})
    if len({n["id"] for n in p["nodes"]}) != len(p["nodes"]):
        p["nodes"].pop()
    return p


@corruption()
def mem_below_capacity(p):
    p["gpus"][0]["mem_bytes"] = p["gpus"][0]["capacity_bytes"] - 1
    return p


@corruption(needs_plans=True)
def reserve_dropped(p):
    for g in p["gpus"]:
        g["capacity_bytes"] = g["mem_bytes"]
        g["mem_bytes"] += 1  # capacity below mem again: only the plans' reserve tells
    return p


@corruption()
def capacity_too_small(p):
    for g in p["gpus"]:
        g["capacity_bytes"] = 1000
    return p


@corruption()
def tensor_shape_changed(p):
    p["tensors"][0]["shape"][0] *= 2
    return p


@corruption(needs_plans=True)
def tensor_dtype_changed_same_size(p):
    t = next((t for t in p["tensors"] if t["dtype"] == "bf16"), None)
    t["dtype"] = "fp16"  # same bytes: only the model's dtype tells
    return p


@corruption()
def tensor_removed(p):
    p["tensors"].pop(0)
    return p


@corruption()
def tensor_listed_twice(p):
    p["tensors"].append(dict(p["tensors"][0]))
    return p


@corruption()
def untouched_lists_a_moving_model_stage(p):
    p["untouched"] = p["untouched"] + [p["units"]["after"][0]["model_stage"]]
    return p


@corruption(needs_plans=True)
def untouched_name_dropped(p):
    if not p["untouched"]:
        return None
    p["untouched"] = p["untouched"][1:]
    return p


@corruption()
def resident_on_unknown_gpu(p):
    p["resident_bytes"]["99"] = 0
    return p


@corruption()
def resident_negative(p):
    p["resident_bytes"]["0"] = -5
    return p


@corruption(needs_plans=True)
def transition_names_other_plans(p):
    p["transition"] = {"from": p["transition"]["to"], "to": p["transition"]["from"]}
    return p


@corruption()
def wrong_format(p):
    p["format"] = "something-else"
    return p


@corruption()
def wrong_version(p):
    p["version"] = 3  # versions 1 and 2 are read
    return p


@corruption()
def version_true(p):
    p["version"] = True  # == 1 in Python, not the integer 1 in JSON
    return p


@corruption()
def version_float(p):
    p["version"] = 1.0
    return p


@corruption()
def transition_null(p):
    p["transition"] = None
    return p


@corruption()
def op_id_repeated(p):
    ops = [op for rnd in p["rounds"] for op in rnd["ops"]]
    if len(ops) < 2:
        raise NotApplicable
    ops[1]["id"] = ops[0]["id"]
    return p


@corruption()
def op_round_field_wrong(p):
    op = p["rounds"][-1]["ops"][0]
    op["round"] = op["round"] + 5
    return p


@corruption()
def rounds_missing(p):
    del p["rounds"]
    return p


@corruption()
def round_without_ops(p):
    p["rounds"][0] = {"opz": p["rounds"][0]["ops"]}
    return p


@corruption()
def keep_into_a_shard_listing_its_boxes_in_another_order(p):
    """The same boxes in another order is another local tensor (its rows stacked in
    another order): the runtime cannot hand the shard over and copies it, using memory
    the verifier did not count. The boxes were compared sorted."""
    kept = {(s["dst_unit"], op["gpu"], s["tensor"]) for _, _, op in _ops(p, "keep") for s in op["segments"]}
    for unit in p["units"]["after"]:
        for shard in unit["shards"]:
            if len(shard["boxes"]) > 1 and (unit["id"], shard["gpu"], shard["tensor"]) in kept:
                shard["boxes"] = shard["boxes"][::-1]
                return p
    raise NotApplicable


@corruption()
def send_bytes_as_a_float(p):
    """575232.0 equals 575232 in Python: the type was not checked on sends and copies."""
    op = _first(p, ("send", "copy"), lambda op: op["bytes"] > 0)
    if op is None:
        raise NotApplicable
    op["bytes"] = float(op["bytes"])
    return p


# ---------------------------------------------------------------- tests


def test_a_program_without_rounds_is_still_held_to_its_capacity(programs):
    """The state before the first round is checked too: a program with no rounds whose
    resident bytes exceed a GPU was "ok, peak 100000.0% of capacity"."""
    from builders import fig5_module

    program = program_json(compile_transition(fig5_module(), "S1", "S1", check_fit=False), version=1)
    assert program["rounds"] == []
    verify_program(program)
    program["resident_bytes"]["0"] = 10**15
    with pytest.raises(ProgramError, match=r"before round 0: GPU 0 needs"):
        verify_program(program)


def test_at_least_forty_corruption_classes():
    assert len(CORRUPTIONS) >= 40
    assert len({c.name for c in CORRUPTIONS}) == len(CORRUPTIONS)


def test_fix_bytes_is_the_identity_on_compiled_programs(programs):
    for _, program in programs.values():
        assert fix_bytes(copy.deepcopy(program)) == program


def test_every_program_verifies_against_its_plans(programs):
    for module, program in programs.values():
        verify_program(program, against=module)


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda c: c.name)
def test_corruption_is_rejected_with_a_located_message(programs, corrupt):
    applied = 0
    for name, (module, program) in programs.items():
        corrupted = _apply(corrupt, program)
        if corrupted is None:
            continue
        applied += 1
        assert json.dumps(corrupted, sort_keys=True) != json.dumps(program, sort_keys=True), name  # True == 1
        with pytest.raises(ProgramError, match=LOCATED) as caught:
            verify_program(corrupted, against=module)
        if not corrupt.needs_plans:  # the plans are not needed to see it
            with pytest.raises(ProgramError, match=LOCATED):
                verify_program(corrupted)
        else:  # a consistent program of another world: only the plans tell
            assert "header field" in caught.value.message, (name, caught.value.message)
    assert applied, f"{corrupt.name} fits none of the programs"


def test_issue_corruptions_each_fit_the_programs_they_are_about(programs):
    """The corruptions reported as accepted before must apply where they mean something."""
    fits = {c.name: {n for n, (_, p) in programs.items() if _apply(c, p) is not None}
            for c in CORRUPTIONS}
    assert "colocated" in fits["training_weights_sourced_from_generation"]
    assert "staging" in fits["capacity_ten_times_mem_without_stage_out"]
    assert "staging" in fits["trading_units_offloaded_without_stage_out"]
    assert "offload" in fits["resident_zero_with_capacity_just_below_the_peak"]
    assert "staging" in fits["nodes_deleted_with_host_memory_in_use"]
    assert "tp_up" in fits["after_unit_deleted_with_its_allocs_and_writes"]


def _cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "nereus.cli", "verify", *args], input=stdin,
                          capture_output=True, text=True)


def test_cli_exits_2_without_traceback_on_a_removed_gpu(programs):
    corrupted = gpu_removed(copy.deepcopy(programs["tp_up"][1]))
    result = _cli("-", stdin=json.dumps(corrupted))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "header field '" in result.stderr


def test_cli_against_rejects_a_program_of_other_plans(programs, tmp_path):
    from nereus.ir.printer import print_module

    module, program = programs["staging"]
    path = tmp_path / "ring.nir"
    path.write_text(print_module(module))
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(program))
    bad.write_text(json.dumps(mem_and_capacity_ten_times_without_stage_out(copy.deepcopy(program))))
    ok = _cli(str(good), "--against", str(path))
    assert ok.returncode == 0 and "header matches" in ok.stdout, ok.stderr
    assert _cli(str(bad)).returncode == 0  # consistent by itself
    rejected = _cli(str(bad), "--against", str(path))
    assert rejected.returncode == 2 and "header field 'gpus'" in rejected.stderr and "Traceback" not in rejected.stderr


def _paths(node, path=()):
    """The path (keys and indices) of every value inside a program, depth first."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield path + (key,)
        yield from _paths(value, path + (key,))


def test_random_malformed_fields_are_located_errors_never_crashes(programs):
    """Any field (one or two) replaced by a value of another type, or deleted: a report
    or a located ProgramError, with or without the plans, never another exception."""
    import random

    rng = random.Random(15)
    junk = [None, -1, 0, 2.5, "x", "0", [], {}, [[1, 0]], [0], True, 10**30, {"a": 1}]
    for name, (module, program) in programs.items():
        places = list(_paths(program))
        for trial in range(40):
            corrupted = copy.deepcopy(program)
            for _ in range(rng.choice((1, 1, 2))):
                *route, key = rng.choice(places)
                target = corrupted
                for step in route:  # an earlier corruption may have cut the route
                    ok = isinstance(target, dict) and step in target or isinstance(target, list) \
                        and isinstance(step, int) and step < len(target)
                    target = target[step] if ok else None
                if isinstance(target, dict) and rng.random() < 0.3:
                    target.pop(key, None)
                elif isinstance(target, dict) or isinstance(target, list) and key < len(target):
                    target[key] = rng.choice(junk)
            for against in (None, module):
                try:
                    verify_program(corrupted, against=against)
                except ProgramError as error:
                    assert re.search(LOCATED, error.message), (name, trial, error.message)
                    assert "malformed program" not in error.message, (name, trial, error.message)
                    assert error.hint, (name, trial, error.message)  # 53 of 74 had none


# short ids: pytest puts the id in PYTEST_CURRENT_TEST, and a 200 kB variable made every
# subprocess fail with E2BIG on the H200 image
@pytest.mark.parametrize("text", ['{"format": "nereus-program", "version": 1' + "0" * 5000 + "}",
                                  "[" * 100000 + "]" * 100000], ids=["5000-digit integer", "nesting 100000 deep"])
def test_json_python_will_not_read_is_an_error_not_a_traceback(tmp_path, text):
    """An integer of more digits than Python converts, nesting deeper than its stack."""
    path = tmp_path / "odd.json"
    path.write_text(text)
    done = _cli(str(path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"error: {path} is not JSON a program can be: ")


def test_a_rank_part_is_named_as_such(tmp_path):
    """`--rank R` emits one rank's part; verify proves whole programs and says so."""
    from pathlib import Path

    path = tmp_path / "r1.json"
    example = Path(__file__).parents[2] / "examples" / "ppo-8b.nir"
    done = subprocess.run([sys.executable, "-m", "nereus.cli", str(example), "--transition", "S2:S3",
                           "--emit", "json", "--rank", "1", "-o", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    result = _cli(str(path))
    assert result.returncode == 2
    assert result.stderr.startswith("error: this is rank 1's part of the program; verify proves whole programs")


def test_emitted_programs_have_no_unknown_fields_and_a_typo_is_named(programs):
    """Unknown fields are accepted (v1 grows by optional fields) but named: a misspelled
    `capacity_bytes` silently fell back to `mem_bytes` and proved a different program."""
    from nereus.backends.rank_json import rank_program_json
    from nereus.passes.verify_fields import unknown_fields

    for name, (module, program) in programs.items():
        assert verify_program(program).warnings == (), name
    module, program = programs["staging"]
    assert unknown_fields(rank_program_json(compile_transition(module, "S", "T", check_fit=False), 0, version=1)) == []
    typo = copy.deepcopy(program)
    typo["gpus"][0]["capacity_byte"] = typo["gpus"][0].pop("capacity_bytes")
    typo["units"]["before"][0]["ofload"] = True
    assert verify_program(typo).warnings == (
        "header field 'gpus' (entry 0): unknown field 'capacity_byte' (did you mean 'capacity_bytes'?): ignored",
        f"header field 'units.before' (unit {typo['units']['before'][0]['id']}): unknown field 'ofload' "
        "(did you mean 'offload'?): ignored")


def test_a_whole_program_in_the_compact_form_verifies(programs):
    """Units named once per op (the form rank parts use) gave "source None is not a before
    unit"; the verifier reads both forms."""
    from nereus.ir.program import compact_segment_units

    _, program = programs["staging"]
    compact = copy.deepcopy(program)
    for rnd in compact["rounds"]:
        rnd["ops"] = [compact_segment_units(op) for op in rnd["ops"]]
    assert compact != program
    assert verify_program(compact).bytes_moved == verify_program(program).bytes_moved


def test_cli_reads_a_byte_order_mark_and_names_a_transition_to_itself(programs, tmp_path):
    from nereus.ir.printer import print_module

    module, program = programs["staging"]
    path = tmp_path / "ring.nir"
    path.write_text(print_module(module))
    marked = tmp_path / "bom.json"
    marked.write_bytes(b"\xef\xbb\xbf" + json.dumps(program).encode())
    ok = _cli(str(marked), "--against", str(path))
    assert ok.returncode == 0, ok.stderr
    same = copy.deepcopy(program)
    same["transition"]["to"] = same["transition"]["from"]
    (tmp_path / "same.json").write_text(json.dumps(same))
    rejected = _cli(str(tmp_path / "same.json"), "--against", str(path))
    assert rejected.returncode == 2 and "from plan S to itself" in rejected.stderr, rejected.stderr


def test_a_huge_value_is_quoted_short(programs):
    _, program = programs["staging"]
    broken = copy.deepcopy(program)
    broken["resident_bytes"]["0"] = -(10 ** 4000 // 10 ** 3990) * 10 ** 500
    with pytest.raises(ProgramError) as caught:
        verify_program(broken)
    assert len(caught.value.message) < 200 and "characters)" in caught.value.message
