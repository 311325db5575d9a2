"""`--set KEY=VALUE` overrides: how drift (longer responses, fewer nodes) is expressed.

    apply_overrides(module, ["workload.response=8192", "cluster.nodes=7"])

Keys: workload.{batch, prompt, response, microbatch, recompute} and cluster.{nodes,
gpus_per_node, intra, inter, host_mem, reserve, gpu.mem, gpu.flops, gpu.hbm}. Values take
the same units as in source. The overrides are read as one line, `<--set>`, the texts
joined by single spaces: errors point into it (`<--set>:1:19`). The result is validated
like source; a rule that the new values break elsewhere (a plan's GPU set on fewer
nodes, a microbatch above a smaller batch) is reported at the override that broke it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterable

from . import units
from .build import CLUSTER_KEYS, GPU_KEYS, WORKLOAD_KEYS, did_you_mean
from .diagnostics import NereusError, SemanticError
from .gpuset import resolve_gpu_set
from .model import Location, Module, Placement
from .validate import validate_cluster, validate_module, validate_workload

SET_FILE = "<--set>"

# override key → (section, field of the section's dataclass, value parser)
_FIELDS = {
    "nodes": "nodes", "gpus_per_node": "gpus_per_node", "intra": "intra_bytes_per_s",
    "inter": "inter_bytes_per_s", "host_mem": "host_mem_bytes", "reserve": "reserve",
    "gpu.mem": "mem_bytes", "gpu.flops": "flops", "gpu.hbm": "hbm_bytes_per_s",
}
OVERRIDE_KEYS: dict[str, tuple[str, str, Callable]] = {
    **{f"workload.{key}": ("workload", key, parse) for key, parse in WORKLOAD_KEYS.items()},
    **{f"cluster.{key}": ("cluster", _FIELDS[key], parse) for key, parse in CLUSTER_KEYS.items() if parse is not dict},
    **{f"cluster.gpu.{key}": ("gpu", _FIELDS[f"gpu.{key}"], parse) for key, parse in GPU_KEYS.items()},
}


def _with_key_loc(key_locs: tuple, key: str, loc: Location) -> tuple:
    return tuple((name, at) for name, at in key_locs if name != key) + ((key, loc),)


def _reresolve(module: Module, cluster) -> tuple:
    """Plans with every written GPU set resolved again on the new cluster."""
    cache: dict[int, Placement] = {}

    def again(placement: Placement) -> Placement:
        if id(placement) not in cache:
            gpus = placement.gpus
            if placement.gpu_set:
                gpus = resolve_gpu_set(placement.gpu_set, cluster, str(placement.model_stage))
            cache[id(placement)] = replace(placement, gpus=gpus)
        return cache[id(placement)]

    return tuple(replace(plan, declared=tuple(map(again, plan.declared)),
                         placements=tuple(map(again, plan.placements))) for plan in module.plans)


def apply_overrides(module: Module, overrides: Iterable[str]) -> Module:
    """Input: a valid Module and `KEY=VALUE` texts. Output: the Module with those values
    replaced, GPU sets resolved again, and every rule checked again. Invariant: the result
    is valid; otherwise a SemanticError located in `<--set>` (with its text attached)."""
    overrides = list(overrides)
    if not overrides:
        return module
    line = " ".join(overrides)
    cluster, gpu, workload = module.cluster, module.cluster.gpu, module.workload
    blame: dict[str, tuple[Location, int]] = {}
    column = 1
    for text in overrides:
        start = Location(SET_FILE, 1, column)
        column += len(text) + 1
        raw_key, equals, raw_value = text.partition("=")
        # `--set 'workload.response = 8192 '` means the same; locations stay the text's
        key, value = raw_key.strip(), raw_value.strip()
        key_at = len(raw_key) - len(raw_key.lstrip())
        value_at = len(raw_key) + 1 + len(raw_value) - len(raw_value.lstrip())
        if not equals:
            raise SemanticError(f"expected KEY=VALUE, found '{text}'", start, "write it like workload.response=8192",
                                line, len(text))
        if key not in OVERRIDE_KEYS:
            raise SemanticError(f"unknown key '{key}' for --set", Location(SET_FILE, 1, start.column + key_at),
                                did_you_mean(key, OVERRIDE_KEYS) + "keys: " + ", ".join(OVERRIDE_KEYS), line,
                                max(1, len(key)))
        value_loc = Location(SET_FILE, 1, start.column + value_at)
        if not value:
            raise SemanticError(f"{key} needs a value after '='", value_loc, f"write it like {key}=VALUE", line)
        section, field, parse = OVERRIDE_KEYS[key]
        name = key.split(".", 1)[1]
        try:
            parsed = parse(value, name.split(".")[-1])
        except units.UnitError as error:
            raise SemanticError(error.message, value_loc, error.hint, line, len(value)) from None
        if section == "workload":
            workload = replace(workload, **{field: parsed}, key_locs=_with_key_loc(workload.key_locs, name, value_loc))
        elif section == "gpu":
            gpu = replace(gpu, **{field: parsed})
            cluster = replace(cluster, key_locs=_with_key_loc(cluster.key_locs, name, value_loc))
        else:
            cluster = replace(cluster, **{field: parsed}, key_locs=_with_key_loc(cluster.key_locs, name, value_loc))
        blame["workload" if section == "workload" else "cluster"] = (value_loc, len(value))
    cluster = replace(cluster, gpu=gpu)
    step = "cluster"
    try:
        validate_cluster(cluster)
        step = "workload"
        validate_workload(workload, module.models)
        step = "cluster" if "cluster" in blame else "workload"
        result = replace(module, cluster=cluster, workload=workload, plans=_reresolve(module, cluster))
        validate_module(result)
    except NereusError as error:
        if error.loc is not None and error.loc.file == SET_FILE:
            error.source = line
            raise
        loc, width = blame.get(step) or next(iter(blame.values()))
        where = f"; it clashes with {error.loc}" if error.loc is not None else ""
        raise SemanticError(f"{error.message} (after --set)", loc, f"{error.hint or 'choose another value'}{where}",
                            line, width) from None
    return result
