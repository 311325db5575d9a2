"""verify_world: a program's header against the plans it claims to come from.

Input: a JSON program v1 dict (header already checked by `verify_header`) and the
`Module` holding its transition's plans. Output: nothing, or a ProgramError naming the
header field and the first difference (`header field 'gpus' (GPU 3): capacity_bytes is
10000, the plans give 1000`). Invariant: after this check every fact the replay trusts
about the world — units and their layouts, every field of a unit (id, replica, GPUs, tp,
pp, ep, dp, zero, offload, mesh), GPU memory and reserve, nodes and host memory, resident bytes
and names of untouched model-stages, tensor shapes and dtypes — is the one
`nereus.passes.world.transition_world` derives from the plans, value and JSON type alike
(`"zero": true` is not 1, `"dp": 2.0` is not 2). Every header field
(`verify_fields.header_fields()`) is compared: the top-level ones in COMPARED, `format` and
`version` by `program_from_json`; `memory_model` (STATED) is the compile's choice, not the
plans', and only checked to name a model.
"""

from __future__ import annotations

from nereus.ir.diagnostics import ProgramError
from nereus.ir.model import Module

from .verify_fields import FIELDS, json_text
from .world import transition_world

COMPARED = ("transition", "gpus", "nodes", "tensors", "units", "resident_bytes", "untouched")
# header fields the plans do not determine: the compile's choice, checked by verify_header
# (a model of nereus.passes.memory_model), under which the replay proves the rounds
STATED = ("memory_model",)
UNIT_FIELDS = tuple(key for key in FIELDS["unit"] if key != "shards")  # shards: box by box


def _same(a, b) -> bool:
    """Equal, with the same JSON types throughout (in Python True == 1 and 2.0 == 2)."""
    if type(a) is not type(b):
        return False
    if type(a) is list:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _differ(field: str, what: str, stated, derived):
    raise ProgramError(f"header field '{field}' ({what}): the program states {json_text(stated)}, "
                       f"the plans give {json_text(derived)}",
                       hint="the program was compiled from other plans, or edited: recompile it")


def check_against(data: dict, module: Module) -> None:
    """Raise ProgramError on the first header fact of `data` that the plans contradict."""
    transition = data.get("transition")
    if not isinstance(transition, dict):
        raise ProgramError("header field 'transition' must be {\"from\": PLAN, \"to\": PLAN}")
    source, target = transition.get("from"), transition.get("to")
    plans = [plan.name for plan in module.plans]
    for key, name in (("from", source), ("to", target)):
        if name not in plans:
            raise ProgramError(f"header field 'transition' ({source} -> {target}): '{key}' names no plan {name!r} "
                               "of the module", hint=f"its plans are {', '.join(plans)}")
    world = transition_world(module, source, target, ranged=data.get("version") == 2)
    _by_key("gpus", "GPU", data["gpus"], world.gpus, "id")
    _by_key("nodes", "node", data.get("nodes"), world.nodes, "id")
    _by_key("tensors", "tensor", data["tensors"], world.tensors, "name")
    stated = {str(k): v for k, v in data["resident_bytes"].items()}
    for gpu in sorted(set(stated) | set(world.resident_bytes), key=int):
        if not _same(stated.get(gpu), world.resident_bytes.get(gpu)):
            _differ("resident_bytes", f"GPU {gpu}", stated.get(gpu), world.resident_bytes.get(gpu))
    if not _same(sorted(data.get("untouched", [])), sorted(world.untouched)):
        _differ("untouched", "model-stages", sorted(data.get("untouched", [])), sorted(world.untouched))
    for side in ("before", "after"):
        _units(side, data["units"][side], world.units(module, side, ranged=data.get("version") == 2))


def _by_key(field: str, what: str, stated, derived: tuple, key: str) -> None:
    if stated is None:
        raise ProgramError(f"header field '{field}' is missing; the plans give {len(derived)} entries")
    have = {entry[key]: entry for entry in stated}
    want = {entry[key]: entry for entry in derived}
    for name in sorted(set(have) | set(want), key=str):
        if name not in have:
            _differ(field, f"{what} {name}", None, want[name])
        if name not in want:
            _differ(field, f"{what} {name}", have[name], None)
        for k in sorted(set(have[name]) | set(want[name])):
            if not _same(have[name].get(k), want[name].get(k)):
                _differ(field, f"{what} {name}, {k}", have[name].get(k), want[name].get(k))


def _shards(unit: dict) -> dict:
    """{(gpu, tensor, at): boxes} (`at` of a v2 family's entry as a tuple, else None)."""
    return {(s["gpu"], s["tensor"], _at(s.get("at"))): [list(map(list, b)) for b in s["boxes"]]
            for s in unit["shards"]}


def _at(at):
    return None if at is None else tuple(tuple(r) for r in at)


def _units(side: str, stated: list, derived: list) -> None:
    field = f"units.{side}"
    have = {u["id"]: u for u in stated}
    want = {u["id"]: u for u in derived}
    for uid in sorted(set(have) | set(want)):
        if uid not in have:
            _differ(field, f"unit {uid}", None, "a unit of the plan")
        if uid not in want:
            _differ(field, f"unit {uid}", "a unit", None)
        for k in UNIT_FIELDS:
            if not _same(have[uid].get(k), want[uid].get(k)):
                _differ(field, f"unit {uid}, {k}", have[uid].get(k), want[uid].get(k))
        # boxes compared as lists: verify_header's check_box has read every bound as an int
        # (a million boxes at 256 GPUs: `_same` would cost seconds)
        a, b = _shards(have[uid]), _shards(want[uid])
        for key in sorted(set(a) | set(b), key=lambda k: (k[0], k[1], k[2] or ())):
            gpu, tensor, at = key
            what = f"{tensor} at {[list(r) for r in at]}" if at else tensor
            if a.get(key) != b.get(key):
                _differ(field, f"unit {uid}, shard of {what} on GPU {gpu}, boxes", a.get(key), b.get(key))
