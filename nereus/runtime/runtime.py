"""The embedding API (DESIGN.md, "Embedding"): training code hands its live tensors to
Nereus and changes plan in place.

    import nereus.runtime as nr
    rt = nr.Runtime.from_file("plan.nir", plan="S1")    # under torchrun: default group
    specs = rt.tensor_specs("actor.training")           # {name: (shape, torch dtype)}
    local = rt.shard_state_dict("actor.training", full)  # this rank's shards
    rt.register("actor.training", local)
    report = rt.transition("S2")                        # collective
    rt.state("actor.training")                          # this rank's new shards ({} if none)
    rt.gather_state_dict("actor.training")              # full tensors on every rank

Rank r drives GPU r of the plan's cluster. CUDA tensors move over the default group
(NCCL); CPU tensors over gloo. A separate gloo group with a timeout carries the control
messages (failure agreement, commit), so an error on one rank reaches every rank.
Compilation runs once per (source, target) on rank 0 and is broadcast, then cached;
rank 0 proves the program correct first (nereus.runtime.admission), so no rank runs an
unverified one unless `verify_programs=False`.

Rollback (`Runtime(..., rollback=)`): a transition is all or nothing, so the old shards
must survive until every rank commits. "host" (the default for CUDA tensors): each old
shard the program frees (or stages out) is first copied to pinned host memory, then the
runtime drops every device reference it holds to it, its registry entry included (which
points at the host copy until the transition ends), so the caching allocator reuses the
memory for later rounds and GPU memory follows the compiler's replay. On abort the host
copies go back to the device and into the registry: `state()` then returns the restored
tensors, which are new tensor objects; on commit the host copies are dropped. Tensors the
caller still references itself (from `shard_state_dict`, `state()`, its model or
optimizer) keep their device memory alive: drop them before `transition()` to get the
room. "device" (the default on CPU, where a host copy gains nothing): the old tensors stay
on their device until the commit, so a GPU holds old + new during the transition, more
than the compiler's replay, and a full GPU may run out of memory.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from nereus.models import OPTIMIZER_DTYPE, OPTIMIZER_STATES, optimizer_name, tensor_table
from nereus.ir.diagnostics import NereusError, ProgramError, SemanticError
from nereus.ir.model import ModelStage, Module

from . import packing
from .admission import verify_before_running
from .boxes import as_box, shard_shape
from .executor import TORCH_DTYPES, execute
from .parking import ROLLBACK_MODES, default_rollback
from .program import DIRECT_MIN_BYTES, program_model_stages, rank_program, restrict_program, unit_of_stage
from .state import assemble, shard_unit, step_name, unit_on_gpu


@dataclass
class TransitionReport:
    """What one rank measured in one transition (global figures are summed/maxed over ranks)."""

    source: str
    target: str
    rank: int
    seconds: float  # this rank, compile excluded
    compile_s: float
    max_seconds: float  # slowest rank
    bytes_sent: int  # this rank
    bytes_received: int
    bytes_copied: int
    bytes_kept: int
    total_bytes_sent: int  # all ranks
    peak_bytes: int
    rounds: list = field(default_factory=list)  # per-round timings of this rank
    verified: Optional[bool] = None
    pack_backend: str = packing.BACKEND
    rollback: str = "device"  # where the old shards waited for the commit ("host" | "device")
    parked_bytes: int = 0  # old shards this rank copied to host memory and released on the device
    # seconds rank 0 spent proving the program before this transition (0.0 when proven by an
    # earlier one: cached per (from, to); None with verify_programs=False)
    verify_program_s: Optional[float] = None

    def to_json(self) -> dict:
        return asdict(self)


class Runtime:
    """Live state of this rank's model-stages and the transitions between plans."""

    def __init__(self, module: Module, plan: str, *, rank: Optional[int] = None, world_size: Optional[int] = None,
                 device: Optional[torch.device] = None, verify: bool = False, progress: bool = False,
                 timeout_s: float = 120.0, direct_min_bytes: int = DIRECT_MIN_BYTES,
                 rollback: Optional[str] = None, park_device_types=("cuda",), verify_programs: bool = True):
        """rollback: "host" or "device" (see the module docstring); None picks "host"
        for CUDA tensors and "device" otherwise. park_device_types: the device types whose
        old shards take the host path; tests pass ("cpu",) to run it on CPU.
        verify_programs: prove every compiled program correct before running it
        (nereus.runtime.admission); False for programs verified ahead of time."""
        if rollback is not None and rollback not in ROLLBACK_MODES:
            raise NereusError(f"unknown rollback mode {rollback!r}",
                              hint="rollback='host' (old shards wait in host memory) or 'device'")
        if not isinstance(module, Module):
            raise TypeError("Runtime needs a parsed nereus.ir.Module (use Runtime.from_file for a path)")
        self.module = module
        _plan(module, plan)
        if not dist.is_initialized():
            if rank is None or world_size is None:
                raise NereusError("no torch.distributed process group",
                                  hint="run under torchrun, call init_process_group first, or pass rank= and world_size=")
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if (rank is not None and rank != self.rank) or (world_size is not None and world_size != self.world_size):
            raise NereusError(f"rank/world_size {rank}/{world_size} disagree with the process group's "
                              f"{self.rank}/{self.world_size}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
                else torch.device("cpu")
        self.device = torch.device(device)
        self.rollback = default_rollback(self.device) if rollback is None else rollback
        self.park_device_types = tuple(park_device_types)
        self.verify = verify
        self.verify_programs = verify_programs
        self._verify_program_s: dict = {}  # (from, to) -> seconds rank 0 took to prove it
        self.direct_min_bytes = direct_min_bytes
        self.progress = progress
        self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        if self.device.type == "cuda" or dist.get_backend() == "gloo":
            self._data = None  # the default group
        else:
            self._data = self._control
        self._plan = plan
        self._state: dict = {}  # model-stage → {name: local tensor}
        self._programs: dict = {}
        self._lowered: dict = {}  # (from, to, live model-stages) -> this rank's program
        self._check_ranks(plan)

    @classmethod
    def from_file(cls, path: Optional[str] = None, plan: Optional[str] = None, *, module: Optional[Module] = None,
                  overrides: tuple = (), **options) -> "Runtime":
        """Parse `path` (or take `module=`) and start in `plan`; options as for Runtime()."""
        import nereus.ir as ir

        if module is None:
            if path is None:
                raise NereusError("Runtime.from_file needs a path or module=")
            module = ir.parse_file(path)
        if overrides:
            module = ir.apply_overrides(module, list(overrides))
        if plan is None:
            raise NereusError("Runtime.from_file needs plan=", hint=f"one of {[p.name for p in module.plans]}")
        return cls(module, plan, **options)

    @property
    def plan(self) -> str:
        """The plan the live state is laid out in."""
        return self._plan

    # -- layouts and state -------------------------------------------------------------

    def layout(self, model_stage: str, plan: Optional[str] = None) -> list:
        """UNIT dicts (JSON program v1) of `model_stage` in `plan` (default: the current one)."""
        from nereus.backends.json_program import plan_units_json

        self._model_stage(model_stage)
        return plan_units_json(self.module, plan or self._plan, model_stage)

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
        unit = unit_on_gpu(self.layout(model_stage), self.rank)
        if unit is None:
            return {}
        local = shard_unit(unit, self.rank, full, device=self.device)
        step = step_name(ms.model)
        if ms.stage == "training" and step in full:
            local[step] = torch.as_tensor(full[step], dtype=torch.int64).clone()
        return local

    def register(self, model_stage: str, local: dict) -> None:
        """Hand this rank's shards of `model_stage` to Nereus (checked against the layout)."""
        ms = self._model_stage(model_stage)
        unit = unit_on_gpu(self.layout(model_stage), self.rank)
        expected = {} if unit is None else {s["tensor"]: s for s in unit["shards"] if s["gpu"] == self.rank}
        step = step_name(ms.model)
        missing = sorted(set(expected) - set(local))
        extra = sorted(set(local) - set(expected) - {step})
        if missing or extra:
            raise NereusError(f"{model_stage} on rank {self.rank}: missing {missing[:3]}, unexpected {extra[:3]}",
                              hint="build the dict with shard_state_dict(model_stage, full)")
        for name, shard in expected.items():
            shape = shard_shape([as_box(b) for b in shard["boxes"]])
            if tuple(local[name].shape) != shape:
                raise NereusError(f"{name}: local shape {tuple(local[name].shape)}, the layout says {shape}")
            if not local[name].is_contiguous():
                raise NereusError(f"{name}: the local tensor is not contiguous",
                                  hint="register contiguous tensors (transitions send and receive them in place)")
        self._state[str(ms)] = dict(local)

    def state(self, model_stage: str) -> dict:
        """This rank's shards of `model_stage` in the current plan ({} if it holds none)."""
        self._model_stage(model_stage)
        return dict(self._state.get(model_stage, {}))

    def gather_state_dict(self, model_stage: str) -> dict:
        """Collective: the full tensors of `model_stage` on every rank (for checks)."""
        ms = self._model_stage(model_stage)
        specs = self.tensor_specs(model_stage)
        step = step_name(ms.model)
        local = self._state.get(model_stage, {})
        out = assemble(self.layout(model_stage), self.rank, local, specs, group=self._control)
        if step in specs:
            value = torch.tensor([int(local[step]) if step in local else -1], dtype=torch.int64)
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._control)
            if int(value) >= 0:
                out[step] = value[0].clone()
        return out

    # -- transitions -------------------------------------------------------------------

    def compile(self, target: str) -> tuple[dict, float]:
        """Collective: the JSON program from the current plan to `target` (rank 0
        compiles, every rank receives the same dict), cached; and the compile seconds."""
        key = (self._plan, target)
        if key not in self._programs:
            started = time.perf_counter()
            box: list = [None]
            if self.rank == 0:
                try:
                    from nereus.passes import compile_transition
                    from nereus.backends.json_program import program_json

                    program = program_json(compile_transition(self.module, self._plan, target))
                    proof_s = verify_before_running(program, self.module) if self.verify_programs else None
                    box[0] = ("ok", program, proof_s)
                except NereusError as error:
                    box[0] = ("error", type(error)(error.message, loc=error.loc, hint=error.hint))
                except Exception as error:  # noqa: BLE001 - the other ranks wait on the broadcast
                    box[0] = ("error", ProgramError(f"compiling {self._plan} -> {target} failed: "
                                                    f"{type(error).__name__}: {error}"))
            dist.broadcast_object_list(box, src=0, group=self._control)
            if box[0][0] == "error":
                raise box[0][1]
            self._verify_program_s[key] = box[0][2]
            self._programs[key] = (box[0][1], time.perf_counter() - started)
        return self._programs[key]

    def transition(self, target: str, *, verify: Optional[bool] = None, fault=None,
                   round_hook=None) -> TransitionReport:
        """Collective: move every registered model-stage from the current plan to
        `target`. All or nothing: on failure every rank raises TransitionAborted and
        keeps its old state (restored from host memory with rollback="host").
        `round_hook(index)` runs on this rank after each round (tests, instrumentation).
        Returns this rank's TransitionReport."""
        _plan(self.module, target)
        self._check_ranks(target)
        program, compile_s = self.compile(target)
        live = self._live_stages(program)
        if live != program_model_stages(program):
            program = restrict_program(program, live)
        key = (self._plan, target, tuple(sorted(live)))
        if key not in self._lowered:  # a job moving back and forth lowers each program once
            self._lowered[key] = rank_program(program, self.rank, self.direct_min_bytes)
        prog = self._lowered[key]
        # the registry dicts themselves: with rollback="host" the executor swaps a freed
        # shard's entry for its host copy (no device reference left here) and back on abort
        before = {unit: self._state[prog.unit_stage[("before", unit)]] for unit in prog.before}
        result = execute(prog, before, group=self._data, control=self._control, device=self.device,
                         resident_bytes=int(program.get("resident_bytes", {}).get(str(self.rank), 0)),
                         verify=self.verify if verify is None else verify, progress=self.progress, fault=fault,
                         rollback=self.rollback, park_device_types=self.park_device_types, round_hook=round_hook)
        del before
        steps = self._steps(live)
        for ms in sorted(live):
            unit = unit_of_stage(result.state, prog.unit_stage, "after", ms)
            new = dict(result.state.get(unit, {})) if unit is not None else {}
            model = ModelStage.parse(ms).model
            if new and steps.get(ms, -1) >= 0:
                new[step_name(model)] = torch.tensor(steps[ms], dtype=torch.int64)
            self._state[ms] = new
        self._plan = target
        figures = torch.tensor([result.seconds, float(result.sent_bytes)], dtype=torch.float64)
        maxed = figures.clone()
        dist.all_reduce(figures, op=dist.ReduceOp.SUM, group=self._control)
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=self._control)
        return TransitionReport(
            source=prog.source, target=target, rank=self.rank, seconds=result.seconds, compile_s=compile_s,
            max_seconds=float(maxed[0]), bytes_sent=result.sent_bytes, bytes_received=result.received_bytes,
            bytes_copied=result.copied_bytes, bytes_kept=result.kept_bytes, total_bytes_sent=int(figures[1]),
            peak_bytes=result.peak_bytes, rounds=[asdict(r) for r in result.rounds], verified=result.verified,
            rollback=result.rollback, parked_bytes=result.parked_bytes,
            verify_program_s=self._verify_program_s.pop((prog.source, target), 0.0 if self.verify_programs else None))

    # -- helpers -----------------------------------------------------------------------

    def _model_stage(self, model_stage: str) -> ModelStage:
        ms = ModelStage.parse(model_stage)
        if ms not in set(self.module.workload.model_stages()):
            known = ", ".join(str(m) for m in self.module.workload.model_stages())
            raise SemanticError(f"unknown model-stage {model_stage!r}", hint=f"the workload has {known}")
        return ms

    def _check_ranks(self, plan: str) -> None:
        for placement in self.module.plan(plan).placements:
            if max(placement.gpus) >= self.world_size:
                raise SemanticError(f"plan {plan} places {placement.model_stage} on GPU {max(placement.gpus)}, "
                                    f"but only {self.world_size} ranks run (rank r drives GPU r)",
                                    loc=placement.loc, hint="launch one process per GPU of the plan")

    def _live_stages(self, program: dict) -> set:
        """Collective: the model-stages of `program` that some rank registered. Raises the
        same NereusError on every rank when a holder of a live model-stage did not."""
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, sorted(self._state), group=self._control)
        registered = set().union(*map(set, gathered))
        live = program_model_stages(program) & registered
        for unit in program["units"]["before"]:
            if unit["model_stage"] in live:
                for gpu in unit["gpus"]:
                    if unit["model_stage"] not in gathered[gpu]:
                        raise NereusError(f"rank {gpu} holds {unit['id']} but did not register {unit['model_stage']}",
                                          hint="every rank of a model-stage must call register() before transition()")
        return live

    def _steps(self, live: set) -> dict:
        """Collective: the Adam step of each live training model-stage (max over holders)."""
        names = sorted(ms for ms in live if ms.endswith(".training"))
        if not names:
            return {}
        values = []
        for ms in names:
            local = self._state.get(ms, {})
            key = step_name(ModelStage.parse(ms).model)
            values.append(int(local[key]) if key in local else -1)
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._control)
        return dict(zip(names, tensor.tolist()))


def tensor_specs(module: Module, model_stage: str) -> dict:
    """`Runtime.tensor_specs` without a Runtime (no process group needed)."""
    ms = ModelStage.parse(model_stage)
    model = module.model(ms.model)
    specs = {}
    for spec in tensor_table(model):
        name = f"{model.name}/{spec.name}"
        specs[name] = (spec.shape, TORCH_DTYPES[spec.dtype])
        if ms.stage == "training":
            for s in OPTIMIZER_STATES:
                specs[optimizer_name(name, s)] = (spec.shape, TORCH_DTYPES[OPTIMIZER_DTYPE])
    if ms.stage == "training":
        specs[step_name(model.name)] = ((), torch.int64)
    return specs


def _plan(module: Module, name: str) -> None:
    try:
        module.plan(name)
    except KeyError:
        raise SemanticError(f"unknown plan {name!r}", hint=f"plans: {', '.join(p.name for p in module.plans)}") from None
