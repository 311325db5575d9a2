"""The embedding API (README, "Embedding the runtime"): training code hands its live tensors to
Nereus and changes plan in place.

    import nereus.runtime as nr
    rt = nr.Runtime.from_file("plan.nir", plan="S1")    # under torchrun: default group
    specs = rt.tensor_specs("actor.training")           # {name: (shape, torch dtype)}
    local = rt.shard_state_dict("actor.training", full)  # this rank's shards
    rt.register("actor.training", local)
    report = rt.transition("S2")                        # collective
    rt.state("actor.training")                          # this rank's new shards ({} if none)
    rt.gather_state_dict("actor.training")              # full tensors on every rank
    rt.shard_hf_checkpoint("actor.training")            # this rank's shards from hf("dir")
    rt.gather_hf_state_dict("actor.training")           # weights under transformers' names

Rank r drives GPU r of the plan's cluster. CUDA tensors move over the default group
(NCCL); CPU tensors over gloo. A separate gloo group with a timeout carries the control
messages (failure agreement, commit), so an error on one rank reaches every rank.
Compilation runs once per (source, target) on rank 0 and is broadcast, then cached;
rank 0 proves the program correct first (nereus.runtime.admission), so no rank runs an
unverified one unless `verify_programs=False`.

Rollback (`Runtime(..., rollback=)`): a transition is all or nothing, so the old shards
must survive until every rank commits. "auto" (the default for CUDA tensors): an old
shard the program frees stays on its GPU until the commit wherever the compiler's memory
replay (plus what the device really has free) leaves room for it; only the shards that
must leave for later rounds to fit are copied to pinned host memory, on a side stream
that overlaps the next rounds' transfers. On a GPU with room a transition therefore
copies nothing to the host and runs at link speed. "host": every freed (or staged-out)
old shard is parked that way, so GPU memory follows the replay exactly. A parked shard's
registry entry points at the host copy until the transition ends; the runtime holds no
other device reference to it. On abort the host copies go back to the device and into
the registry: `state()` then returns the restored tensors, which are new tensor objects;
on commit the host copies are dropped and the old shards kept on the device are released
with the registry's old entries. Tensors the caller still references itself (from
`shard_state_dict`, `state()`, its model or optimizer) keep their device memory alive:
drop them before `transition()` to get the room. "device" (the default on CPU, where a
host copy gains nothing): every old tensor stays on its device until the commit, so a
GPU holds old + new during the transition, more than the compiler's replay.

Preparing (`rt.prepare(target)`, collective): compiles and lowers the program, compiles
the pack kernels for its message shapes, opens the links to every peer and pins the host
blocks parking will use, so a `transition(target)` right after runs at warm speed.
`TransitionReport.seconds` runs from the call (after compiling) to the commit, which
comes after every rank synchronized its device: the new state is usable then.
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
    seconds: float  # this rank, from the call to the commit (device synchronized), compile excluded
    compile_s: float  # this call's compile (0 when the program was cached, e.g. by prepare)
    max_seconds: float  # slowest rank
    bytes_sent: int  # this rank
    bytes_received: int
    bytes_copied: int
    bytes_kept: int
    total_bytes_sent: int  # all ranks
    peak_bytes: int
    rounds: list = field(default_factory=list)  # per-round timings of this rank
    verified: Optional[bool] = None
    pack_backend: str = "torch"  # the pack/unpack path this call ran: "torch" or "triton" (CUDA only)
    rollback: str = "device"  # where the old shards waited for the commit ("auto" | "host" | "device")
    parked_bytes: int = 0  # old shards this rank copied to host memory and released on the device
    held_bytes: int = 0  # old shards the program freed that stayed on this device until the commit (auto)
    wall_s: float = 0.0  # this rank, the whole call: compile (if not cached) + seconds + the report's reductions
    prepared: bool = False  # prepare(target) had run for this (source, target) pair
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
                 rollback: Optional[str] = None, park_device_types=("cuda",), p2p_groups: Optional[int] = None,
                 verify_programs: bool = True):
        """rollback: "auto", "host" or "device" (see the module docstring); None picks
        "auto" for CUDA tensors and "device" otherwise. park_device_types: the device types whose
        old shards take the host path; tests pass ("cpu",) to run it on CPU. p2p_groups:
        data communicators a round's point-to-point ops are spread over (NCCL runs the
        ops of one communicator one after the other; several overlap that); default
        NEREUS_P2P_GROUPS, else 4 on NCCL and 1 otherwise. verify_programs: prove every
        compiled program correct before running it (nereus.runtime.admission); False for
        programs verified ahead of time."""
        if rollback is not None and rollback not in ROLLBACK_MODES:
            raise NereusError(f"unknown rollback mode {rollback!r}",
                              hint="rollback='auto' (default on CUDA), 'host' (old shards wait in host memory) or 'device'")
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
        if self._data is None:  # NCCL: several communicators (see prepare.data_groups)
            from .prepare import data_groups

            self._data = data_groups(self.device, timeout_s, p2p_groups)
        _plan(module, plan)
        self._plan = plan
        self._state: dict = {}  # model-stage → {name: local tensor}
        self._programs: dict = {}
        self._lowered: dict = {}  # (from, to, live model-stages) -> this rank's program
        self._prepared: set = set()
        self._registrations = 0  # changes of this rank's registered model-stages (see _live_stages)
        self._gathered = None  # (registrations summed over ranks, every rank's registered model-stages)  # (from, to, live model-stages) that prepare() warmed
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
        self._registrations += 1

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
        local = shard_checkpoint(model, ms, unit_on_gpu(self.layout(model_stage), self.rank), self.rank, directory)
        return {name: tensor.to(self.device) for name, tensor in local.items()}

    def gather_hf_state_dict(self, model_stage: str) -> dict:
        """Collective: the weights of `model_stage` under transformers' names, full, on
        every rank (for checks and export)."""
        from .hf_checkpoint import gather_hf

        ms = self._model_stage(model_stage)
        return gather_hf(self.module.model(ms.model), self.layout(model_stage), self.rank,
                         self._state.get(model_stage, {}), group=self._control)

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

    def prepare(self, target: str) -> dict:
        """Collective: do now everything `transition(target)` would do before moving a
        byte (compile, lower this rank's program, compile the pack kernels for its message
        shapes, open the links to its peers, pin the host blocks parking would use), so
        the transition right after runs at warm speed. Registered tensors are neither
        read nor written. Returns this rank's figures: seconds, compile_s, kernels,
        peers, pinned_bytes."""
        from .parking import park_plan, real_room
        from .prepare import warm_kernels, warm_links, warm_parking

        started = time.perf_counter()
        program, compile_s, prog, key = self._lower(target)
        kernels = warm_kernels(prog, self.device, TORCH_DTYPES)
        peers = warm_links(prog, self._data, self.device)
        pinned = 0
        if self.rollback != "device" and self.device.type in self.park_device_types:
            units = None
            if self.rollback == "auto":
                units = park_plan(prog, self._resident(program), self._capacity(program), real_room(self.device))
            pinned = warm_parking(prog, units, TORCH_DTYPES)
        self._prepared.add(key)
        return {"seconds": time.perf_counter() - started, "compile_s": compile_s, "kernels": kernels,
                "peers": peers, "pinned_bytes": pinned}

    def transition(self, target: str, *, verify: Optional[bool] = None, fault=None,
                   round_hook=None) -> TransitionReport:
        """Collective: move every registered model-stage from the current plan to
        `target`. All or nothing: on failure every rank raises TransitionAborted and
        keeps its old state (restored from host memory where it was parked).
        `round_hook(index)` runs on this rank after each round (tests, instrumentation).
        Returns this rank's TransitionReport; its `seconds` end at the commit, after every
        rank synchronized its device (the new state is usable)."""
        called = time.perf_counter()
        program, compile_s, prog, key = self._lower(target)
        started = called + compile_s  # compiling is reported apart (compile_s, 0 when cached)
        live = set(key[2])
        # the registry dicts themselves: where a freed shard is parked, the executor swaps
        # its entry for the host copy (no device reference left here) and back on abort
        before = {unit: self._state[prog.unit_stage[("before", unit)]] for unit in prog.before}
        result = execute(prog, before, group=self._data, control=self._control, device=self.device,
                         resident_bytes=self._resident(program),
                         verify=self.verify if verify is None else verify, progress=self.progress, fault=fault,
                         rollback=self.rollback, park_device_types=self.park_device_types, round_hook=round_hook,
                         capacity_bytes=self._capacity(program))
        del before
        steps = self._steps(live)
        keys = set(self._state)
        for ms in sorted(live):
            unit = unit_of_stage(result.state, prog.unit_stage, "after", ms)
            new = dict(result.state.get(unit, {})) if unit is not None else {}
            model = ModelStage.parse(ms).model
            if new and steps.get(ms, -1) >= 0:
                new[step_name(model)] = torch.tensor(steps[ms], dtype=torch.int64)
            self._state[ms] = new
        if set(self._state) != keys:  # a rank that held nothing of a model-stage now does
            self._registrations += 1
        self._plan = target
        seconds = time.perf_counter() - started  # the commit was the executor's last step
        # one collective for the slowest rank's seconds and the total bytes sent
        parts = [torch.zeros(2, dtype=torch.float64) for _ in range(self.world_size)]
        dist.all_gather(parts, torch.tensor([seconds, float(result.sent_bytes)], dtype=torch.float64),
                        group=self._control)
        gathered = torch.stack(parts)
        figures, maxed = gathered.sum(0), gathered.max(0).values
        return TransitionReport(
            source=prog.source, target=target, rank=self.rank, seconds=seconds, compile_s=compile_s,
            max_seconds=float(maxed[0]), bytes_sent=result.sent_bytes, bytes_received=result.received_bytes,
            bytes_copied=result.copied_bytes, bytes_kept=result.kept_bytes, total_bytes_sent=int(figures[1]),
            peak_bytes=result.peak_bytes, rounds=[asdict(r) for r in result.rounds], verified=result.verified,
            rollback=result.rollback, parked_bytes=result.parked_bytes, held_bytes=result.held_bytes,
            wall_s=time.perf_counter() - called, prepared=key in self._prepared,
            pack_backend=packing.backend_for(self.device),
            verify_program_s=self._verify_program_s.pop((prog.source, target), 0.0 if self.verify_programs else None))

    def _lower(self, target: str) -> tuple:
        """Collective: (program restricted to the live model-stages, compile seconds of
        this call (0 when cached), this rank's lowered program, its cache key)."""
        _plan(self.module, target)
        self._check_ranks(target)
        cached = (self._plan, target) in self._programs
        program, compile_s = self.compile(target)
        if cached:
            compile_s = 0.0
        live = self._live_stages(program)
        if live != program_model_stages(program):
            program = restrict_program(program, live)
        key = (self._plan, target, tuple(sorted(live)))
        if key not in self._lowered:  # a job moving back and forth lowers each program once
            self._lowered[key] = (program, rank_program(program, self.rank, self.direct_min_bytes))
        program, prog = self._lowered[key]
        return program, compile_s, prog, key

    def _resident(self, program: dict) -> int:
        return int(program.get("resident_bytes", {}).get(str(self.rank), 0))

    def _capacity(self, program: dict) -> Optional[int]:
        """This GPU's capacity in the program (bytes the verifier allows), None if absent."""
        for gpu in program.get("gpus", ()):
            if gpu.get("id") == self.rank:
                return int(gpu.get("capacity_bytes", gpu.get("mem_bytes")))
        return None

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
        same NereusError on every rank when a holder of a live model-stage did not. The
        ranks' registered sets are gathered only when some rank registered since the last
        gather (one small all_reduce of the ranks' registration counts tells)."""
        count = torch.tensor([self._registrations], dtype=torch.int64)
        dist.all_reduce(count, group=self._control)
        if self._gathered is None or self._gathered[0] != int(count):
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, sorted(self._state), group=self._control)
            self._gathered = (int(count), gathered)
        gathered = self._gathered[1]
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
        plan = module.plan(name)
    except KeyError:
        raise SemanticError(f"unknown plan {name!r}", hint=f"plans: {', '.join(p.name for p in module.plans)}") from None
    for p in plan.placements:
        # the compiler lays out and verifies zero 1/3, but this executor's shard contract
        # (whole optimizer state per unit) has not been run on them: refuse, don't guess
        if p.zero:
            raise SemanticError(f"plan {name}: {p.model_stage} has zero {p.zero}, which the runtime does not "
                                "execute yet", p.loc, hint="use zero 0 (the default) in plans the runtime runs; "
                                                           "nereusc compiles and verifies zero layouts")
