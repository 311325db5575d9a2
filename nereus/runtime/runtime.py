"""The embedding API (docs/runtime.md): training code hands its live tensors to
Nereus and changes plan in place.

    import nereus.runtime as nr
    rt = nr.Runtime.from_file("plan.nir", plan="S1")    # under torchrun: default group
    specs = rt.tensor_specs("actor.training")           # {name: (shape, torch dtype)}
    local = rt.shard_state_dict("actor.training", full)  # this rank's shards
    rt.register("actor.training", local)
    report = rt.transition("S2")                        # collective
    rt.state("actor.training")                          # this rank's new shards ({} if none)
    rt.placement("ref.inference")                       # {name: "host" | "device"} (offload)
    rt.gather_state_dict("actor.training")              # full tensors on every rank
    rt.shard_hf_checkpoint("actor.training")            # this rank's shards from hf("dir")
    rt.gather_hf_state_dict("actor.training")           # weights under transformers' names

The state methods (layouts, `tensor_specs`, `shard_state_dict`, `register`, `state`,
`placement`, the gathers) are `LocalState`'s (nereus.runtime.local_state); this module
holds the construction and the transitions.

Rank r drives GPU r of the plan's cluster. CUDA tensors move over the default group
(NCCL); CPU tensors over gloo. A separate gloo group with a timeout carries the control
messages (failure agreement, commit), so an error on one rank reaches every rank.
Compilation runs once per (source, target) on every rank, each lowering only its own part
of the program (nereus.runtime.distribute: no rank receives or holds the whole program),
then cached; rank 0 proves the whole program correct first (nereus.runtime.admission) and
each rank checks its part's digest against the proven one, so no rank runs an unverified
part unless `verify_programs=False`. Either way every rank checks its own part before any
byte moves (nereus.runtime.part_check: its new shards written exactly once, its messages
what its peers expect), and a wrong part is refused on every rank.

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

Offload (nereus.runtime.offload): a model-stage the current plan flags `offload` is kept in
host memory (pinned where CUDA exists) at every step boundary, as the compiler's memory
model assumes: `shard_state_dict`/`register` put its shards there, a transition reads and
writes them there (bytes cross PCIe: `TransitionReport.offload_bytes`), and they count
nothing in `device_bytes()` or the transition's `peak_bytes`. `placement(ms)` says where
each shard is kept; `device_state(ms)` brings them to the device for the stage's own
work and `write_back(ms, local)` returns what that work changed.

Preparing (`rt.prepare(target)`, collective): compiles and lowers the program, compiles
the pack kernels for its message shapes, opens the links to every peer, pins the host
blocks parking will use and leaves device blocks of the sizes the transition allocates in
the caching allocator, so a `transition(target)` right after runs at warm speed. The
data communicators themselves are created and connected to every rank when the Runtime
is constructed (NCCL), not in the first transition.
`TransitionReport.seconds` runs from the call (after compiling) to the point where this
rank is ready to commit: every round done, its new state complete and its device
synchronized. `max_seconds` is the slowest rank's: the moment the last rank was ready,
after which the commit (one small collective on the control group, which also carries
these figures) makes the new state usable on every rank. `wall_s` covers the whole call.

Control messages per warm transition (cached program, nothing newly registered): one
agreement per round (executor), the first of which also gathers every rank's
registration count and Adam steps (a rank that registered since makes every rank start
over the full way, `_speculation`, before any byte moved), and the commit's all_gather
of [failure flag, seconds, bytes sent]. Otherwise (cold, or after a registration) one
all_gather of the counts and steps comes first (`_live_stages`; both in
nereus.runtime.live_parts, which Runtime inherits). Everything a call
derives from the program alone (the program restricted to the registered model-stages,
the lowered rank program, its resident and capacity bytes, its offloaded units) is
computed once per (source, target, registered model-stages) and cached.
"""

from __future__ import annotations

import functools
import json
import math
import time
import weakref
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import NereusError
from nereus.ir.model import ModelStage, Module
from nereus.backends.proof import runs_on

from . import lowerer, packing, prepare, replay
from .ahead import Ahead, ahead_mode, paused_all, steps as ahead_steps
from .control import Stale, agree
from .executor import TORCH_DTYPES, execute
from .gc_pause import paused
from .parking import ROLLBACK_MODES, default_rollback
from .program import DIRECT_MIN_BYTES, unit_of_stage
from .prover import Prover, prover_mode
from .live_parts import LiveParts
from .local_state import LocalState, known_plan, tensor_specs  # noqa: F401 - tensor_specs: the public import path
from .state import step_name


@dataclass
class TransitionReport:
    """What one rank measured in one transition (global figures are summed/maxed over ranks)."""

    source: str
    target: str
    rank: int
    # this rank, from the call (compile excluded) to its readiness to commit: every round
    # done, the new state complete, the device synchronized; the commit's collective follows
    seconds: float
    compile_s: float  # this call's compile (0 when the program was cached, e.g. by prepare)
    max_seconds: float  # slowest rank's `seconds` (gathered by the commit's collective)
    bytes_sent: int  # this rank
    bytes_received: int
    bytes_copied: int
    bytes_kept: int
    total_bytes_sent: int  # all ranks
    peak_bytes: int
    rounds: list = field(default_factory=list)  # per round of this rank: rounds.RoundTiming as a dict
    verified: Optional[bool] = None
    pack_backend: str = "torch"  # the pack/unpack path this call ran: "torch" or "triton" (CUDA only)
    rollback: str = "device"  # where the old shards waited for the commit ("auto" | "host" | "device")
    parked_bytes: int = 0  # old shards this rank copied to host memory and released on the device
    held_bytes: int = 0  # old shards the program freed that stayed on this device until the commit (auto)
    wall_s: float = 0.0  # this rank, the whole call: compile (if not cached) + seconds + the commit + the registry update
    prepared: bool = False  # prepare(target) had run for this (source, target) pair
    # seconds rank 0 spent proving the program before this transition (0.0 when proven by an
    # earlier one: cached per (from, to); None with verify_programs=False)
    verify_program_s: Optional[float] = None
    # bytes this rank moved between host memory (offloaded units) and the device: over PCIe on CUDA
    offload_bytes: int = 0
    program_bytes: int = 0  # size of this rank's part of the program (canonical JSON), the whole it holds
    # this call's part was lowered before the call by the lowering-ahead thread (nereus.runtime.ahead)
    lowered_ahead: bool = False
    # seconds this call waited for the lowering-ahead thread: its step in progress, and a lowering
    # its lowering process was still at (in `seconds`, `wall_s`)
    ahead_wait_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


class Runtime(LocalState, LiveParts):
    """Live state of this rank's model-stages and the transitions between plans."""

    def __init__(self, module: Module, plan: str, *, rank: Optional[int] = None, world_size: Optional[int] = None,
                 device: Optional[torch.device] = None, verify: bool = False, progress: bool = False,
                 timeout_s: float = 120.0, direct_min_bytes: int = DIRECT_MIN_BYTES,
                 rollback: Optional[str] = None, park_device_types=("cuda",), p2p_groups: Optional[int] = None,
                 verify_programs: bool = True, prover: Optional[str] = None, ahead=None):
        """rollback: "auto", "host" or "device" (see the module docstring); None picks
        "auto" for CUDA tensors and "device" otherwise. park_device_types: the device types whose
        old shards take the host path; tests pass ("cpu",) to run it on CPU. p2p_groups:
        data communicators a round's point-to-point ops are spread over (NCCL runs the
        ops of one communicator one after the other; several overlap that); default
        NEREUS_P2P_GROUPS, else 4 on NCCL and 1 otherwise. verify_programs: prove every
        compiled program correct before running it (nereus.runtime.admission); False for
        programs verified ahead of time (each rank's own checks of its part run either way,
        nereus.runtime.part_check). prover: where rank 0 proves them, "process" (a
        process beside it, overlapping its own lowering), "inline" or "auto" (default
        NEREUS_PROVER, else auto: a process on CUDA; nereus.runtime.prover). ahead: lower
        this rank's part of each transition from the current plan, build its replays and
        compile its kernels in a background thread, before it is asked for: "on", "off"
        or "auto" (default NEREUS_LOWER_AHEAD, else auto: on for CUDA; nereus.runtime.ahead)."""
        if rollback is not None and rollback not in ROLLBACK_MODES:
            raise NereusError(f"unknown rollback mode {rollback!r}",
                              hint="rollback='auto' (default on CUDA), 'host' (old shards wait in host memory) or 'device'")
        if not isinstance(module, Module):
            raise TypeError("Runtime needs a parsed nereus.ir.Module (use Runtime.from_file for a path)")
        _check_options(timeout_s, direct_min_bytes, park_device_types, p2p_groups)
        self.module = module
        known_plan(module, plan)
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
        use_prover = prover_mode(prover, self.device.type) == "process" and verify_programs and self.rank == 0
        use_ahead = ahead_mode(ahead, self.device.type)
        # rank 0 without a prover process proves inline, from the compile the thread keeps
        keep_compiled = use_ahead and self.rank == 0 and verify_programs and not use_prover
        self._plan = plan
        self._programs: dict = {}
        self._prover = None
        self._ahead = None
        self._lowerer = None  # the lowering-ahead thread's lowering process (nereus.runtime.lowerer)
        try:
            if use_ahead and lowerer.ENABLED and not keep_compiled:
                # first, and told the work list at once: its start and first lowering overlap
                # the rest of the construction (the groups, Triton's import) instead of the
                # first transition's wait for it
                self._lowerer = lowerer.Lowerer(module, self.rank, direct_min_bytes)
                self._lowerer.expect(self._ahead_pairs())
            self._init_rest(module, plan, timeout_s, direct_min_bytes, progress, p2p_groups, use_prover,
                            use_ahead, keep_compiled)
        except BaseException:
            self.close()  # a constructor that raises leaves no process or thread behind
            raise

    def _init_rest(self, module, plan, timeout_s, direct_min_bytes, progress, p2p_groups, use_prover, use_ahead,
                   keep_compiled) -> None:
        self._verify_program_s: dict = {}  # (from, to) -> seconds rank 0 took to prove it
        self._lowered_ahead: dict = {}  # (from, to) -> True: its work list came from the ahead thread, until reported
        self._take_wait_s: dict = {}  # (from, to) -> seconds its compile waited in the thread's take(), until reported
        # (from, to) -> (what `then` gave or the ahead thread lowered, whether from the thread):
        # kept from the compile until the lowering uses it (compile() first, a call that
        # failed after compiling, and a retry)
        self._unused_lowering: dict = {}
        self.direct_min_bytes = direct_min_bytes
        self.progress = progress
        self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        if self.device.type == "cuda" or dist.get_backend() == "gloo":
            self._data = None  # the default group
        else:
            self._data = self._control
        replay.packer_for(self.device)  # CUDA: triton imported now, not in the first transition (~0.3 s)
        if use_ahead:  # and its compiler started, beside the rest (prepare.warm_compiler)
            prepare.warm_compiler(self.device)
        if self._data is None:  # NCCL: several communicators (see prepare.data_groups)
            self._data = prepare.data_groups(self.device, timeout_s, p2p_groups)
        self.timeout_s = timeout_s
        self._state: dict = {}  # model-stage → {name: local tensor}
        # self._programs: (from, to) -> (this rank's part of the program as canonical JSON
        # text, seconds, its untouched model-stages): text, not dicts and lists, because every
        # full garbage collection of the process scans every container object it holds (a
        # MoE part is ~10^5 of them: a third of a collection's time, benchmarks/RESULTS.md "GC pauses")
        self._program_bytes: dict = {}  # (from, to) -> bytes of that part's canonical JSON
        self._lowered: dict = {}  # (from, to, live model-stages) -> this rank's lowered program (RankProgram)
        self._lowered_figures: dict = {}  # same key -> _Lowered: what a call derives from the program alone
        self._prepared: set = set()  # (from, to, live model-stages) that prepare() warmed
        self._registrations = 0  # changes of this rank's registered model-stages (see _live_stages)
        self._gathered = None  # (every rank's registration count, every rank's registered model-stages)
        self._live_known: dict = {}  # (plan, target, counts) -> live model-stages
        # the training model-stages of the workload, in a fixed order: their Adam steps ride
        # on _live_stages' collective
        self._trained = tuple(str(ms) for ms in module.workload.model_stages() if ms.stage == "training")
        self._check_ranks(plan)
        if use_prover:  # last: the checks above raise before it starts
            self._prover = Prover(module)  # starts now: ready by the first transition
            self._prover.at_plan(plan, self.world_size)
        if use_ahead:  # no reference to the runtime: a thread must not keep it alive
            # an indexed device: the thread's own current device is GPU 0
            device = torch.device("cuda", torch.cuda.current_device()) \
                if self.device.type == "cuda" and self.device.index is None else self.device
            self._ahead = Ahead(functools.partial(ahead_steps, module, self.rank, device, direct_min_bytes,
                                                  keep_compiled, self._lowerer), lowerer=self._lowerer)
            weakref.finalize(self, self._ahead.close)
            self._ahead_at_plan()

    def close(self) -> None:
        """End rank 0's prover process, the lowering-ahead thread and its lowering process,
        if any (also done when the Runtime is garbage collected, and at exit); later
        transitions prove and lower inline. The live state stays."""
        if self._prover is not None:
            self._prover.close()
            self._prover = None
        if self._ahead is not None:
            self._ahead.close()
            self._ahead = None
        if self._lowerer is not None:
            self._lowerer.close()
            self._lowerer = None

    def wait_ahead(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until the lowering-ahead thread has nothing left to do (it lowers, and on
        CUDA builds the replays and compiles the kernels of, the transitions from the
        current plan and the ways back to it that it has not lowered before), or
        `timeout_s` passed; whether it finished (True when there is no such thread)."""
        return self._ahead is None or self._ahead.idle(timeout_s)

    def _ahead_at_plan(self) -> None:
        """Tell the lowering-ahead thread the current plan: its work is the transitions
        from it, then the ways back to it (a job that switches back soon after finds that
        one lowered too), each not compiled yet and on plans this world can run."""
        if self._ahead is not None:
            self._ahead.at_plan(self._ahead_pairs())

    def _ahead_pairs(self) -> list:
        """The transitions from the current plan, then the ways back to it, on plans this
        world can run, less those compiled already."""
        others = [p.name for p in self.module.plans if p.name != self._plan and runs_on(self.module, p.name,
                                                                                         self.world_size)]
        pairs = [(self._plan, p) for p in others] + [(p, self._plan) for p in others]
        return [k for k in pairs if k not in self._programs]

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

    def reset(self, plan: str) -> None:
        """Forget every registered model-stage and start over in `plan`, keeping what was
        compiled (programs, lowerings, kernels): a caller that moves fresh state between
        the same plans again (nereus.interop) registers it anew. Every rank calls it;
        nothing moves and no collective runs."""
        known_plan(self.module, plan)
        self._check_ranks(plan)
        self._state = {}
        self._registrations += 1
        self._plan = plan
        if self._prover is not None:
            self._prover.at_plan(plan, self.world_size)
        self._ahead_at_plan()

    # -- transitions -------------------------------------------------------------------

    def compile(self, target: str) -> tuple[dict, float]:
        """Collective: this rank's part of the JSON program from the current plan to
        `target` (nereus.runtime.distribute: every rank compiles and lowers its own part;
        with verify_programs rank 0 proves the whole once and each rank checks its part's
        digest), cached as its canonical JSON text (each call returns a fresh dict); and the
        seconds it took."""
        with paused_all():
            # lowered too: the agreement checks every rank's work list (part_check)
            text, compile_s, _, lowering = self._compiled(target, self._lower_part)
            if lowering is not None:  # the transition's lowering will use it
                self._unused_lowering[(self._plan, target)] = lowering
        return json.loads(text), compile_s

    def _compiled(self, target: str, then=None) -> tuple:
        """Collective when not cached: (this rank's part as canonical JSON text, compile
        seconds, its untouched model-stages, (what `then(text)` gave, run on every rank while
        rank 0's prover proves, see distribute.obtain_rank_part, or what the lowering-ahead
        thread lowered; whether it came from the thread), or None when no such value waits
        for the lowering: each is handed out once)."""
        from .distribute import obtain_rank_part

        key = (self._plan, target)
        if key not in self._programs:
            # every rank is compiling this transition (a rank asking for another target
            # makes every rank raise TransitionAborted here, before the compile's own
            # collectives could pair with the wrong ones)
            agree(None, self._control, self._plan, target, kind="compile")
            # a lowering the lowering process is still at is waited for (reported in ahead_wait_s)
            # up to a quarter of the collective timeout (the other ranks wait for this one
            # meanwhile), else lowered here
            taking = time.perf_counter()
            early = self._ahead.take(self._plan, target, self.timeout_s / 4) if self._ahead is not None else None
            self._take_wait_s[key] = time.perf_counter() - taking
            got = obtain_rank_part(self.module, self._plan, target, self.rank, self.world_size, self._control,
                                   self.verify_programs, prover=self._prover, then=then, timeout_s=self.timeout_s,
                                   ahead=early, work_of=_work_list)
            if got.then is not None:
                self._unused_lowering[key] = (got.then, early is not None)
            self._verify_program_s[key] = got.proof_s
            self._program_bytes[key] = got.part_bytes
            # the then-value's facts (a part taken from the thread comes without its dict)
            untouched = got.then[0].untouched if got.then is not None else frozenset(got.program.get("untouched", ()))
            self._programs[key] = (got.text, got.compile_s, untouched)
        return self._programs[key] + (self._unused_lowering.pop(key, None),)

    def prepare(self, target: str) -> dict:
        """Collective: do now everything `transition(target)` would do before moving a
        byte (compile, lower this rank's program, compile the pack kernels for its message
        shapes, open the links to its peers, pin the host blocks parking would use), so
        the transition right after runs at warm speed. Registered tensors are neither
        read nor written; the caching allocator keeps blocks of the sizes the transition
        will allocate (as far as the device has room). Returns this rank's figures:
        seconds, compile_s, kernels, peers, pinned_bytes, reserved_bytes."""
        started = time.perf_counter()  # the wait for the lowering-ahead thread's step counts
        with paused_all():
            return self._prepare(target, started)

    def _prepare(self, target: str, started: float) -> dict:
        from .parking import park_plan, real_room
        from .prepare import warm_data_path, warm_parking

        compile_s, prog, key, _ = self._lower(target)
        # every rank is preparing this transition before the data links are used (a rank in
        # transition() or preparing another target: TransitionAborted on every rank, within
        # timeout_s, instead of a wait on the data group's own timeout)
        agree(None, self._control, self._plan, target, kind="prepare")
        pinned = 0
        if self.rollback != "device" and self.device.type in self.park_device_types:
            units = None
            if self.rollback == "auto":
                figures = self._lowered_figures[key]
                units = park_plan(prog, figures.resident_bytes, figures.capacity_bytes, real_room(self.device),
                                  offloaded=figures.offloaded)
            pinned = warm_parking(prog, units, TORCH_DTYPES)
        warmed = warm_data_path(prog, self._data, self.device, TORCH_DTYPES, self._lowered_figures[key].offloaded)
        self._prepared.add(key)
        return {"seconds": time.perf_counter() - started, "compile_s": compile_s, "pinned_bytes": pinned, **warmed}

    def transition(self, target: str, *, verify: Optional[bool] = None, fault=None,
                   round_hook=None) -> TransitionReport:
        """Collective: move every registered model-stage from the current plan to
        `target`. All or nothing: on failure every rank raises TransitionAborted and
        keeps its old state (restored from host memory where it was parked).
        `round_hook(index)` runs on this rank after each round (tests, instrumentation).
        Returns this rank's TransitionReport; its `seconds` end when this rank is ready to
        commit (every round done, its device synchronized), `max_seconds` when the slowest
        rank was; the commit right after makes the new state usable. Python's cyclic
        garbage collector is paused for the call (gc_pause; NEREUS_PAUSE_GC=0: not)."""
        called = time.perf_counter()  # the wait for the lowering-ahead thread's step counts
        # the thread's step first (it may be loading a lowering with the collector paused:
        # pausing it after would leave the collector to that step's end, mid-transition)
        with paused_all(), paused():
            return self._transition(target, verify, fault, round_hook, called, time.perf_counter() - called)

    def _transition(self, target: str, verify: Optional[bool], fault, round_hook, called: float,
                    ahead_wait_s: float) -> TransitionReport:
        verify = self.verify if verify is None else verify
        result = None
        speculation = self._speculation(target)
        if speculation is not None:  # warm: the registrations are checked by the first agreement
            prog, key, counts = speculation
            compile_s = 0.0
            try:
                result = self._execute(prog, key, verify, fault, round_hook, called,
                                       (self._row(), lambda rows: tuple(r[0] for r in rows) == counts))
            except Stale:  # some rank registered since: nothing moved; the full way below
                result = None
            else:
                steps = self._steps(result.agreed_rows)
        if result is None:
            compile_s, prog, key, steps = self._lower(target)
            # compiling is reported apart (compile_s, 0 when cached)
            result = self._execute(prog, key, verify, fault, round_hook, called + compile_s)
        live = set(key[2])
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
        if self._prover is not None:
            self._prover.at_plan(target, self.world_size)
        self._ahead_at_plan()
        # every rank's [seconds, bytes sent] came with the commit (the executor's last step)
        ranks = result.rank_figures
        return TransitionReport(
            source=prog.source, target=target, rank=self.rank, seconds=result.ready_s, compile_s=compile_s,
            max_seconds=max(seconds for seconds, _ in ranks), bytes_sent=result.sent_bytes,
            bytes_received=result.received_bytes, bytes_copied=result.copied_bytes, bytes_kept=result.kept_bytes,
            total_bytes_sent=int(sum(sent for _, sent in ranks)),
            peak_bytes=result.peak_bytes, rounds=[asdict(r) for r in result.rounds], verified=result.verified,
            rollback=result.rollback, parked_bytes=result.parked_bytes, held_bytes=result.held_bytes,
            wall_s=time.perf_counter() - called, prepared=key in self._prepared,
            pack_backend=packing.backend_for(self.device),
            program_bytes=self._program_bytes.get((prog.source, target), 0),
            verify_program_s=self._verify_program_s.pop((prog.source, target), 0.0 if self.verify_programs else None),
            offload_bytes=result.offload_bytes, lowered_ahead=self._lowered_ahead.pop((prog.source, target), False),
            ahead_wait_s=ahead_wait_s + self._take_wait_s.pop((prog.source, target), 0.0))

    def _execute(self, prog, key: tuple, verify: bool, fault, round_hook, started: float, agreement=None):
        figures = self._lowered_figures[key]
        # the registry dicts themselves: where a freed shard is parked, the executor swaps
        # its entry for the host copy (no device reference left here) and back on abort
        before = {unit: self._state[prog.unit_stage[("before", unit)]] for unit in prog.before}
        return execute(prog, before, group=self._data, control=self._control, device=self.device,
                       resident_bytes=figures.resident_bytes, verify=verify, progress=self.progress, fault=fault,
                       rollback=self.rollback, park_device_types=self.park_device_types, round_hook=round_hook,
                       capacity_bytes=figures.capacity_bytes, offloaded=figures.offloaded, clock_start=started,
                       agreement=agreement)


def _work_list(lowered: tuple):
    """The RankProgram in what `_lower_part` (or the lowering-ahead thread) gave."""
    return lowered[1]


def _check_options(timeout_s, direct_min_bytes, park_device_types, p2p_groups) -> None:
    """The constructor's numeric and device-type options, each a NereusError naming it."""
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or timeout_s < 1:
        raise NereusError(f"timeout_s={timeout_s!r}: must be a number of seconds ≥ 1",
                          hint="how long a collective waits for a peer (default 120)")
    if not whole(direct_min_bytes) or direct_min_bytes < 0:
        raise NereusError(f"direct_min_bytes={direct_min_bytes!r}: must be a whole number of bytes ≥ 0")
    if p2p_groups is not None and (not whole(p2p_groups) or p2p_groups < 1):
        raise NereusError(f"p2p_groups={p2p_groups!r}: must be a whole number ≥ 1 (or None: the default)")
    if not isinstance(park_device_types, (tuple, list, set, frozenset)) or \
            not all(isinstance(t, str) for t in park_device_types):
        raise NereusError(f"park_device_types={park_device_types!r}: must be a tuple of device types",
                          hint='e.g. ("cuda",), the default, or ("cpu",) in tests')
