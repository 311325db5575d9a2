"""Syntax tree → Module: keys, values, names and references.

Checks everything that needs the words as written: unknown, duplicate and missing keys,
values and their units, duplicate names, undefined references (alias bases, plan bases,
transition endpoints), inheritance cycles, and GPU sets against the cluster. The
cross-field rules (tp divides heads, set sizes, every model-stage placed...) are checked
on the Module by validate.py, so that overridden modules get the same checks.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable, Optional

from . import units
from .diagnostics import SemanticError, did_you_mean  # noqa: F401  (did_you_mean: imported from here too)
from .gpuset import resolve_gpu_set
from .hf import read_hf_config
from .model import (
    ARCHITECTURE_DEFAULTS, DTYPE_BYTES, HEADS, QUANT_FORMATS, ROPE_SCALING_TYPES, STAGES, TABLE_ARCHITECTURE, Cluster, RopeScaling, GpuSpec,
    Location, Model, ModelStage, Module, Placement, Plan, Transition, Workload,
)
from .syntax import Declaration, Entry, PlacementSyntax, Word
from .table import build_mesh_layout, build_table_model
from .validate import ARCHITECTURES, RECOMPUTE, validate_cluster

MODEL_INTS: tuple[str, ...] = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
WORKLOAD_INTS: tuple[str, ...] = ("batch", "prompt", "response", "microbatch")


def _choice(options: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(text: str, what: str) -> str:
        if text not in options:
            close = difflib.get_close_matches(text, options, n=1, cutoff=0.5)
            raise units.UnitError(f"{what} must be {_one_of(options)}, found '{text}'",
                                  f"did you mean '{close[0]}'?" if close else f"write it like {what} {options[0]}")
        return text

    return parse


def _int(text: str, what: str) -> int:
    return units.parse_int(text, what)


def _bool(text: str, what: str) -> bool:
    if text not in ("true", "false"):
        raise units.UnitError(f"{what} must be 'true' or 'false', found '{text}'", f"write it like {what} true")
    return text == "true"


# key → value parser, per block; "gpu" in a cluster is a nested block.
CLUSTER_KEYS: dict[str, Callable] = {
    "nodes": _int, "gpus_per_node": _int, "gpu": dict, "intra": units.parse_rate,
    "inter": units.parse_rate, "host_mem": units.parse_size, "reserve": units.parse_fraction,
}
GPU_KEYS: dict[str, Callable] = {"mem": units.parse_size, "flops": units.parse_flops, "hbm": units.parse_rate}
MODEL_KEYS: dict[str, Callable] = {
    **{key: _int for key in MODEL_INTS}, "dtype": _choice(tuple(DTYPE_BYTES)), "head": _choice(HEADS),
    "rope_theta": units.parse_positive_float, "rope_scaling": dict, "norm_eps": units.parse_positive_float,
    "head_dim": _int, "tie_embeddings": _bool, "qkv_bias": _bool, "qk_norm": _bool,
    "experts": _int, "experts_per_token": _int, "expert_ffn": _int, "norm_topk_prob": _bool,
}
# Every Model field a model declaration sets (an alias copies them from its base).
MODEL_FIELDS: tuple[str, ...] = ("architecture", *MODEL_INTS, *(k for k in MODEL_KEYS if k not in MODEL_INTS),
                                 "tensors", "states", "checkpoint", "checkpoint_dir", "checkpoint_fields")
ROPE_SCALING_KEYS: dict[str, Callable] = {
    "type": _choice(ROPE_SCALING_TYPES), "factor": units.parse_positive_float,
    "low_freq_factor": units.parse_positive_float, "high_freq_factor": units.parse_positive_float,
    "original_max_position_embeddings": _int,
}
NULLABLE_BLOCKS: tuple[str, ...] = ("rope_scaling",)  # `rope_scaling none` turns scaling off
WORKLOAD_KEYS: dict[str, Callable] = {**{key: _int for key in WORKLOAD_INTS}, "recompute": _choice(RECOMPUTE)}
PLACEMENT_KEYS: tuple[str, ...] = ("dp", "tp", "pp", "ep", "on", "offload", "zero", "mesh", "quant")
# keys a mesh layout replaces: the mesh and its rules say how the GPUs split the tensors
MESH_EXCLUDES: tuple[str, ...] = ("dp", "tp", "pp", "ep", "zero")
EXAMPLES = {
    "nodes": "nodes 8", "gpus_per_node": "gpus_per_node 8", "gpu": "gpu { mem 141GB flops 989TFLOPS hbm 4.8TB/s }",
    "intra": "intra 900GB/s", "inter": "inter 25GB/s", "host_mem": "host_mem 2TB", "mem": "mem 141GB",
    "flops": "flops 989TFLOPS", "hbm": "hbm 4.8TB/s", "layers": "layers 32", "hidden": "hidden 4096",
    "heads": "heads 32", "kv_heads": "kv_heads 8", "ffn": "ffn 14336", "vocab": "vocab 128256",
    "batch": "batch 512", "prompt": "prompt 1024", "response": "response 2048", "microbatch": "microbatch 4",
    "rope_theta": "rope_theta 500000", "norm_eps": "norm_eps 1e-5", "head_dim": "head_dim 128",
    "rope_scaling": "rope_scaling { type llama3 factor 8 low_freq_factor 1 high_freq_factor 4 "
                    "original_max_position_embeddings 8192 }",
}


def _one_of(options) -> str:
    options = [f"'{o}'" if not str(o).startswith("'") else str(o) for o in options]
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]


def _at(word: Word) -> str:
    return f"{word.loc.line}:{word.loc.column}"


@dataclass(frozen=True)
class _Values:
    """Values of a block by key, and where each was written."""

    values: dict
    locs: dict

    def key_locs(self, prefix: str = "") -> tuple[tuple[str, Location], ...]:
        return tuple((prefix + key, loc) for key, loc in self.locs.items())


def _read_block(entries: tuple[Entry, ...], schema: dict[str, Callable], where: str,
                lists: tuple[str, ...] = ()) -> _Values:
    """Input: the entries of one block and its schema. Output: parsed values by key.
    Invariant: every key is known, written once, in its form (`k v`, `k {}`, `k: a, b`)."""
    values: dict = {}
    locs: dict = {}
    firsts: dict[str, Word] = {}
    allowed = list(schema) + [f"{name}:" for name in lists]
    for entry in entries:
        key = entry.key
        name = key.text
        is_list_key = name in lists
        if name not in schema and not is_list_key:
            shown = name + ":" if entry.kind == "list" else name
            if entry.kind == "tensor":
                raise SemanticError(f"a tensor declaration in {where}", key.loc,
                                    "tensors are declared only in a model = tensors { ... } block", width=key.width)
            hint = did_you_mean(shown, allowed) + f"{where} takes {_one_of(allowed)}"
            if name in units.SIZE_UNITS or name in units.RATE_UNITS or name in units.FLOPS_UNITS:
                hint = "write the unit right after the number, with no space: 141GB"
            raise SemanticError(f"unknown key '{shown}' in {where}", key.loc, hint, width=key.width)
        if name in firsts:
            raise SemanticError(f"'{name}' is given twice in {where}", key.loc,
                                f"the first is at {_at(firsts[name])}; keep one", width=key.width)
        firsts[name] = key
        if is_list_key:
            if entry.kind != "list":
                raise SemanticError(f"'{name}' takes a list of models", key.loc, f"write it like {name}: actor, critic",
                                    width=key.width)
            values[name] = entry.names
            locs[name] = key.loc
            continue
        parse = schema[name]
        if parse is dict:
            if name in NULLABLE_BLOCKS and entry.kind == "value" and entry.value.text == "none":
                values[name] = None
                locs[name] = entry.value.loc
                continue
            if entry.kind != "block":
                raise SemanticError(f"'{name}' takes a block", key.loc, f"write it like {EXAMPLES[name]}",
                                    width=key.width)
            values[name] = entry.block
            locs[name] = key.loc
            continue
        if entry.kind != "value":
            form = {"list": "a list", "block": "a block", "tensor": "a tensor declaration"}[entry.kind]
            raise SemanticError(f"'{name}' takes a single value, not {form}", key.loc,
                                f"write it like {EXAMPLES.get(name, name + ' VALUE')}", width=key.width)
        try:
            values[name] = parse(entry.value.text, name)
        except units.UnitError as error:
            hint = error.hint or (f"write it like {EXAMPLES[name]}" if name in EXAMPLES else None)
            raise SemanticError(error.message, entry.value.loc, hint, width=entry.value.width) from None
        locs[name] = entry.value.loc
    return _Values(values, locs)


def _require(values: _Values, keys, owner: Word, where: str) -> None:
    for key in keys:
        if key not in values.values:
            raise SemanticError(f"{where} is missing '{key}'", owner.loc,
                                f"add it, e.g. {EXAMPLES.get(key, key)}", width=owner.width)


def build_cluster(decl: Declaration) -> Cluster:
    where = f"cluster '{decl.name.text}'"
    top = _read_block(decl.body, CLUSTER_KEYS, where)
    _require(top, ("nodes", "gpus_per_node", "gpu", "intra", "inter", "host_mem"), decl.name, where)
    gpu = _read_block(top.values["gpu"], GPU_KEYS, f"the gpu block of {where}")
    _require(gpu, ("mem", "flops", "hbm"), Word("gpu", top.locs["gpu"]), f"the gpu block of {where}")
    v, g = top.values, gpu.values
    return Cluster(decl.name.text, v["nodes"], v["gpus_per_node"], GpuSpec(g["mem"], g["flops"], g["hbm"]),
                   v["intra"], v["inter"], v["host_mem"], v.get("reserve", 0.0), loc=decl.name.loc,
                   key_locs=top.key_locs() + gpu.key_locs("gpu."))


def _rope_scaling(values: _Values, where: str) -> None:
    """Replace the `rope_scaling { ... }` entries by a RopeScaling (keys left out keep
    Llama-3.1's values)."""
    entries = values.values.get("rope_scaling")
    if entries is not None:
        read = _read_block(entries, ROPE_SCALING_KEYS, f"the rope_scaling block of {where}")
        values.values["rope_scaling"] = RopeScaling(**read.values)
        values.locs.update({f"rope_scaling.{k}": loc for k, loc in read.locs.items()})


def _checkpoint_fields(decl: Declaration, file: str) -> dict:
    """The fields of a model declared `= hf("path")`, read from the checkpoint's config.json."""
    base, argument = decl.base, decl.argument
    if base.text != "hf":
        raise SemanticError(f"unknown function '{base.text}'", base.loc,
                            did_you_mean(base.text, ("hf",)) + "a model is read from a checkpoint with "
                            "hf(\"path/to/checkpoint\")", width=base.width)
    path = argument.text[1:-1]
    if not path:
        raise SemanticError("hf(\"\") needs a path", argument.loc,
                            "give the checkpoint directory or its config.json, relative to the .nir file",
                            width=argument.width)
    overridden = frozenset(entry.key.text for entry in decl.body or ())
    config = read_hf_config(argument, path, file, overridden)
    fields = {**config.fields, "checkpoint": path, "checkpoint_dir": config.directory, "base": None}
    fields["checkpoint_fields"] = tuple(sorted((k, v) for k, v in config.fields.items() if k != "architecture"))
    return fields


def build_models(decls: list[Declaration], file: str = "<input>") -> tuple[Model, ...]:
    """Models in declaration order, aliases resolved (fields copied from the base, then the
    alias's own keys applied), `hf("path")` models read from their config.json. Bases may
    be declared later; cycles are errors."""
    by_name: dict[str, Declaration] = {}
    for decl in decls:
        name = decl.name
        if name.text in ARCHITECTURES:
            raise SemanticError(f"'{name.text}' names an architecture and cannot name a model", name.loc,
                                "choose another name, e.g. actor", width=name.width)
        if name.text in by_name:
            raise SemanticError(f"model '{name.text}' is declared twice", name.loc,
                                f"the first is at {_at(by_name[name.text].name)}; rename one", width=name.width)
        by_name[name.text] = decl
    built: dict[str, Model] = {}

    def build(decl: Declaration, chain: tuple[str, ...]) -> Model:
        if decl.name.text in built:
            return built[decl.name.text]
        where = f"model '{decl.name.text}'"
        base = decl.base
        if base.text == TABLE_ARCHITECTURE and decl.argument is None:
            model = build_table_model(decl, where)
            built[decl.name.text] = model
            return model
        own = _read_block(decl.body or (), MODEL_KEYS, where)
        _rope_scaling(own, where)
        if decl.argument is not None:
            fields = _checkpoint_fields(decl, file)
        elif base.text in ARCHITECTURES:
            if decl.body is None:
                raise SemanticError(f"{where} needs its architecture's sizes", base.loc,
                                    "write it like llama { layers 32 hidden 4096 heads 32 kv_heads 8 ffn 14336 "
                                    "vocab 128256 }", width=base.width)
            _require(own, MODEL_INTS, decl.name, where)
            fields = {"architecture": base.text, "dtype": "bf16", "head": "lm", "base": None,
                      **ARCHITECTURE_DEFAULTS[base.text]}
        elif base.text in by_name:
            if base.text in chain:
                cycle = " -> ".join(chain[chain.index(base.text):] + (base.text,))
                raise SemanticError(f"model alias cycle: {cycle}", base.loc,
                                    "one model of the cycle must be declared with an architecture (= llama {...})",
                                    width=base.width)
            source = build(by_name[base.text], chain + (base.text,))
            fields = {key: getattr(source, key) for key in MODEL_FIELDS}
            fields["base"] = base.text
        else:
            options = list(ARCHITECTURES) + list(by_name)
            raise SemanticError(f"unknown model or architecture '{base.text}'", base.loc,
                                did_you_mean(base.text, options) + f"architectures: {', '.join(ARCHITECTURES)}; "
                                f"models: {', '.join(by_name)}", width=base.width)
        if fields.get("head_dim") is not None and fields["head_dim"] * fields["heads"] == fields["hidden"]:
            fields["head_dim"] = None  # hidden / heads: follows an override of hidden or heads
        fields.update(own.values)
        model = Model(name=decl.name.text, loc=decl.name.loc, key_locs=own.key_locs(), **fields)
        built[decl.name.text] = model
        return model

    return tuple(build(decl, (decl.name.text,)) for decl in decls)


def build_workload(decl: Declaration) -> Workload:
    where = f"workload '{decl.name.text}'"
    read = _read_block(decl.body, WORKLOAD_KEYS, where, lists=STAGES)
    _require(read, WORKLOAD_INTS, decl.name, where)
    v = read.values
    stages = tuple((stage, tuple(w.text for w in v[stage])) for stage in STAGES if stage in v)
    model_locs = tuple((f"{stage}:{w.text}", w.loc) for stage in STAGES if stage in v for w in v[stage])
    return Workload(decl.name.text, v["batch"], v["prompt"], v["response"], v["microbatch"], stages,
                    v.get("recompute", "none"), loc=decl.name.loc, key_locs=read.key_locs() + model_locs)


def _placement(syntax: PlacementSyntax, cluster: Cluster, plan: str) -> Placement:
    word = syntax.model_stage
    where = f"{word.text} in plan {plan}"
    seen: dict[str, Word] = {}
    values: dict[str, int] = {"dp": 1, "tp": 1, "pp": 1, "ep": 1, "zero": 0}
    locs: dict[str, Location] = {}
    gpu_items: Optional[tuple] = None
    offload = False
    quant = None
    mesh = None
    for kind, key, value in syntax.items:
        if key.text not in PLACEMENT_KEYS:
            raise SemanticError(f"unknown key '{key.text}' in a placement", key.loc,
                                did_you_mean(key.text, PLACEMENT_KEYS) + f"a placement takes {_one_of(PLACEMENT_KEYS)}",
                                width=key.width)
        if key.text in seen:
            raise SemanticError(f"'{key.text}' is given twice for {where}", key.loc,
                                f"the first is at {_at(seen[key.text])}; keep one", width=key.width)
        seen[key.text] = key
        if key.text == "mesh":
            if kind != "mesh":
                raise SemanticError("'mesh' takes its dimensions in parentheses", key.loc,
                                    "write it like mesh (dp 2, tp 4)", width=key.width)
            mesh = (key, value)
            locs["mesh"] = key.loc
        elif key.text == "offload":
            if kind != "flag":
                raise SemanticError("'offload' takes no value", value.loc, "write offload alone", width=value.width)
            offload = True
        elif key.text == "on":
            gpu_items = value
            locs["on"] = key.loc
        elif key.text == "quant":
            if kind != "key" or value.text not in QUANT_FORMATS:
                at = value if kind == "key" else key
                raise SemanticError(f"unknown weight format '{value.text if kind == 'key' else ''}' after quant",
                                    at.loc, f"write quant {' or '.join(QUANT_FORMATS)}", width=at.width)
            quant = value.text
            locs["quant"] = value.loc
        elif kind == "flag":
            raise SemanticError(f"'{key.text}' needs a number", key.loc, f"write it like {key.text} 2",
                                width=key.width)
        else:
            try:
                # zero 0 is the documented default, so it may be written out
                values[key.text] = units.parse_int(value.text, key.text, minimum=0 if key.text == "zero" else 1)
            except units.UnitError as error:
                raise SemanticError(error.message, value.loc, error.hint, width=value.width) from None
            locs[key.text] = value.loc
    if gpu_items is None:
        raise SemanticError(f"{where} has no GPU set", word.loc, "add one, e.g. on 0..7 or on n0..n1",
                            width=word.width)
    gpus = resolve_gpu_set(gpu_items, cluster, word.text)
    model, _, stage = word.text.partition(".")
    layout = None
    if mesh is None and syntax.layout is not None:
        raise SemanticError(f"layout rules without a mesh for {where}", syntax.layout_word.loc,
                            "name the mesh they split, e.g. mesh (dp 2, tp 2) on 0..3 { ... }")
    if mesh is not None:
        for other in MESH_EXCLUDES:
            if other in seen:
                raise SemanticError(f"'{other}' and 'mesh' both split {where}", seen[other].loc,
                                    "a mesh layout says how its GPUs split each tensor: drop "
                                    f"'{other}'", width=seen[other].width)
        layout = build_mesh_layout(mesh[0], mesh[1], syntax.layout, syntax.layout_word, cluster, where)
        values["tp"] = len(gpus)
    return Placement(ModelStage(model, stage), values["dp"], values["tp"], values["pp"], gpus, gpu_items,
                     offload, values["zero"], loc=word.loc, key_locs=tuple(locs.items()), ep=values["ep"],
                     layout=layout, quant=quant)


def build_plans(decls: list[Declaration], cluster: Cluster, workload: Workload) -> tuple[Plan, ...]:
    """Plans in declaration order; a derived plan's placements are its base's with its own
    entries replacing the base's, in workload order."""
    by_name: dict[str, Declaration] = {}
    for decl in decls:
        if decl.name.text in by_name:
            raise SemanticError(f"plan '{decl.name.text}' is declared twice", decl.name.loc,
                                f"the first is at {_at(by_name[decl.name.text].name)}; rename one",
                                width=decl.name.width)
        by_name[decl.name.text] = decl
    built: dict[str, Plan] = {}

    def build(decl: Declaration, chain: tuple[str, ...]) -> Plan:
        if decl.name.text in built:
            return built[decl.name.text]
        declared: list[Placement] = []
        firsts: dict[ModelStage, Word] = {}
        for syntax in decl.placements:
            placement = _placement(syntax, cluster, decl.name.text)
            if placement.model_stage in firsts:
                raise SemanticError(f"{syntax.model_stage.text} is placed twice in plan {decl.name.text}",
                                    syntax.model_stage.loc,
                                    f"the first is at {_at(firsts[placement.model_stage])}; keep one",
                                    width=syntax.model_stage.width)
            firsts[placement.model_stage] = syntax.model_stage
            declared.append(placement)
        inherited: dict[ModelStage, Placement] = {}
        base = decl.base
        if base is not None:
            if base.text not in by_name:
                raise SemanticError(f"unknown plan '{base.text}'", base.loc,
                                    did_you_mean(base.text, by_name) + f"plans: {', '.join(by_name)}", width=base.width)
            if base.text in chain:
                cycle = " -> ".join(chain[chain.index(base.text):] + (base.text,))
                raise SemanticError(f"plan inheritance cycle: {cycle}", base.loc,
                                    "one plan of the cycle must place everything itself", width=base.width)
            inherited = {p.model_stage: p for p in build(by_name[base.text], chain + (base.text,)).placements}
        own = {p.model_stage: p for p in declared}
        placements = tuple(own.get(ms) or inherited[ms] for ms in workload.model_stages()
                           if ms in own or ms in inherited)
        plan = Plan(decl.name.text, base.text if base else None, tuple(declared), placements, loc=decl.name.loc)
        built[decl.name.text] = plan
        return plan

    return tuple(build(decl, (decl.name.text,)) for decl in decls)


def build_transitions(decls: list[Declaration], plans: tuple[Plan, ...]) -> tuple[Transition, ...]:
    names = [plan.name for plan in plans]
    transitions = []
    firsts: dict[tuple[str, str], Word] = {}
    for decl in decls:
        for word in (decl.name, decl.base):
            if word.text not in names:
                raise SemanticError(f"unknown plan '{word.text}'", word.loc,
                                    did_you_mean(word.text, names) + f"plans: {', '.join(names) or 'none declared'}",
                                    width=word.width)
        key = (decl.name.text, decl.base.text)
        if key[0] == key[1]:
            raise SemanticError(f"transition from plan {key[0]} to itself", decl.base.loc,
                                "a transition goes between two different plans", width=decl.base.width)
        if key in firsts:
            raise SemanticError(f"transition {key[0]} -> {key[1]} is declared twice", decl.name.loc,
                                f"the first is at {_at(firsts[key])}; keep one", width=decl.name.width)
        firsts[key] = decl.name
        transitions.append(Transition(key[0], key[1], loc=decl.name.loc))
    return tuple(transitions)


def build_module(decls: tuple[Declaration, ...], file: str) -> Module:
    """Input: the declarations of one file. Output: the Module (not yet validated)."""
    start = Location(file, 1, 1)
    if not decls:
        raise SemanticError("empty file: nothing is declared", start,
                            "a .nir file declares a cluster, models, a workload, plans and transitions")
    by_kind: dict[str, list[Declaration]] = {kind: [] for kind in ("cluster", "model", "workload", "plan", "transition")}
    for decl in decls:
        by_kind[decl.kind].append(decl)
    for kind in ("cluster", "workload"):
        found = by_kind[kind]
        if not found:
            raise SemanticError(f"no {kind} is declared", start,
                                f"a .nir file declares exactly one {kind}, e.g. "
                                + ("cluster NAME { nodes 1 gpus_per_node 8 ... }" if kind == "cluster"
                                   else "workload NAME { batch 512 prompt 1024 response 2048 microbatch 4 ... }"))
        if len(found) > 1:
            second = found[1].keyword
            raise SemanticError(f"a second {kind} is declared", second.loc,
                                f"a .nir file declares exactly one {kind}; the first, '{found[0].name.text}', "
                                f"is at {_at(found[0].keyword)}", width=len(kind))
    cluster = build_cluster(by_kind["cluster"][0])
    validate_cluster(cluster)  # before GPU sets are resolved against it
    models = build_models(by_kind["model"], file)
    workload = build_workload(by_kind["workload"][0])
    plans = build_plans(by_kind["plan"], cluster, workload)
    transitions = build_transitions(by_kind["transition"], plans)
    return Module(cluster, models, workload, plans, transitions, file=file)
