"""`reshard_module`: move a PyTorch module and its optimizer from one parallel layout to
another, in place, as a compiled and proven Nereus transition (docs/interop.md).

    report = reshard_module(src_model, src_optim, dst_model, dst_optim)   # collective

`src_model`: any nn.Module whose parameters are DTensors (FSDP2 `fully_shard`, tensor
parallelism `parallelize_module`, both, any mesh) or plain tensors; `dst_model`: the same
architecture built by the user (on the meta device or not) and parallelized for the
target layout over the same world. Steps, each on every rank of the default group:

1. read both layouts from the DTensors (nereus.interop.layouts) and check that the two
   modules and optimizers match (names, shapes, dtypes, parameter groups): any problem is
   an InteropError on every rank before anything is allocated;
2. write them as a `.nir` module with two plans (nereus.interop.nir) and compile the
   transition with the compiler's full pipeline: diff, DAG, memory-aware schedule,
   fusion, lowering; rank 0 proves the program, every rank checks its part's digest;
3. register the source's local shards (parameters and optimizer states) with a Nereus
   Runtime and run the transition: only bytes whose owner changes move; all or nothing
   (TransitionAborted on every rank, the source untouched);
4. materialize `dst_model` on this rank's device (`to_empty` when on meta), copy the new
   shards into its parameters' local tensors (FSDP2's own storage), copy every plain
   buffer (non-persistent ones too: a rotary `inv_freq` left as `to_empty` garbage makes
   NaN losses) from the source, and give `dst_optim` its state (the same keys and scalar
   `step`s as the source's, the tensors as DTensors of the destination's placements) and
   the source's parameter-group settings (learning rate and the rest).

The source module and optimizer are only read. Compiled programs are kept per layout
pair in a process-wide cache, so moving between the same layouts again is warm.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
import torch
import torch.distributed as dist

from .errors import InteropError, agree_or_raise, raise_first, verdict
from .layouts import (
    PARAM, ModuleLayout, buffers_of, is_dtensor, local_of, module_layout, optimizer_scalars, rank_boxes,
)
from .nir import Machine, cluster_text, model_groups, module_text

SOURCE, TARGET = "src", "dst"
_RUNTIMES: dict = {}  # (layouts text, world, device) -> (Machine, Runtime, module text): compiled per layout pair


@dataclass
class ReshardReport:
    """What one `reshard_module` call did; byte counts are over all ranks."""

    seconds: float  # this rank's transition, from the call to its readiness to commit
    max_seconds: float  # the slowest rank's
    wall_s: float  # this rank's whole call
    layout_s: float  # reading and checking both layouts
    compile_s: float  # compiling, lowering and proving (0 when the pair was compiled before)
    materialize_s: float  # filling dst_model and dst_optim
    bytes_sent: int  # between ranks, all ranks
    bytes_copied: int  # this rank, same-device copies
    lower_bound_bytes: int  # bytes whose owner changes (what any correct move must send)
    peak_bytes: int  # this rank's device memory peak during the transition, as the runtime counted it
    predicted_peak_bytes: int  # the compiler's proven peak on the worst GPU
    rounds: int
    verified: bool  # the program was proven before it ran
    nir: str = field(repr=False, default="")  # the .nir module: both layouts as plans src and dst

    def to_json(self) -> dict:
        out = dict(self.__dict__)
        out.pop("nir")
        return out


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _free_bytes(device: torch.device) -> int:
    """What this rank's device has free now (a CPU rank: its share of the host's memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return _available_host_bytes() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))


def _machine(room: int, world: int) -> Machine:
    """The world as a cluster: nodes from torchrun's LOCAL_WORLD_SIZE; per GPU `room`, the
    memory a transition may use (the lowest over the ranks of what is free plus the state
    it moves), rounded down to 256 MiB."""
    quantum = 256 << 20
    mem = max(quantum, room // quantum * quantum)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    per_node = local if local > 0 and world % local == 0 else world
    host = _available_host_bytes() // quantum * quantum or quantum
    return Machine(nodes=world // per_node, gpus_per_node=per_node, mem_bytes=mem, host_mem_bytes=host)


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 64 << 30


_GLOO = []


def _gloo():
    """A gloo group over the world for the small control collectives of this package
    (object gathers need one on NCCL jobs)."""
    if dist.get_backend() == "gloo":
        return None
    if not _GLOO:
        _GLOO.append(dist.new_group(backend="gloo"))
    return _GLOO[0]


def _check_pair(src: ModuleLayout, dst: ModuleLayout, src_model, dst_model, src_optim, dst_optim) -> None:
    """The two modules hold the same tensors (names, shapes, dtypes) and the optimizers
    match (both or neither; the same parameter groups by name). Raises InteropError."""
    a, b = src.by_name(), dst.by_name()
    for name in a:
        if name not in b:
            raise InteropError(f"{name} is in the source module but not in the destination", name=name)
    for name in b:
        if name not in a:
            raise InteropError(f"{name} is in the destination module but not in the source", name=name)
        if (a[name].shape, a[name].dtype) != (b[name].shape, b[name].dtype):
            raise InteropError(f"{name} is {list(a[name].shape)} {a[name].dtype} in the source but "
                               f"{list(b[name].shape)} {b[name].dtype} in the destination", name=name)
        if a[name].kind != b[name].kind:
            raise InteropError(f"{name} is a {a[name].kind} in the source, a {b[name].kind} in the destination",
                               name=name)
    if (src_optim is None) != (dst_optim is None):
        raise InteropError("give both optimizers or neither", hint="reshard_module(src, src_optim, dst, dst_optim)")
    if src_optim is not None:
        src_groups, dst_groups = _group_names(src_model, src_optim), _group_names(dst_model, dst_optim)
        if len(src_groups) != len(dst_groups):
            raise InteropError(f"the source optimizer has {len(src_groups)} parameter groups, the destination "
                               f"{len(dst_groups)}", hint="build dst_optim with the same groups as src_optim")
        for i, (x, y) in enumerate(zip(src_groups, dst_groups)):
            if x != y:
                name = sorted(set(x) ^ set(y))[0] if set(x) != set(y) else x[0]
                raise InteropError(f"parameter group {i} differs: {name} is in one optimizer's group only",
                                   name=name, hint="build dst_optim with the same groups as src_optim")
    src_buffers, dst_buffers = buffers_of(src_model), buffers_of(dst_model)
    for name, buffer in dst_buffers.items():
        if name not in src_buffers:
            raise InteropError(f"buffer {name} of the destination is not in the source", name=name)
        if tuple(src_buffers[name].shape) != tuple(buffer.shape) or src_buffers[name].dtype != buffer.dtype:
            raise InteropError(f"buffer {name} is {tuple(src_buffers[name].shape)} {src_buffers[name].dtype} in the "
                               f"source, {tuple(buffer.shape)} {buffer.dtype} in the destination", name=name)


def _group_names(model, optim) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for group in optim.param_groups:
        missing = [p for p in group["params"] if id(p) not in names]
        if missing:
            raise InteropError("an optimizer holds a parameter its module does not have",
                               hint="pass the optimizer built over that module's parameters")
        out.append([names[id(p)] for p in group["params"]])
    return out


_TEXTS: dict = {}  # (source layout, destination layout, name) -> their .nir text without a cluster


def _layouts_text(src: ModuleLayout, dst: ModuleLayout, name: str) -> str:
    """The two layouts as plans of one .nir text (no cluster block), once per pair: the
    layouts of a module that keeps its specs come back as equal objects."""
    key = (src, dst, name)
    text = _TEXTS.get(key)
    if text is None:
        if len(_TEXTS) > 64:
            _TEXTS.clear()
        text = _TEXTS[key] = module_text({SOURCE: src, TARGET: dst}, None, name, ((SOURCE, TARGET),))
    return text


def _runtime(layouts: str, machine: Machine, world: int, device: torch.device) -> tuple:
    """(Runtime, its module text) for moving between `layouts` (the text without its
    cluster): the one compiled before when its proven peak fits what `machine` has now
    (the proof holds for any GPU with room for its peak), else a new one for `machine`."""
    from nereus.ir import parse_source
    from nereus.runtime import Runtime

    key = (layouts, world, str(device))
    found = _RUNTIMES.get(key)
    if found is not None:
        peak = _summary(found[1], found[2])["peak_memory"]["bytes"]
        if peak <= machine.mem_bytes and found[0].host_mem_bytes <= machine.host_mem_bytes:
            found[1].reset(SOURCE)  # its proven peak fits what the GPUs have now
            return found[1], found[2]
    text = cluster_text(machine) + "\n" + layouts
    module = parse_source(text, "<reshard_module>")
    rt = Runtime(module, SOURCE, device=device, ahead="off", prover="inline")
    if found is not None:
        found[1].close()
    _RUNTIMES[key] = (machine, rt, text)
    return rt, text


def _register(rt, layout: ModuleLayout, groups, model, optim, rank: int) -> set:
    """Register this rank's source shards; the storages they live in (a shard the
    program keeps in place comes back as the same tensor: what the destination keeps of
    it must be a copy, or training it would write into the source)."""
    storages = set()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    by_name = layout.by_name()
    for group_model, _, states, names in groups:
        local = {}
        for name in names:
            tensor = params[name] if by_name[name].kind == PARAM else buffers[name]
            if not rank_boxes(by_name[name], rank):
                continue
            local[f"{group_model}/{name}"] = _contiguous(local_of(tensor).detach())
            for state in states:
                local[f"{group_model}/{name}#{state}"] = _contiguous(local_of(optim.state[tensor][state]).detach())
        storages.update(t.untyped_storage().data_ptr() for t in local.values())
        rt.register(f"{group_model}.training", local)
    return storages


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _materialize(dst_model, dst_optim, src_model, src_optim, rt, layout: ModuleLayout, groups, scalars,
                 device: torch.device, source_storages: set) -> None:
    """Step 4 of the module docstring, on this rank."""
    if any(p.is_meta for p in dst_model.parameters()) or any(b.is_meta for b in dst_model.buffers()):
        _to_empty(dst_model, dst_optim, device)
    params = dict(dst_model.named_parameters())
    buffers = dict(dst_model.named_buffers())
    by_name = layout.by_name()
    with torch.no_grad():
        for group_model, _, states, names in groups:
            new = rt.state(f"{group_model}.training")
            for name in names:
                tensor = params[name] if by_name[name].kind == PARAM else buffers[name]
                key = f"{group_model}/{name}"
                target = local_of(tensor)
                if key in new:
                    target.copy_(new.pop(key))
                if dst_optim is None or by_name[name].kind != PARAM:
                    continue
                state = {}
                for s in states:
                    local = new.pop(f"{key}#{s}", None)
                    if local is None:
                        local = torch.empty(target.shape, dtype=target.dtype, device=target.device)
                    elif local.untyped_storage().data_ptr() in source_storages:
                        local = local.clone()  # kept in place: the source's own tensor
                    state[s] = _like(tensor, local.to(target.device))
                for s, value in scalars.get(name, {}).items():
                    state[s] = value.clone() if isinstance(value, torch.Tensor) else value
                if state:
                    dst_optim.state[tensor] = state
        src_buffers = buffers_of(src_model)
        for name, buffer in buffers_of(dst_model).items():
            buffer.copy_(src_buffers[name].to(buffer.device))
    if dst_optim is not None:
        for src_group, dst_group in zip(src_optim.param_groups, dst_optim.param_groups):
            for key, value in src_group.items():
                if key != "params":
                    dst_group[key] = value


def _to_empty(model, optim, device: torch.device) -> None:
    """`model.to_empty(device)` keeping every parameter object (torch swaps the tensors in
    place instead of replacing a plain parameter by a new one), so that an optimizer built
    over the meta module still holds the module's parameters; if some parameter is
    replaced anyway, the optimizer's groups are pointed at the new ones by name."""
    names = {id(p): name for name, p in model.named_parameters()}
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    if optim is None:
        return
    now = dict(model.named_parameters())
    for group in optim.param_groups:
        group["params"] = [now[names[id(p)]] if id(p) in names else p for p in group["params"]]


def _like(param, local: torch.Tensor):
    """An optimizer state laid out as `param`: a DTensor of its mesh and placements."""
    if not is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _packed_scalars(src_model, src_optim) -> dict:
    """This rank's scalar optimizer states (the Adam step) by parameter, as they travel."""
    mine = optimizer_scalars(src_model, src_optim)
    return {name: {k: (v.item(), str(v.dtype), str(v.device)) if isinstance(v, torch.Tensor) else (v, None, None)
                   for k, v in states.items()} for name, states in mine.items()}


def _scalars(gathered: list) -> dict:
    """Every parameter's scalar states, from whichever rank has the parameter (a pipeline
    stage's ranks only have theirs)."""
    out: dict = {}
    for states in gathered:
        for name, values in states.items():
            if name not in out:
                out[name] = {k: (torch.tensor(v, dtype=getattr(torch, d.split(".")[1]), device=dev)
                                 if d is not None else v) for k, (v, d, dev) in values.items()}
    return out


def reshard_module(src_model, src_optim, dst_model, dst_optim, *, name: str = "module") -> ReshardReport:
    """Collective over the default group: move `src_model`'s parameters (and DTensor
    buffers) and `src_optim`'s state into `dst_model`'s layout and `dst_optim` (module
    docstring). `name` names the module in the `.nir` text (`report.nir`)."""
    if not dist.is_initialized():
        raise InteropError("reshard_module needs a torch.distributed process group",
                           hint="run under torchrun and call init_process_group first")
    called = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    group = _gloo()
    src = module_layout(src_model, src_optim, group, "source module")
    dst = module_layout(dst_model, None, group, "destination module")
    # one gather: each rank's verdict on the pair, its scalar states and its free memory
    error = None
    try:
        _check_pair(src, dst, src_model, dst_model, src_optim, dst_optim)
    except InteropError as caught:
        error = caught
    mine = (verdict(error), _packed_scalars(src_model, src_optim) if src_optim is not None else {},
            _free_bytes(device) + sum(_local_bytes(src_model, src_optim)))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    raise_first([g[0] for g in gathered])
    scalars = _scalars([g[1] for g in gathered])
    machine = _machine(min(g[2] for g in gathered), world)
    # the destination carries the source's optimizer states
    states = {t.name: t.states for t in src.tensors}
    dst = ModuleLayout(dst.world, tuple(replace(t, states=states[t.name]) for t in dst.tensors))
    layout_s = time.perf_counter() - called
    groups = model_groups(src, name)
    rt, text = _runtime(_layouts_text(src, dst, name), machine, world, device)
    source_storages = _register(rt, src, groups, src_model, src_optim, rank)
    report = rt.transition(TARGET)
    summary = _summary(rt, text)
    materialize_started = time.perf_counter()
    error = None
    try:
        _materialize(dst_model, dst_optim, src_model, src_optim, rt, src, groups, scalars, device, source_storages)
    except Exception as caught:  # every rank must learn of it: no rank may go on alone
        error = InteropError(f"filling the destination failed: {type(caught).__name__}: {caught}", rank=rank)
    finally:
        rt.reset(SOURCE)  # drop this call's tensors (the runtime keeps only what it compiled)
    agree_or_raise(error, group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    done = time.perf_counter()
    return ReshardReport(
        seconds=report.seconds, max_seconds=report.max_seconds, wall_s=done - called, layout_s=layout_s,
        compile_s=report.compile_s, materialize_s=done - materialize_started, bytes_sent=report.total_bytes_sent,
        bytes_copied=report.bytes_copied, lower_bound_bytes=summary["lower_bound_bytes"],
        peak_bytes=report.peak_bytes, predicted_peak_bytes=summary["peak_memory"]["bytes"],
        rounds=summary["rounds"], verified=rt.verify_programs, nir=text)


def _local_bytes(model, optim):
    for _, p in model.named_parameters():
        local = local_of(p)
        yield local.numel() * local.element_size()
        if optim is not None:
            for value in optim.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    v = local_of(value)
                    yield v.numel() * v.element_size()


_SUMMARIES: dict = {}


def _summary(rt, text: str) -> dict:
    """The compiler's summary of the transition (lower bound, rounds, proven peak), once
    per layout pair (every rank compiles the same program deterministically)."""
    found = _SUMMARIES.get(text)
    if found is None:
        from nereus.passes import compile_transition

        found = _SUMMARIES[text] = compile_transition(rt.module, SOURCE, TARGET).summary
    return found

