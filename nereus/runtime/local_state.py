"""The state half of the embedding API (`Runtime` inherits it): layouts, tensor specs,
this rank's shards of a full state dict, registration, where each shard is kept, and the
gathers that check or export the state. Input: the module, the current plan, this rank
and the registry of live shards (`_state`: model-stage -> {name: local tensor}), all
held by the Runtime (nereus.runtime.runtime). Invariant: nothing here moves state between
plans; a registered shard matches its layout's shape and dtype and is contiguous.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import NereusError, SemanticError
from nereus.ir.model import ModelStage, Module


from . import offload
from .boxes import as_box, shard_shape
from .control import gather_flagged
from .executor import TORCH_DTYPES
from .state import assemble, shard_unit, step_name, unit_on_gpu


class LocalState:
    """This rank's registered shards and their layouts (a Runtime's state methods: the
    Runtime sets `module`, `rank`, `device`, `_plan`, `_state`, `_registrations` and
    `_control`)."""

    def layout(self, model_stage: str, plan: Optional[str] = None) -> list:
        """UNIT dicts (JSON program v1) of `model_stage` in `plan` (default: the current one)."""
        from nereus.backends.json_program import plan_units_json

        self._model_stage(model_stage)
        return plan_units_json(self.module, plan or self._plan, model_stage)

    def _layout(self, model_stage: str) -> list:
        """`layout(model_stage)` in the current plan, computed once per (plan, model-stage):
        for this class's own reading (registering the same model-stage again, as
        nereus.interop does every call, then costs no layout); callers never see it."""
        cache = self.__dict__.setdefault("_layouts", {})
        key = (self._plan, model_stage)
        if key not in cache:
            cache[key] = self.layout(model_stage)
        return cache[key]

    def tensor_specs(self, model_stage: str) -> dict:
        """{global name: (shape, torch dtype)} of the full tensors of `model_stage`:
        weights, and for training fp32 master/exp_avg/exp_avg_sq plus the int64 step."""
        self._model_stage(model_stage)
        return tensor_specs(self.module, model_stage)

    def shard_state_dict(self, model_stage: str, full: dict) -> dict:
        """This rank's shards of a full state dict (global names; a name without its
        `{model}/` prefix is accepted too). {} when this rank holds no unit of it."""
        ms = self._model_stage(model_stage)
        full = {k if "/" in k else f"{ms.model}/{k}": v for k, v in full.items()}
        unit = unit_on_gpu(self._layout(model_stage), self.rank)
        if unit is None:
            return {}
        specs = self.tensor_specs(model_stage)
        for name in self._own_shards(unit):
            tensor = full.get(name)
            if tensor is None:
                continue  # shard_unit names it
            shape, dtype = specs[name]
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise NereusError(f"{name}: the full tensor is {list(tensor.shape)} {_dtype(tensor.dtype)}, "
                                  f"{ms.model} needs {list(shape)} {_dtype(dtype)}",
                                  hint="tensor_specs(model_stage) gives every full tensor's shape and dtype "
                                       "(convert with .to(dtype))")
        if unit.get("offload", False):  # kept in (pinned) host memory outside its stage
            local = {name: offload.to_host(t, self.device) for name, t in shard_unit(unit, self.rank, full).items()}
        else:
            local = shard_unit(unit, self.rank, full, device=self.device)
        step = step_name(ms.model)
        if ms.stage == "training" and step in full:
            local[step] = _step(step, full[step])
        return local

    def register(self, model_stage: str, local: dict) -> None:
        """Hand this rank's shards of `model_stage` to Nereus (checked against the layout)."""
        ms = self._model_stage(model_stage)
        unit = unit_on_gpu(self._layout(model_stage), self.rank)
        expected = self._own_shards(unit)
        step = step_name(ms.model)
        missing = sorted(set(expected) - set(local))
        extra = sorted(set(local) - set(expected) - {step})
        if missing or extra:
            raise NereusError(f"{model_stage} on rank {self.rank}: missing {missing[:3]}, unexpected {extra[:3]}",
                              hint="build the dict with shard_state_dict(model_stage, full)")
        if step in local:
            if ms.stage != "training":
                raise NereusError(f"{step}: {model_stage} holds no optimizer state, so no Adam step",
                                  hint="register the step with the .training model-stage")
            local = {**local, step: _step(step, local[step])}
        specs = self.tensor_specs(model_stage)
        for name, shard in expected.items():
            shape = shard_shape([as_box(b) for b in shard["boxes"]])
            if tuple(local[name].shape) != shape:
                raise NereusError(f"{name}: local shape {tuple(local[name].shape)}, the layout says {shape}")
            if local[name].dtype != specs[name][1]:
                raise NereusError(f"{name}: the local tensor is {_dtype(local[name].dtype)}, the layout says "
                                  f"{_dtype(specs[name][1])}", hint="convert with .to(dtype) before register")
            if not local[name].is_contiguous():
                raise NereusError(f"{name}: the local tensor is not contiguous",
                                  hint="register contiguous tensors (transitions send and receive them in place)")
        local = dict(local)
        if unit is not None and unit.get("offload", False):  # the plan keeps it in host memory
            local.update({name: offload.to_host(local[name], self.device) for name in expected})
        self._state[str(ms)] = local
        self._registrations += 1

    def state(self, model_stage: str) -> dict:
        """This rank's shards of `model_stage` in the current plan ({} if it holds none)."""
        self._model_stage(model_stage)
        return dict(self._state.get(model_stage, {}))

    def placement(self, model_stage: str) -> dict:
        """{global name: "host" | "device"}: where this rank keeps each of its shards of
        `model_stage` ({} if it holds none). "host": (pinned, where CUDA exists) host memory,
        because the current plan flags the model-stage `offload`; "device": the runtime's
        device. The Adam step counter (a CPU scalar) is not listed."""
        self._model_stage(model_stage)
        unit = unit_on_gpu(self._layout(model_stage), self.rank)
        if unit is None:
            return {}
        where = offload.HOST if unit.get("offload", False) else offload.DEVICE
        return {name: where for name in self._own_shards(unit)}

    def _own_shards(self, unit: Optional[dict]) -> dict:
        """{tensor: shard} of `unit` (JSON layout) on this rank; {} for no unit."""
        return {} if unit is None else {s["tensor"]: s for s in unit["shards"] if s["gpu"] == self.rank}

    def device_bytes(self, model_stage: Optional[str] = None) -> int:
        """Bytes of this rank's registered shards (of `model_stage`, or of every registered
        model-stage) kept in device memory: offloaded shards count nothing, as in the
        compiler's memory model."""
        stages = [model_stage] if model_stage is not None else sorted(self._state)
        total = 0
        for ms in stages:
            held = self._state.get(ms, {})
            for name, where in self.placement(ms).items():
                if where == offload.DEVICE and name in held:
                    total += held[name].numel() * held[name].element_size()
        return total

    def _offloaded(self, model_stage: str) -> bool:
        """Whether the current plan keeps `model_stage` in host memory (`offload`)."""
        return any(str(p.model_stage) == model_stage and p.offload for p in self.module.plan(self._plan).placements)

    def device_state(self, model_stage: str) -> dict:
        """This rank's shards of `model_stage` where its own stage computes with them: the
        registered tensors, or, when the current plan offloads it, device copies of the
        host-held shards (host→device over PCIe, from pinned memory). Writes to such copies
        reach the state only through `write_back`."""
        state = self.state(model_stage)
        if not self._offloaded(model_stage):  # the common case, every step: no layout to build
            return dict(state)
        # copies also where host and device are one memory (CPU): the contract is the same
        moved = {name: state[name].to(self.device, non_blocking=True, copy=True)
                 for name, where in self.placement(model_stage).items() if where == offload.HOST and name in state}
        return {**state, **moved}

    def write_back(self, model_stage: str, local: dict) -> None:
        """Copy the shards of `local` (from `device_state`) into the host-held state of an
        offloaded `model_stage` (device→host); nothing to do for the others."""
        if not self._offloaded(model_stage):
            return
        state = self._state.get(model_stage, {})
        for name, where in self.placement(model_stage).items():
            if where == offload.HOST and name in local and local[name] is not state.get(name):
                state[name].copy_(local[name])

    def gather_state_dict(self, model_stage: str) -> dict:
        """Collective: the full tensors of `model_stage` on every rank (for checks)."""
        ms = self._model_stage(model_stage)
        specs = self.tensor_specs(model_stage)
        step = step_name(ms.model)
        local = self._state.get(model_stage, {})
        self._check_gather(model_stage, local)
        out = assemble(self.layout(model_stage), self.rank, local, specs, group=self._control)
        if step in specs:
            value = torch.tensor([int(local[step]) if step in local else -1], dtype=torch.int64)
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._control)
            if int(value) >= 0:
                out[step] = value[0].clone()
        return out

    def shard_hf_checkpoint(self, model_stage: str, path: Optional[str] = None) -> dict:
        """This rank's shards of `model_stage` read from a Hugging Face checkpoint directory
        (default: the model's `hf("...")` directory), only this rank's boxes; training
        stages get an fp32 master copy and zeroed Adam state. Ready for `register`; {} when
        this rank holds no unit of it. See nereus.runtime.hf_checkpoint."""
        from .hf_checkpoint import shard_checkpoint

        ms = self._model_stage(model_stage)
        model = self.module.model(ms.model)
        directory = path or model.checkpoint_dir
        if directory is None:
            raise NereusError(f"model {model.name} has no checkpoint", hint='declare it = hf("dir") or pass path=')
        unit = unit_on_gpu(self._layout(model_stage), self.rank)
        local = shard_checkpoint(model, ms, unit, self.rank, directory)
        if unit is not None and unit.get("offload", False):
            return {name: offload.to_host(tensor, self.device) for name, tensor in local.items()}
        return {name: tensor.to(self.device) for name, tensor in local.items()}

    def gather_hf_state_dict(self, model_stage: str) -> dict:
        """Collective: the weights of `model_stage` under transformers' names, full, on
        every rank (for checks and export)."""
        from .hf_checkpoint import gather_hf

        ms = self._model_stage(model_stage)
        self._check_gather(model_stage, self._state.get(model_stage, {}))
        return gather_hf(self.module.model(ms.model), self.layout(model_stage), self.rank,
                         self._state.get(model_stage, {}), group=self._control)

    def _check_gather(self, model_stage: str, local: dict) -> None:
        """Collective: the same NereusError on every rank when some rank holds shards of
        `model_stage` it has not registered (a gather would otherwise fail on those ranks
        alone and leave the others in a collective of their own)."""
        missing = len(set(self._own_shards(unit_on_gpu(self._layout(model_stage), self.rank))) - set(local))
        rows = gather_flagged(None, [missing], torch.int64, self._control, (self._plan, f"gather {model_stage}", "gather"))
        short = [rank for rank, row in enumerate(rows) if row[1]]
        if short:
            raise NereusError(f"gather of {model_stage}: rank{'s' if len(short) > 1 else ''} "
                              f"{', '.join(map(str, short))} hold{'' if len(short) > 1 else 's'} shards of it "
                              "but did not register them",
                              hint="register(model_stage, shards) on every rank that holds a unit of it first")

    def _model_stage(self, model_stage: str) -> ModelStage:
        ms = ModelStage.parse(model_stage)
        if ms not in set(self.module.workload.model_stages()):
            known = ", ".join(str(m) for m in self.module.workload.model_stages())
            raise SemanticError(f"unknown model-stage {model_stage!r}", hint=f"the workload has {known}")
        return ms


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _step(name: str, value) -> torch.Tensor:
    """An Adam step as a 0-d int64 tensor; an integer (Python or tensor) or an integral
    float, never a fraction or a bool."""
    tensor = torch.as_tensor(value)
    if tensor.dim() != 0 or tensor.dtype == torch.bool or tensor.is_complex() or \
            (tensor.is_floating_point() and float(tensor) != int(tensor)) or float(tensor) < 0:
        raise NereusError(f"{name}: an Adam step is a whole number ≥ 0, found {value!r}",
                          hint="e.g. torch.tensor(3) or 3")
    return tensor.to(torch.int64).clone()


def tensor_specs(module: Module, model_stage: str) -> dict:
    """`Runtime.tensor_specs` without a Runtime (no process group needed)."""
    from nereus.passes.layout import tensor_entries, unit_states

    ms = ModelStage.parse(model_stage)
    model = module.model(ms.model)
    specs = {name: (shape, TORCH_DTYPES[dtype])
             for name, shape, dtype in tensor_entries(model, unit_states(model, model_stage))}
    if ms.stage == "training" and not model.is_table:  # a tensors model's steps are its own
        specs[step_name(model.name)] = ((), torch.int64)
    return specs


def known_plan(module: Module, name: str) -> None:
    """SemanticError listing the plans unless `module` declares plan `name`."""
    try:  # zero 1/3 and ep > 1 run too: every placement the compiler accepts runs
        module.plan(name)
    except KeyError:
        raise SemanticError(f"unknown plan {name!r}", hint=f"plans: {', '.join(p.name for p in module.plans)}") from None
