"""The rules of docs/ir.md ("Rules the compiler enforces") checked on a Module.

`validate_module` runs on every parsed module and again after `--set` overrides, so a
rule holds whichever way a value got into the module. Errors point at the value that
breaks the rule (through `key_locs`), falling back to the declaration.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .diagnostics import SemanticError
from .gpuset import resolve_gpu_set, set_location
from .model import (
    ARCHITECTURE_DEFAULTS, DTYPE_BYTES, HEADS, MOE_ARCHITECTURES, ROPE_SCALING_TYPES, STAGES, TABLE_ARCHITECTURE,
    ZERO_STAGES, Cluster, Model, Module, Placement, Plan, Workload, key_loc,
)
from .units import RESERVE_HINT
from .validate_table import validate_mesh_placement, validate_table_model

ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURE_DEFAULTS) + (TABLE_ARCHITECTURE,)
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
MAX_GPUS = 1 << 20  # GPU sets are expanded to id lists; this keeps them in memory

# Sanity bounds (docs/ir.md, "Ranges"). They are far above any real model or machine
# (llama 3.1 405B: 126 layers, hidden 16384, ffn 53248, vocab 128256, 128k context) and
# catch typos before the memory model turns them into "needs 1.4e26 GiB".
MAX_MODEL: dict[str, int] = {"layers": 4096, "hidden": 1 << 18, "heads": 1 << 14, "kv_heads": 1 << 14,
                             "ffn": 1 << 20, "vocab": 1 << 24, "experts": 1 << 16,
                             "experts_per_token": 1 << 16, "expert_ffn": 1 << 20}
MAX_WORKLOAD: dict[str, int] = {"batch": 1 << 24, "prompt": 1 << 24, "response": 1 << 24, "microbatch": 1 << 24}
MAX_BYTES = 10**15                # 1000TB: GPU and host memory
MAX_BYTES_PER_S = 10**15          # 1000TB/s: HBM and network rates
MAX_FLOPS = 10**18                # 1000PFLOPS


def _error(message: str, node, key: str, hint: Optional[str] = None, width: int = 1) -> SemanticError:
    return SemanticError(message, key_loc(node, key), hint, width=width)


def _written(node, *keys: str) -> str:
    """The first of `keys` whose value `node` writes itself (a derived model inherits the
    others from its base): the place to point at when a rule ties several keys."""
    own = {name for name, _ in getattr(node, "key_locs", ())}
    return next((key for key in keys if key in own), keys[0])


def _width(node, key: str, value) -> int:
    return len(str(value)) if key_loc(node, key) is not getattr(node, "loc", None) else len(getattr(node, "name", "x"))


def _at_least_one(node, keys: tuple[str, ...], owner: str) -> None:
    for key in keys:
        value = getattr(node, key)
        if value < 1:
            raise _error(f"{key} must be at least 1, found {value}", node, key, f"{owner} needs a positive {key}",
                         _width(node, key, value))


def _at_most(node, keys: dict[str, int], owner: str) -> None:
    for key, maximum in keys.items():
        value = getattr(node, key)
        if value > maximum:
            raise _error(f"{key} {value} is above the limit of {maximum}", node, key,
                         f"{owner} takes {key} from 1 to {maximum} (a sanity bound; a larger value is almost surely a typo)",
                         _width(node, key, value))


def _quantity_at_most(cluster: Cluster, key: str, value, maximum, written) -> None:
    if value > maximum:
        text = written(value)
        raise _error(f"{key.split('.')[-1]} {text} is above the limit of {written(maximum)}", cluster, key,
                     f"cluster {cluster.name} takes {key.split('.')[-1]} up to {written(maximum)} (a sanity bound; "
                     "a larger value is almost surely a typo)", len(text))


def validate_cluster(cluster: Cluster) -> None:
    """Every count, size and rate positive and below its sanity bound; 0 <= reserve < 1."""
    _at_least_one(cluster, ("nodes", "gpus_per_node"), f"cluster {cluster.name}")
    if cluster.num_gpus > MAX_GPUS:
        raise _error(f"a cluster of {cluster.num_gpus} GPUs is larger than Nereus supports ({MAX_GPUS})", cluster,
                     "nodes", "describe the part of the cluster that the job uses", _width(cluster, "nodes", cluster.nodes))
    for key, value in (("gpu.mem", cluster.gpu.mem_bytes), ("gpu.flops", cluster.gpu.flops),
                       ("gpu.hbm", cluster.gpu.hbm_bytes_per_s), ("intra", cluster.intra_bytes_per_s),
                       ("inter", cluster.inter_bytes_per_s), ("host_mem", cluster.host_mem_bytes)):
        if not value > 0:
            raise _error(f"{key.split('.')[-1]} must be positive", cluster, key)
    from .units import format_flops, format_rate, format_size

    for key, value, maximum, written in (
            ("gpu.mem", cluster.gpu.mem_bytes, MAX_BYTES, format_size),
            ("host_mem", cluster.host_mem_bytes, MAX_BYTES, format_size),
            ("gpu.flops", cluster.gpu.flops, MAX_FLOPS, format_flops),
            ("gpu.hbm", cluster.gpu.hbm_bytes_per_s, MAX_BYTES_PER_S, format_rate),
            ("intra", cluster.intra_bytes_per_s, MAX_BYTES_PER_S, format_rate),
            ("inter", cluster.inter_bytes_per_s, MAX_BYTES_PER_S, format_rate)):
        _quantity_at_most(cluster, key, value, maximum, written)
    if not 0 <= cluster.reserve < 1:
        raise _error(f"reserve must be at least 0% and below 100%, found {cluster.reserve * 100:g}%", cluster,
                     "reserve", RESERVE_HINT)


def validate_model(model: Model) -> None:
    """Known architecture, dtype and head; positive sizes; heads | hidden; kv_heads | heads
    (a `tensors` model: validate_table)."""
    if model.architecture not in ARCHITECTURES:
        raise _error(f"unknown architecture '{model.architecture}'", model, "architecture",
                     f"architectures: {', '.join(ARCHITECTURES)}")
    if model.is_table:
        validate_table_model(model)
        return
    _at_least_one(model, ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"), f"model {model.name}")
    _at_most(model, MAX_MODEL, f"model {model.name}")
    if model.dtype not in DTYPE_BYTES:
        raise _error(f"unknown dtype '{model.dtype}'", model, "dtype", f"dtypes: {', '.join(DTYPE_BYTES)}")
    if model.head not in HEADS:
        raise _error(f"unknown head '{model.head}'", model, "head", f"heads: {', '.join(HEADS)}")
    if model.head_dim is None:
        key = _written(model, "hidden", "heads")
        raise _error(f"hidden {model.hidden} must be divisible by heads ({model.heads})", model, key,
                     f"head_dim = hidden / heads must be whole; e.g. hidden {model.heads * max(1, model.hidden // model.heads)}"
                     ", or give head_dim", _width(model, key, getattr(model, key)))
    _validate_numerics(model)
    _validate_experts(model)
    if model.kv_heads > model.heads or model.heads % model.kv_heads:
        key = _written(model, "kv_heads", "heads")
        raise _error(f"kv_heads {model.kv_heads} must divide heads ({model.heads})", model, key,
                     f"each KV head serves heads / kv_heads query heads; use one of {_divisors(model.heads)}",
                     _width(model, key, getattr(model, key)))


def _validate_experts(model: Model) -> None:
    """A MoE family has experts >= 1, 1 <= experts_per_token <= experts, expert_ffn >= 1;
    a dense family has none of them."""
    keys = ("experts", "experts_per_token", "expert_ffn")
    if model.architecture not in MOE_ARCHITECTURES:
        for key in keys:
            if getattr(model, key):
                raise _error(f"{key} is for mixture-of-experts models; {model.name} is a dense "
                             f"{model.architecture}", model, key,
                             f"drop {key}, or declare the model = {', '.join(MOE_ARCHITECTURES)} {{ ... }}",
                             _width(model, key, getattr(model, key)))
        return
    _at_least_one(model, keys, f"model {model.name} ({model.architecture})")
    if model.experts_per_token > model.experts:
        key = _written(model, "experts_per_token", "experts")
        raise _error(f"experts_per_token {model.experts_per_token} is more than the {model.experts} experts of "
                     f"{model.name}", model, key, f"use at most {model.experts}",
                     _width(model, key, getattr(model, key)))


def _validate_numerics(model: Model) -> None:
    """head_dim positive; theta and eps positive and finite; a known rope scaling whose
    frequency band is not empty."""
    if model.head_dim < 1:
        raise _error(f"head_dim must be at least 1, found {model.head_dim}", model, "head_dim",
                     "e.g. head_dim 128", _width(model, "head_dim", model.head_dim))
    for key in ("rope_theta", "norm_eps"):
        value = getattr(model, key)
        if not 0 < value < float("inf"):
            raise _error(f"{key} must be positive and finite, found {value}", model, key)
    scaling = model.rope_scaling
    if scaling is None:
        return
    if scaling.type not in ROPE_SCALING_TYPES:
        raise _error(f"unknown rope scaling type '{scaling.type}'", model, "rope_scaling.type",
                     f"types: {', '.join(ROPE_SCALING_TYPES)}")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        value = getattr(scaling, key)
        if not 0 < value < float("inf"):
            raise _error(f"rope_scaling {key} must be positive and finite, found {value}", model,
                         f"rope_scaling.{key}")
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise _error(f"rope_scaling high_freq_factor ({scaling.high_freq_factor:g}) must be above low_freq_factor "
                     f"({scaling.low_freq_factor:g})", model,
                     _written(model, "rope_scaling.high_freq_factor", "rope_scaling.low_freq_factor"),
                     "Llama-3.1 uses low_freq_factor 1 and high_freq_factor 4")


def validate_workload(workload: Workload, models: tuple[Model, ...]) -> None:
    """Positive counts below their sanity bounds, microbatch dividing batch, known stages,
    declared models, none twice."""
    _at_least_one(workload, ("batch", "prompt", "response", "microbatch"), f"workload {workload.name}")
    _at_most(workload, MAX_WORKLOAD, f"workload {workload.name}")
    if workload.microbatch > workload.batch:
        raise _error(f"microbatch {workload.microbatch} is larger than batch {workload.batch}", workload,
                     "microbatch", f"use a microbatch of at most {workload.batch}",
                     _width(workload, "microbatch", workload.microbatch))
    if workload.batch % workload.microbatch:
        raise _error(f"microbatch {workload.microbatch} must divide batch ({workload.batch})", workload,
                     "microbatch", f"a step runs batch / microbatch whole microbatches; microbatches that divide "
                     f"{workload.batch}: {_divisors(workload.batch)}",
                     _width(workload, "microbatch", workload.microbatch))
    if workload.recompute not in RECOMPUTE:
        raise _error(f"unknown recompute mode '{workload.recompute}'", workload, "recompute",
                     f"modes: {', '.join(RECOMPUTE)}")
    names = [model.name for model in models]
    for stage, stage_models in workload.stages:
        if stage not in STAGES:
            raise _error(f"unknown stage '{stage}'", workload, stage, f"stages: {', '.join(STAGES)}")
        seen = set()
        for name in stage_models:
            key = f"{stage}:{name}"
            if name not in names:
                raise _error(f"unknown model '{name}' in {stage}", workload, key,
                             f"models: {', '.join(names) or 'none declared'}", len(name))
            if name in seen:
                locs = [loc for written, loc in workload.key_locs if written == key]
                raise SemanticError(f"model '{name}' is listed twice in {stage}",
                                    locs[1] if len(locs) > 1 else workload.loc, "list it once", width=len(name))
            seen.add(name)


def _divisors(n: int) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, found[:8])) + (", ..." if len(found) > 8 else "")


def valid_tps(model: Model, limit: int = 1024) -> list[int]:
    """TP degrees the model admits: dividing heads, ffn and vocab, and the KV rule."""
    return [t for t in range(1, min(limit, model.heads) + 1)
            if model.heads % t == 0 and (model.expert_ffn if model.experts else model.ffn) % t == 0
            and model.vocab % t == 0
            and (model.kv_heads % t == 0 if t <= model.kv_heads else t % model.kv_heads == 0)]


def _tp_hint(model: Model) -> str:
    tps = valid_tps(model)
    return f"tp values that fit {model.name}: {', '.join(map(str, tps[:10]))}" if tps else \
        f"no tp above 1 fits {model.name}"


def validate_placement(placement: Placement, module: Module) -> None:
    """The model-stage exists and runs in the workload; tp divides heads, ffn and vocab and
    fits kv_heads; pp <= layers; the set has dp*tp*pp GPUs of the cluster, none twice."""
    ms = placement.model_stage
    loc = placement.loc
    names = [model.name for model in module.models]
    if ms.model not in names:
        raise SemanticError(f"unknown model '{ms.model}'", loc, f"models: {', '.join(names) or 'none declared'}",
                            width=len(ms.model))
    stage_loc = replace(loc, column=loc.column + len(ms.model) + 1) if loc is not None else None
    if ms.stage not in STAGES:
        raise SemanticError(f"unknown stage '{ms.stage}'", stage_loc, f"stages: {', '.join(STAGES)}",
                            width=max(1, len(ms.stage)))
    workload = module.workload
    if ms.model not in workload.models_in(ms.stage):
        runs = ", ".join(workload.models_in(ms.stage)) or "no model"
        raise SemanticError(f"{ms} is not in workload {workload.name}", loc,
                            f"workload {workload.name} runs {runs} in {ms.stage}", width=len(str(ms)))
    _at_least_one(placement, ("dp", "tp", "pp", "ep"), str(ms))
    if placement.zero not in ZERO_STAGES:
        raise _error(f"zero {placement.zero} is not supported", placement, "zero",
                     "zero 1 shards the optimizer state over dp, zero 3 the weights too; zero 0 replicates them",
                     _width(placement, "zero", placement.zero))
    if placement.zero and ms.stage != "training":
        raise _error(f"zero applies to training only; {ms} holds no optimizer state", placement, "zero",
                     "drop zero here, or put it on a .training model-stage", _width(placement, "zero", placement.zero))
    model = module.model(ms.model)
    if placement.quant is not None and ms.stage != "generation":
        raise _error(f"quant applies to generation only; {ms} computes in {model.dtype}", placement, "quant",
                     "drop quant here, or put it on a .generation model-stage (the weight sync quantizes)",
                     _width(placement, "quant", placement.quant))
    if model.is_table or placement.layout is not None:
        validate_mesh_placement(placement, model, module)
        _validate_gpu_ids(placement, module)
        return
    _validate_ep(placement, model)
    if placement.zero and placement.ep > 1:
        # zero_boxes chunks each TP shard over dp; the chunking of expert shards held by one
        # EP rank is not designed yet, so the two are not combined
        raise _error("zero with expert parallelism is not supported yet", placement, "zero",
                     f"use zero 0 with ep {placement.ep}, or ep 1 with zero {placement.zero}",
                     _width(placement, "zero", placement.zero))
    tp, width = placement.tp, _width(placement, "tp", placement.tp)
    # a MoE layer has no dense MLP: its experts' ffn is what TP splits
    mlp = ("expert_ffn", model.expert_ffn) if model.experts else ("ffn", model.ffn)
    sizes = (("heads", model.heads), mlp, ("vocab", model.vocab))
    for what, size in sizes:
        if size % tp:
            raise _error(f"tp {tp} must divide {what} ({size}) of {model.name}", placement, "tp", _tp_hint(model),
                         width)
    if tp <= model.kv_heads and model.kv_heads % tp:
        raise _error(f"tp {tp} must divide kv_heads ({model.kv_heads}) of {model.name}", placement, "tp",
                     _tp_hint(model), width)
    if tp > model.kv_heads and tp % model.kv_heads:
        raise _error(f"tp {tp} is above kv_heads ({model.kv_heads}) of {model.name} but not a multiple of it",
                     placement, "tp", f"each KV head is replicated on tp / kv_heads ranks; {_tp_hint(model)}", width)
    if placement.pp > 1 and model.tie_embeddings and model.head == "lm":
        raise _error(f"{model.name} ties its embedding and lm head, which needs pp 1 (both on one stage)", placement,
                     "pp", "use pp 1 for this model-stage, or tie_embeddings false (separate head weights)",
                     _width(placement, "pp", placement.pp))
    if placement.pp > model.layers:
        raise _error(f"pp {placement.pp} is more than the {model.layers} layers of {model.name}", placement, "pp",
                     f"use a pp of at most {model.layers}", _width(placement, "pp", placement.pp))
    _validate_gpu_ids(placement, module)
    gpus = placement.gpus
    set_loc, set_width = set_location(placement.gpu_set) if placement.gpu_set else (loc, len(str(ms)))
    if len(gpus) != placement.world:
        need, mesh = placement.world, placement.tp * placement.pp * placement.ep
        example = "0" if need == 1 else f"0..{need - 1}"
        hint = f"give {need} GPU{'s' if need != 1 else ''} (e.g. on {example})"
        if len(gpus) % mesh == 0:
            hint += f" or change dp to {len(gpus) // mesh}"
        ep_names, ep_values = (" x ep", f" x {placement.ep}") if placement.ep != 1 else ("", "")
        raise SemanticError(
            f"the GPU set of {ms} has {len(gpus)} GPU{'s' if len(gpus) != 1 else ''}, but dp x tp x pp{ep_names} = "
            f"{placement.dp} x {placement.tp} x {placement.pp}{ep_values} = {need}", set_loc, hint, width=set_width)


def _validate_gpu_ids(placement: Placement, module: Module) -> None:
    """Every GPU of the set exists in the cluster, none twice."""
    cluster = module.cluster
    gpus, ms, loc = placement.gpus, placement.model_stage, placement.loc
    if gpus and (min(gpus) < 0 or max(gpus) >= cluster.num_gpus) or len(set(gpus)) != len(gpus):
        if placement.gpu_set:  # report at the written item
            resolve_gpu_set(placement.gpu_set, cluster, str(ms))
        bad = [gpu for gpu in gpus if not 0 <= gpu < cluster.num_gpus]
        if bad:
            raise SemanticError(f"GPU {bad[0]} does not exist", loc, f"GPU ids run 0..{cluster.num_gpus - 1}")
        raise SemanticError(f"a GPU appears twice in {ms}", loc, "list each GPU once")


def _validate_ep(placement: Placement, model: Model) -> None:
    """ep > 1 needs a MoE model whose experts it divides (each EP rank holds experts / ep
    whole experts)."""
    ep = placement.ep
    if ep == 1:
        return
    width = _width(placement, "ep", ep)
    if not model.experts:
        raise _error(f"ep {ep} needs a mixture-of-experts model; {model.name} is a dense {model.architecture}",
                     placement, "ep", "drop ep (expert parallelism splits experts), or use dp/tp/pp", width)
    if model.experts % ep:
        raise _error(f"ep {ep} must divide experts ({model.experts}) of {model.name}", placement, "ep",
                     f"each EP rank holds experts / ep whole experts; ep values that fit: "
                     f"{_divisors(model.experts)}", width)


def validate_plan(plan: Plan, module: Module) -> None:
    """Each written entry is valid, and every model-stage of the workload is placed."""
    for placement in plan.declared:
        validate_placement(placement, module)
    placed = {p.model_stage for p in plan.placements}
    for ms in module.workload.model_stages():
        if ms not in placed:
            origin = f" (with what it inherits from {plan.base})" if plan.base else ""
            raise SemanticError(f"plan {plan.name} does not place {ms}{origin}", plan.loc,
                                f"every model-stage of workload {module.workload.name} needs a placement in every "
                                f"plan; add a line like {ms} dp 1 on 0", width=len(plan.name))


def validate_module(module: Module) -> None:
    """Input: a built Module. Output: None. Invariant on return: every rule of docs/ir.md
    holds; otherwise the first broken rule, in declaration order, is raised."""
    validate_cluster(module.cluster)
    for model in module.models:
        validate_model(model)
    validate_workload(module.workload, module.models)
    for plan in module.plans:
        validate_plan(plan, module)
    names = {plan.name for plan in module.plans}
    for transition in module.transitions:
        for name in (transition.source, transition.target):
            if name not in names:
                raise SemanticError(f"unknown plan '{name}'", transition.loc, f"plans: {', '.join(sorted(names))}")
        if transition.source == transition.target:
            raise SemanticError(f"transition from plan {transition.source} to itself", transition.loc,
                                "a transition goes between two different plans")
