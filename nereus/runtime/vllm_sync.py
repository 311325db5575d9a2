"""The per-step weight sync of RL post-training, compiled by Nereus.

Every step the trained actor weights must reach the generation engine, laid out the way
the generation stage holds them. verl, OpenRLHF and NeMo-RL do this by hand: every rank
gathers every whole tensor, then slices what its engine needs. Nereus treats the sync as
a transition of the actor's weights (no optimizer state) from `actor.training`'s layout
to `actor.generation`'s layout, compiled with the same passes (diff, dag, resources,
fusion, lower) and run by the same executor:

    sync = WeightSync(module)                       # under torchrun / gloo
    sync.prepare(plan)                              # optional: the first run is then warm
    result = sync.run(plan, rt.state("actor.training"))
    result.weights                                  # this rank's generation shards
    result.bytes_sent, result.seconds               # this rank's figures

`sync_module` builds the module that the compiler sees: one model-stage (the target)
placed by plan `sync.from` where the source lives and by plan `sync.to` where the target
lives. Unchanged shards become `keep` ops (zero copies): when training and generation
share a layout the sync moves nothing. Caveat: a kept after-shard *aliases* the training
tensor; the engine must copy it (vLLM's load_weights does) before training writes again.

`gather_then_slice` is the baseline (what verl and OpenRLHF do): each box of every
tensor is broadcast from one holder to every rank, which then slices its shard.

Uses torch.distributed (gloo on CPU, NCCL when the tensors are on CUDA).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from nereus.ir.diagnostics import SemanticError
from nereus.ir.model import ModelStage, Module, Placement, Plan

from .boxes import as_box, box_numel
from . import replay
from .executor import TORCH_DTYPES, execute
from .ahead import paused_all
from .gc_pause import paused
from .program import rank_program, unit_of_stage
from .runtime import known_plan
from .state import box_view, shard_unit, unit_on_gpu, writers

SYNC_FROM, SYNC_TO = "sync.from", "sync.to"
# dense: every run moves every byte whose owner changes (a transition of the weights);
# delta: runs after the first send only the words that changed since the last one
SYNC_MODES = ("dense", "delta")


def engine_placement(placement: Placement) -> Placement:
    """The layout the engines read their weights in: each replica's whole weights on its
    driver GPU (dp replicas, tp = pp = 1). Equal to `placement` when tp = pp = 1."""
    drivers = tuple(placement.replica_gpus(r)[0] for r in range(placement.dp))
    return replace(placement, tp=1, pp=1, gpus=drivers, gpu_set=())


def driver_replica(placement: Placement, rank: int) -> Optional[int]:
    """The generation replica whose engine rank `rank` drives, or None."""
    for r in range(placement.dp):
        if placement.replica_gpus(r)[0] == rank:
            return r
    return None


def is_weight(name: str) -> bool:
    """True for a weight (not optimizer state `#master|exp_avg|exp_avg_sq`, not `#step`)."""
    return "#" not in name


def sync_module(module: Module, plan: str, source: str = "actor.training",
                target: str = "actor.generation", engine_input: bool = False) -> Module:
    """Input: a module, one of its plans, and two model-stages of the same model.
    Output: a module whose only model-stage is `target`, placed in plan `sync.from` as
    `source` is placed in `plan` and in plan `sync.to` as `target` is (with
    `engine_input`, in the layout a checkpoint-format engine reads: each replica's whole
    weights on its driver GPU, see engine_placement).
    Invariant: compiling sync.from → sync.to moves exactly the weights that `target`
    needs from where `source` holds them (the target stage carries no optimizer state)."""
    src, dst = ModelStage.parse(source), ModelStage.parse(target)
    if src.model != dst.model:
        raise SemanticError(f"a weight sync needs one model, got {source} and {target}",
                            hint="sync actor.training into actor.generation")
    stages = {str(ms) for ms in module.workload.model_stages()}
    for ms in (source, target):
        if ms not in stages:
            raise SemanticError(f"the workload has no model-stage {ms}", module.workload.loc,
                                hint=f"model-stages: {', '.join(sorted(stages))}")
    placed = module.plan(plan)
    src_placement, dst_placement = placed.placement(src), placed.placement(dst)
    model = replace(module.model(dst.model), base=None)
    workload = replace(module.workload, stages=((dst.stage, (dst.model,)),))
    # the source's whole TP/PP shards: under zero 3 the caller passes them gathered over dp
    # (nereus.rl.trainer does); zero 1 keeps weights whole anyway
    before = replace(src_placement, model_stage=dst, offload=False, zero=0)
    if engine_input:
        dst_placement = engine_placement(dst_placement)
    after = replace(dst_placement, offload=False)
    plans = tuple(Plan(name, None, (p,), (p,)) for name, p in ((SYNC_FROM, before), (SYNC_TO, after)))
    return replace(module, models=(model,), workload=workload, plans=plans, transitions=())


def compile_weight_sync(module: Module, plan: str, source: str = "actor.training",
                        target: str = "actor.generation", engine_input: bool = False, *, mode: str = "dense",
                        chunk: Optional[int] = None, **options) -> dict:
    """The JSON program (v1) of the weight sync of `plan`; `options` go to the passes
    (e.g. bucket=64 << 20). With a `quant fp8` target placement the program quantizes
    (nereus.passes.quantize), with mode "delta" its sends carry only what changed
    (nereus.passes.delta; `chunk` words per chunk): docs/program.md, "Weight-sync codecs".
    Pure: imports neither vLLM nor CUDA."""
    from nereus.passes import compile_transition
    from nereus.backends.json_program import program_json

    if mode not in SYNC_MODES:
        raise SemanticError(f"unknown weight-sync mode {mode!r}", hint=f"modes: {', '.join(SYNC_MODES)}")
    synthetic = sync_module(module, plan, source, target, engine_input)
    placement = synthetic.plan(SYNC_TO).placement(target)
    compiled = compile_transition(synthetic, SYNC_FROM, SYNC_TO, **options)
    if placement.quant is None and mode == "dense":
        return program_json(compiled)
    program = program_json(compiled, version=1)  # the codecs extend version 1
    if placement.quant is not None:
        from nereus.models.quant import quantized_names
        from nereus.passes.quantize import quantize_program

        program = quantize_program(program, quantized_names(synthetic.model(placement.model_stage.model)))
    if mode == "delta":
        from nereus.passes.delta import CHUNK, delta_program

        program = delta_program(program, chunk or CHUNK)
    return program


@dataclass
class SyncResult:
    """One rank's outcome of one sync: its target shards {global name: tensor} and figures."""

    weights: dict
    seconds: float
    bytes_sent: int
    bytes_received: int
    bytes_copied: int = 0
    bytes_kept: int = 0
    rounds: int = 0
    compile_s: float = 0.0
    extra: dict = field(default_factory=dict)


class WeightSync:
    """Compiled weight sync for one (source, target) pair; one program per plan, cached.

    Collective over the default process group (one rank per GPU of the plan, rank r on
    GPU r). `control` is a gloo group for the executor's agreement messages; one is made
    when not given (a collective call on every rank), with a timeout long enough for a
    driver rank to (re)start its engine between two syncs. verify_programs: rank 0 proves
    each plan's sync program once, as `Runtime` does its transitions (False: not; every
    rank's own checks of its part run either way, nereus.runtime.part_check). mode "delta"
    sends only what changed since the last run (a full run every `full_every`, 0: only
    when needed), `chunk` words per delta chunk; with a `quant fp8` target the sync
    quantizes (docs/program.md, "Weight-sync codecs": both run as codec programs,
    nereus.runtime.codec_runs)."""

    def __init__(self, module: Module, *, source: str = "actor.training", target: str = "actor.generation",
                 engine_input: bool = False, device: Optional[torch.device] = None, control=None,
                 bucket: Optional[int] = None, timeout_s: float = 600.0, mode: str = "dense",
                 full_every: int = 0, chunk: Optional[int] = None, verify_programs: bool = True):
        stages = {str(ms) for ms in module.workload.model_stages()}
        for role, name in (("source", source), ("target", target)):
            if name not in stages:
                raise SemanticError(f"WeightSync {role} {name!r} is no model-stage of the workload",
                                    hint=f"model-stages: {', '.join(sorted(stages))}")
        if ModelStage.parse(source).model != ModelStage.parse(target).model or \
                ModelStage.parse(target).stage == "training":
            raise SemanticError(f"WeightSync {source} -> {target}: a sync copies one model's weights into a stage "
                                "without optimizer state", hint="e.g. source='actor.training', target='actor.generation'")
        if mode not in SYNC_MODES:
            raise SemanticError(f"unknown weight-sync mode {mode!r}", hint=f"modes: {', '.join(SYNC_MODES)}")
        if type(full_every) is not int or full_every < 0:
            raise SemanticError(f"full_every {full_every!r} must be a whole number >= 0",
                                hint="0: a full sync only when one is needed (the first, after a layout change)")
        self.module, self.source, self.target, self.engine_input = module, source, target, engine_input
        # codec syncs (delta, quant fp8 targets; docs/program.md, "Weight-sync codecs")
        self.mode, self.full_every, self.chunk = mode, full_every, chunk
        from .codec_runs import CodecRuns

        self._codec_runs = CodecRuns(self)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.control = control if control is not None else \
            dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.options = {} if bucket is None else {"bucket": bucket}
        self.verify_programs = verify_programs
        self.timeout_s = timeout_s
        from .prepare import data_groups

        # NCCL: several communicators (see prepare.data_groups); None: the default group
        self.data_group = data_groups(self.device, timeout_s) if dist.is_initialized() else None
        replay.packer_for(self.device)  # CUDA: triton imported now, not in the first sync (~0.3 s)
        self._programs: dict = {}
        self._parts: dict = {}  # plan -> (this rank's part of the program, compile seconds)
        # plan -> this rank's lowered program (lowered by `part` once per plan: seconds for 8B on 8 GPUs;
        # every step reuses it)
        self._rank_programs: dict = {}

    def program(self, plan: str) -> tuple[dict, float]:
        """Collective: the whole sync program of `plan` (compiled on rank 0, broadcast,
        cached) and compile seconds: for inspection; `run` never fetches it (`part`)."""
        if plan not in self._programs:
            known_plan(self.module, plan)
            started = time.perf_counter()
            box: list = [None]
            if dist.get_rank() == 0:
                try:
                    box[0] = ("ok", compile_weight_sync(self.module, plan, self.source, self.target, self.engine_input,
                                                        mode=self.mode, chunk=self.chunk, **self.options))
                except Exception as error:  # noqa: BLE001 - every rank must raise the same error
                    box[0] = ("error", error)
            dist.broadcast_object_list(box, src=0, group=self.control)
            if box[0][0] == "error":
                raise box[0][1]
            self._programs[plan] = (box[0][1], time.perf_counter() - started)
        return self._programs[plan]

    def part(self, plan: str) -> tuple[dict, float]:
        """Collective: this rank's part of the sync program of `plan` (JSON program v1 with
        `rank` and `peers`) and compile seconds, cached. Every rank compiles the sync and
        lowers only its own part (nereus.runtime.distribute): no rank holds or receives the
        whole program; with `verify_programs` rank 0 proves the whole once and each rank
        checks its part's digest. Every rank checks that its part writes each of its new
        shards exactly once and that its messages match its peers' (part_check); a rank
        that fails or refuses makes every rank raise, before any byte moves."""
        if plan not in self._parts:
            from .distribute import obtain_rank_part

            known_plan(self.module, plan)
            rank = dist.get_rank()
            got = obtain_rank_part(sync_module(self.module, plan, self.source, self.target, self.engine_input),
                                   SYNC_FROM, SYNC_TO, rank, dist.get_world_size(), self.control,
                                   verify=self.verify_programs, options=self.options, timeout_s=self.timeout_s,
                                   then=lambda text: rank_program(json.loads(text), rank), work_of=lambda work: work)
            self._parts[plan] = (got.program, got.compile_s)
            self._rank_programs[plan] = got.then
        return self._parts[plan]

    def prepare(self, plan: str) -> dict:
        """Collective: do now what the first `run(plan)` would do before moving a byte
        (compile and lower this rank's part of the sync, compile the pack kernels for its
        message shapes, open the links to its peers, and leave device blocks of the sizes
        it allocates in the caching allocator), so that run is warm. No tensor is read or
        written. A rank in `run` while another prepares makes both raise (the agreement's
        tags differ) instead of waiting. Returns this rank's figures: seconds, compile_s,
        kernels, peers, reserved_bytes."""
        from .control import agree
        from .prepare import warm_data_path

        started = time.perf_counter()
        if self.is_codec(plan):  # compiled, proven and lowered now; its buffers are made per run
            with paused_all():
                compile_s = self.codec(plan)[1]
            return {"seconds": time.perf_counter() - started, "compile_s": compile_s, "kernels": 0, "peers": 0,
                    "reserved_bytes": 0}
        with paused_all():
            program, compile_s = self.part(plan)
            figures = {"compile_s": compile_s, "kernels": 0, "peers": 0, "reserved_bytes": 0}
            if not program.get("untouched"):
                prog = self._rank_programs[plan]
                agree(None, self.control, SYNC_FROM, SYNC_TO, kind="prepare")
                figures.update(warm_data_path(prog, self.data_group, self.device, TORCH_DTYPES))
        return {"seconds": time.perf_counter() - started, **figures}

    def run(self, plan: str, source_state: dict, into: Optional[dict] = None) -> SyncResult:
        """Collective. Input: this rank's shards of `source` ({} when it holds none);
        optimizer state in it is ignored. Output: this rank's shards of `target` in `plan`.
        Invariant: `source_state`'s tensors are never written. Python's cyclic garbage
        collector is paused for the call (gc_pause), and so are the process's
        lowering-ahead threads (nereus.runtime.ahead: their steps would share the GIL).
        A codec sync (mode "delta", or a `quant fp8` target) writes in place: into `into`
        (this rank's target shards, as the last run returned them: {name: tensor or
        nereus.models.fp8.Fp8Weight}) or, without it, into shards it keeps itself."""
        with paused_all(), paused():  # (this order: a step may end a collector pause of its own meanwhile)
            if self.is_codec(plan):
                return self._run_codec(plan, source_state, into)
            result = self._run(plan, source_state)
            if into is not None:  # a dense sync's result aliases kept training tensors: copied
                for name, tensor in into.items():
                    tensor.copy_(result.weights[name])
                result.weights = into
            return result

    def is_codec(self, plan: str) -> bool:
        """Whether the sync of `plan` runs as a codec program (delta mode, or FP8 targets)."""
        known_plan(self.module, plan)  # a SemanticError naming the plans, never a bare KeyError
        return self.mode == "delta" or self.module.plan(plan).placement(self.target).quant is not None

    def codec(self, plan: str):
        """Collective: this rank's CodecSync of `plan`'s codec program (None when the sync is
        untouched) and compile seconds (nereus.runtime.codec_runs)."""
        return self._codec_runs.codec(plan)

    def compile_program(self, plan: str) -> dict:
        """The whole sync program of `plan` with this WeightSync's mode and options (pure)."""
        return compile_weight_sync(self.module, plan, self.source, self.target, self.engine_input, mode=self.mode,
                                   chunk=self.chunk, **self.options)

    transition = (SYNC_FROM, SYNC_TO)

    def _run_codec(self, plan: str, source_state: dict, into: Optional[dict]) -> SyncResult:
        targets, f = self._codec_runs.run(plan, {k: v for k, v in source_state.items() if is_weight(k)}, into)
        return SyncResult(targets, f["seconds"], f["bytes_sent"], f["bytes_received"], f["bytes_copied"],
                          f["bytes_kept"], f["rounds"], f["compile_s"],
                          extra={key: f[key] for key in ("full", "dense_bytes", "reference_bytes")})

    def _run(self, plan: str, source_state: dict) -> SyncResult:
        program, compile_s = self.part(plan)
        weights = {k: v for k, v in source_state.items() if is_weight(k)}
        if program.get("untouched"):
            # the synthetic module has this one model-stage; the compiler left it untouched:
            # both layouts are one (a global fact every rank's part states alike), keep all
            kept = sum(t.numel() * t.element_size() for t in weights.values())
            return SyncResult(dict(weights), 0.0, 0, 0, bytes_kept=kept, compile_s=compile_s)
        prog = self._rank_programs[plan]
        before = {unit: {name: weights[name] for name in prog.before[unit] if name in weights} for unit in prog.before}
        # the training weights stay where they are after a sync: nothing to park on the host
        result = execute(prog, before, group=self.data_group, control=self.control, device=self.device,
                         rollback="device")
        unit = unit_of_stage(result.state, prog.unit_stage, "after", self.target)
        new = dict(result.state.get(unit, {})) if unit is not None else {}
        return SyncResult(new, result.seconds, result.sent_bytes, result.received_bytes, result.copied_bytes,
                          result.kept_bytes, len(prog.rounds), compile_s,
                          extra={"round_timings": [asdict(r) for r in result.rounds]})


def gather_then_slice(module: Module, plan: str, source_state: dict, *, source: str = "actor.training",
                      target: str = "actor.generation", engine_input: bool = False, group=None,
                      device: Optional[torch.device] = None) -> SyncResult:
    """Baseline sync (verl / OpenRLHF style), collective over `group` (default: world).

    Every distinct box of every source weight is broadcast from one holder to every rank,
    so each rank holds each whole tensor; then each rank slices its target shards.
    bytes_received counts what this rank received (the whole model minus what it held)."""
    from nereus.backends.json_program import placement_units

    rank = dist.get_rank()
    started = time.perf_counter()
    placements = module.plan(plan)
    src_units = placement_units(module.model(ModelStage.parse(source).model), placements.placement(source))
    dst_placement = placements.placement(target)
    if engine_input:
        dst_placement = engine_placement(dst_placement)
    dst_units = placement_units(module.model(ModelStage.parse(target).model), dst_placement)
    mine = unit_on_gpu(src_units, rank)
    my_boxes = {}
    if mine is not None:
        for shard in mine["shards"]:
            if shard["gpu"] == rank:
                my_boxes[shard["tensor"]] = [as_box(b) for b in shard["boxes"]]
    specs = _weight_specs(module, source)
    holders = writers(src_units)
    full, received = {}, 0
    for name, (shape, dtype) in specs.items():
        tensor = torch.empty(shape, dtype=dtype, device=device)
        for holder, index, box in holders.get(name, ()):
            piece = torch.empty(tuple(hi - lo for lo, hi in box), dtype=dtype, device=device)
            if holder == rank:
                offset = sum(b[0][1] - b[0][0] for b in my_boxes[name][:index])
                piece.copy_(source_state[name][offset: offset + box[0][1] - box[0][0]])
            else:
                received += box_numel(box) * piece.element_size()
            dist.broadcast(piece, src=holder, group=group)
            box_view(tensor, box).copy_(piece)
        full[name] = tensor
    target_unit = unit_on_gpu(dst_units, rank)
    weights = shard_unit(target_unit, rank, full) if target_unit is not None else {}
    sent = sum(box_numel(box) * _elem(specs[n][1]) * (dist.get_world_size(group) - 1)
               for n, entries in holders.items() if n in specs
               for holder, _, box in entries if holder == rank)
    return SyncResult(weights, time.perf_counter() - started, sent, received)


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _weight_specs(module: Module, model_stage: str) -> dict:
    from nereus.models import tensor_table

    model = module.model(ModelStage.parse(model_stage).model)
    return {f"{model.name}/{s.name}": (s.shape, TORCH_DTYPES[s.dtype]) for s in tensor_table(model)}


__all__ = ["SYNC_FROM", "SYNC_TO", "SyncResult", "WeightSync", "compile_weight_sync", "gather_then_slice",
           "is_weight", "sync_module"]
