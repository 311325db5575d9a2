"""The embedding API implemented the naive way: a transition gathers every full tensor
and re-shards it (an in-memory checkpoint/restart). It is the baseline the RL loop
compares Nereus against — same layouts at every step, so both runs must agree bit for
bit — and a stand-in runtime when `nereus.runtime.Runtime` is unavailable.

Same names and meaning as the runtime API's (docs/runtime.md): tensor_specs, shard_state_dict,
register, transition, state, gather_state_dict. Gathering is one world all-reduce per
tensor where only the first holder of each box writes it (x + 0 is exact in floating
point, so the sum reproduces every byte).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from nereus.models import (OPTIMIZER_DTYPE, OPTIMIZER_STATES, TensorSpec, optimizer_name, pp_layer_range,
                                    tensor_table)
from nereus.ir.model import Module, Placement

from .shards import local_boxes, shard, write_owned
from .zero import chunk_boxes, chunk_rows

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def global_specs(module: Module, model_stage: str) -> dict[str, TensorSpec]:
    """{global name: spec} of a model-stage, optimizer state (fp32) for training stages."""
    model_name, _, stage = model_stage.partition(".")
    out: dict[str, TensorSpec] = {}
    for spec in tensor_table(module.model(model_name)):
        out[f"{model_name}/{spec.name}"] = spec
        if stage == "training":
            for state in OPTIMIZER_STATES:
                out[optimizer_name(f"{model_name}/{spec.name}", state)] = TensorSpec(
                    spec.name, spec.shape, OPTIMIZER_DTYPE, spec.sharding, spec.layer, spec.parts, spec.role)
    return out


def _position(p: Placement, rank: int) -> Optional[tuple[int, int, int]]:
    """(replica, pp stage, tp rank) of `rank` in a placement, or None."""
    if rank not in p.gpus:
        return None
    index = p.gpus.index(rank)
    return index // (p.pp * p.tp), (index // p.tp) % p.pp, index % p.tp


def on_stage(spec: TensorSpec, layers: int, pp: int, stage: int) -> bool:
    """Whether pipeline stage `stage` holds `spec`: its layers, embed on the first stage,
    final norm and head on the last."""
    if spec.layer is not None:
        lo, hi = pp_layer_range(layers, pp, stage)
        return lo <= spec.layer < hi
    return stage == 0 if spec.role == "embed" else stage == pp - 1


def _chunked(p: Placement, name: str) -> bool:
    """Whether `name` is held as dp chunks in `p`: optimizer state under zero 1, every
    tensor under zero 3 (training placements only)."""
    return p.model_stage.stage == "training" and (p.zero >= 3 or p.zero >= 1 and "#" in name)


class RestartRuntime:
    """Gather-and-reshard runtime over the default process group (rank = GPU id)."""

    def __init__(self, module: Module, plan: str, device: Optional[torch.device] = None):
        self.module = module
        self.device = torch.device(device or "cpu")
        for p in (pl for candidate in module.plans for pl in candidate.placements):
            if p.ep > 1:  # its TP-only layout (nereus.rl.shards) would put every expert on every rank
                from nereus.ir.diagnostics import SemanticError

                raise SemanticError(f"the restart baseline does not lay out expert parallelism ({p.model_stage} "
                                    f"has ep {p.ep})", p.loc, hint="use the Nereus runtime (--runtime nereus)")
        self.plan = module.plan(plan)
        self._state: dict[str, dict[str, torch.Tensor]] = {}
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    @staticmethod
    def from_file(path: str, plan: str) -> "RestartRuntime":
        import nereus.ir as ir

        return RestartRuntime(ir.parse_file(path), plan)

    def tensor_specs(self, model_stage: str) -> dict[str, tuple[tuple[int, ...], str]]:
        return {n: (s.shape, s.dtype) for n, s in global_specs(self.module, model_stage).items()}

    def shard_state_dict(self, model_stage: str, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        placement = self.plan.placement(model_stage)
        where = _position(placement, self.rank)
        if where is None:
            return {}
        layers = self.module.model(placement.model_stage.model).layers
        out = {}
        for name, spec in global_specs(self.module, model_stage).items():
            if on_stage(spec, layers, placement.pp, where[1]):
                local = shard(full[name], spec, placement.tp, where[2])
                if _chunked(placement, name):  # zero 1: this replica's dp chunk of the optimizer state
                    lo, hi = chunk_rows(local.shape[0], placement.dp, where[0])
                    if hi <= lo:
                        continue
                    local = local[lo:hi].clone()
                out[name] = local.to(self.device)
        return out

    def shard_hf_checkpoint(self, model_stage: str, path: Optional[str] = None) -> dict[str, torch.Tensor]:
        """This rank's shards of `model_stage` read from a Hugging Face checkpoint directory
        (default: the model's `hf("...")` one), only this rank's boxes, as
        nereus.runtime.Runtime.shard_hf_checkpoint does (same reader, boxes from
        nereus.rl.shards)."""
        from nereus.ir.diagnostics import NereusError
        from nereus.runtime.hf_checkpoint import shard_checkpoint

        placement = self.plan.placement(model_stage)
        model = self.module.model(placement.model_stage.model)
        directory = path or model.checkpoint_dir
        if directory is None:
            raise NereusError(f"model {model.name} has no checkpoint", hint='declare it = hf("dir") or pass path=')
        where = _position(placement, self.rank)
        unit = None
        if where is not None:  # the unit of this rank in the JSON program's form: boxes per tensor
            shards = []
            for spec in tensor_table(model):
                if not on_stage(spec, model.layers, placement.pp, where[1]):
                    continue
                name, boxes = f"{model.name}/{spec.name}", local_boxes(spec, placement.tp, where[2])
                chunk = chunk_boxes(boxes, *chunk_rows(sum(b[0][1] - b[0][0] for b in boxes), placement.dp, where[0]))
                master = optimizer_name(name, OPTIMIZER_STATES[0])
                for tensor in (name, master) if placement.model_stage.stage == "training" else (name,):
                    mine = chunk if _chunked(placement, tensor) else boxes  # zero: a dp chunk
                    if mine:
                        shards.append({"tensor": tensor, "gpu": self.rank, "boxes": mine})
            unit = {"shards": shards}
        local = shard_checkpoint(model, placement.model_stage, unit, self.rank, directory)
        specs = global_specs(self.module, model_stage)  # no Adam step counter: this runtime keeps none
        return {name: tensor.to(self.device) for name, tensor in local.items() if name in specs}

    def register(self, model_stage: str, local: dict[str, torch.Tensor]) -> None:
        self._state[model_stage] = dict(local)

    def state(self, model_stage: str) -> dict[str, torch.Tensor]:
        return self._state.get(model_stage, {})

    def device_state(self, model_stage: str) -> dict[str, torch.Tensor]:
        """As Runtime.device_state; this baseline keeps every shard on its device (no offload)."""
        return self.state(model_stage)

    def write_back(self, model_stage: str, local: dict[str, torch.Tensor]) -> None:
        """As Runtime.write_back: nothing is held elsewhere, so nothing to copy."""

    def gather_state_dict(self, model_stage: str) -> dict[str, torch.Tensor]:
        """Full tensors on every rank; collective over the world."""
        placement = self.plan.placement(model_stage)
        where = _position(placement, self.rank)
        local = self.state(model_stage)
        out = {}
        for name, spec in global_specs(self.module, model_stage).items():
            full = torch.zeros(spec.shape, dtype=TORCH_DTYPES[spec.dtype], device=self.device)
            if where is not None and _chunked(placement, name):
                # every replica writes its chunk rows (zeros elsewhere): the sum is each byte once
                boxes = local_boxes(spec, placement.tp, where[2])
                rows = torch.zeros(sum(b[0][1] - b[0][0] for b in boxes), *[hi - lo for lo, hi in boxes[0][1:]],
                                   dtype=full.dtype, device=self.device)
                lo, hi = chunk_rows(rows.shape[0], placement.dp, where[0])
                if name in local:
                    rows[lo:hi] = local[name]
                write_owned(full, rows, spec, placement.tp, where[2])
            elif where is not None and where[0] == 0 and name in local:
                write_owned(full, local[name], spec, placement.tp, where[2])
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(full)
            out[name] = full
        return out

    def transition(self, plan: str) -> dict:
        """Move every model-stage to `plan` through full tensors. Collective."""
        start = time.perf_counter()
        fulls = {ms: self.gather_state_dict(ms) for ms in list(self._state)}
        moved = sum(t.numel() * t.element_size() for full in fulls.values() for t in full.values())
        source, self.plan = self.plan.name, self.module.plan(plan)
        for ms, full in fulls.items():
            self._state[ms] = self.shard_state_dict(ms, full)
        return {"from": source, "to": plan, "seconds": time.perf_counter() - start,
                "bytes": moved, "runtime": "restart"}
