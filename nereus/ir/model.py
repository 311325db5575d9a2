"""The plan IR's semantic model: frozen dataclasses for everything a `.nir` file declares.

Every node keeps the source location of the token that introduced it in `loc`, which is
excluded from equality and hashing, so that `parse(print(module)) == module` compares
meaning only. Values are stored in base units (bytes, bytes/s, FLOP/s); the printer turns
them back into the most readable exact unit.

Nothing here imports torch or triton: the compiler runs without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

STAGES: tuple[str, ...] = ("generation", "inference", "training")
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4}
HEADS: tuple[str, ...] = ("lm", "value")
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full")
ROPE_SCALING_TYPES: tuple[str, ...] = ("llama3",)
# Each architecture family and the Model fields in which its plain `= family { ... }`
# declaration differs from Model's defaults (the llama of Llama-2/3).
ARCHITECTURE_DEFAULTS: dict[str, dict] = {
    "llama": {},
    "qwen2": {"qkv_bias": True},  # Qwen2/2.5: q/k/v projections with bias
    "qwen3": {"qk_norm": True},  # Qwen3 (dense): RMSNorm on each q and k head
    # Qwen3-MoE: qwen3 attention, a routed mixture of SwiGLU experts in every layer
    "qwen3_moe": {"qk_norm": True, "norm_topk_prob": True},
}
ZERO_STAGES: tuple[int, ...] = (0, 1, 3)
# `quant FORMAT` of a generation placement: fp8 = e4m3 weights, one fp32 scale per
# 128 x 128 block (the block-FP8 layout of DeepSeek-V3 and vLLM)
QUANT_FORMATS: tuple[str, ...] = ("fp8",)
MOE_ARCHITECTURES: tuple[str, ...] = ("qwen3_moe",)
# A model given as its tensor table (`model m = tensors { ... }`): any module, its tensors
# named and shaped as declared, laid out by a placement's mesh layout (docs/ir.md).
TABLE_ARCHITECTURE = "tensors"
# The per-mesh-dimension placements of a mesh layout, as torch.distributed.tensor has them:
# Replicate(), Shard(dim) (torch.chunk of the dimension) and _StridedShard(dim, sf).
DIM_PLACEMENTS: tuple[str, ...] = ("replicate", "shard", "strided")


@dataclass(frozen=True)
class Location:
    """A position in a source file; lines and columns count from 1."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


def _loc() -> Optional[Location]:
    return field(default=None, compare=False, hash=False, repr=False)


def _key_locs() -> tuple[tuple[str, Location], ...]:
    # Where each key's value was written ("tp", "gpu.mem", ...), for errors that point at
    # the offending value rather than at the whole declaration; excluded from equality.
    return field(default=(), compare=False, hash=False, repr=False)


def key_loc(node, key: str) -> Optional[Location]:
    """The location of `key`'s value in `node` (a Cluster, Model, Workload or Placement),
    falling back to the node's own location when the key was not written or not recorded."""
    for name, loc in getattr(node, "key_locs", ()):
        if name == key:
            return loc
    return getattr(node, "loc", None)


@dataclass(frozen=True)
class GpuSpec:
    mem_bytes: int
    flops: float  # peak dense FLOP/s at the model dtype
    hbm_bytes_per_s: float


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    gpus_per_node: int
    gpu: GpuSpec
    intra_bytes_per_s: float  # GPU<->GPU inside a node
    inter_bytes_per_s: float  # per node, each direction
    host_mem_bytes: int  # per node
    reserve: float = 0.0  # fraction of GPU memory kept free (allocator slack, CUDA context)
    loc: Optional[Location] = _loc()
    key_locs: tuple[tuple[str, Location], ...] = _key_locs()

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    @property
    def usable_gpu_bytes(self) -> int:
        return int(self.gpu.mem_bytes * (1.0 - self.reserve))


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1's rotary frequency scaling (transformers' `rope_type: llama3`): wavelengths
    above original_max_position_embeddings / low_freq_factor are divided by `factor`,
    those below original_max_position_embeddings / high_freq_factor are kept, and the
    band between is interpolated."""

    type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class TensorDecl:
    """One tensor of a `tensors` model: its name (any text without '#', '"' or a line
    break: the module's own parameter name, e.g. `model.layers.0.self_attn.q_proj.weight`)
    and its global shape."""

    name: str
    shape: tuple[int, ...]
    loc: Optional[Location] = _loc()


@dataclass(frozen=True)
class Model:
    """A model declaration. `base` is the model it was declared as an alias of
    (`model ref = actor`), kept for printing; the architecture fields are resolved.

    The numerics fields default to the plain llama (rope theta 10,000 without scaling,
    RMSNorm eps 1e-5, head_dim = hidden / heads, untied head, no q/k/v bias, no q/k
    norm). `head_dim` left None is resolved to hidden / heads when heads divides hidden
    (otherwise it stays None and validation asks for it). `checkpoint` is the path written
    in `hf("...")` (the model was read from that checkpoint's config.json);
    `checkpoint_dir` is where it resolved to and `checkpoint_fields` the values the
    config gave, against which the printer writes only overrides (both derived from the
    file, so excluded from equality)."""

    name: str
    architecture: str  # "llama", "qwen2", "qwen3" or "qwen3_moe"
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    dtype: str = "bf16"
    head: str = "lm"  # "lm" (vocab projection) or "value" ([1, hidden] critic head)
    base: Optional[str] = None
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    norm_eps: float = 1e-5
    head_dim: Optional[int] = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # Mixture of experts (qwen3_moe; all 0 for dense families): `experts` routed experts
    # per layer, each a SwiGLU MLP of `expert_ffn`; the router picks `experts_per_token`
    # and, with `norm_topk_prob`, renormalizes their weights to sum to 1.
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    norm_topk_prob: bool = False
    # A `tensors` model (TABLE_ARCHITECTURE): its tensor table in canonical (natural name)
    # order, and the optimizer states each tensor of a training unit carries beside it
    # (`states: exp_avg, exp_avg_sq`), named `{tensor}#{state}`, shaped, typed and laid out
    # like the tensor. Empty for the architecture families.
    tensors: tuple[TensorDecl, ...] = ()
    states: tuple[str, ...] = ()
    checkpoint: Optional[str] = None
    checkpoint_dir: Optional[str] = field(default=None, compare=False, hash=False, repr=False)
    checkpoint_fields: tuple[tuple[str, object], ...] = field(default=(), compare=False, hash=False, repr=False)
    loc: Optional[Location] = _loc()
    key_locs: tuple[tuple[str, Location], ...] = _key_locs()

    def __post_init__(self):
        if self.head_dim is None and self.heads > 0 and self.hidden % self.heads == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_table(self) -> bool:
        """A model given as its tensor table (`= tensors { ... }`), not an architecture."""
        return self.architecture == TABLE_ARCHITECTURE


@dataclass(frozen=True)
class ModelStage:
    """A (model, stage) pair such as `actor.training`."""

    model: str
    stage: str

    def __str__(self) -> str:
        return f"{self.model}.{self.stage}"

    @staticmethod
    def parse(text: str) -> "ModelStage":
        model, _, stage = text.partition(".")
        return ModelStage(model, stage)


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int  # prompts per step (global)
    prompt: int  # prompt tokens
    response: int  # response tokens
    microbatch: int
    stages: tuple[tuple[str, tuple[str, ...]], ...]  # (stage, models) in STAGES order
    # Activation recomputation in training (docs/ir.md; Korthikanti et al. 2022):
    # "none" keeps sbh(34 + 5as/h)/t per layer, "selective" 34sbh/t (attention core
    # recomputed, as with FlashAttention), "full" 2sbh per layer.
    recompute: str = "none"
    loc: Optional[Location] = _loc()
    key_locs: tuple[tuple[str, Location], ...] = _key_locs()

    def models_in(self, stage: str) -> tuple[str, ...]:
        for name, models in self.stages:
            if name == stage:
                return models
        return ()

    def model_stages(self) -> Iterator[ModelStage]:
        for stage, models in self.stages:
            for model in models:
                yield ModelStage(model, stage)

    @property
    def sequence(self) -> int:
        return self.prompt + self.response


@dataclass(frozen=True)
class GpuSetItem:
    """One comma-separated item of a GPU set, as written.

    kind: "id" (lo), "range" (lo..hi), "nodes" (nlo..nhi, or one node when lo == hi),
    "node_gpus" (n{node}:lo..hi, or n{node}:lo when lo == hi). Ranges are inclusive."""

    kind: str
    lo: int
    hi: int
    node: int = -1
    loc: Optional[Location] = _loc()


@dataclass(frozen=True)
class DimPlacement:
    """How one mesh dimension splits a tensor: `replicate`; `shard(dim)`, the dimension cut
    as torch.chunk cuts it (ceil-sized chunks, the last ones short or empty); or
    `strided(dim, split)`, torch's _StridedShard(dim, sf=split): the dimension cut into
    `split` chunks, each of those into one chunk per mesh rank, rank i holding the i-th
    piece of every chunk (FSDP2 over tensor parallelism)."""

    kind: str  # DIM_PLACEMENTS
    dim: int = 0
    split: int = 1
    loc: Optional[Location] = _loc()

    def __str__(self) -> str:
        if self.kind == "replicate":
            return "replicate"
        if self.kind == "shard":
            return f"shard({self.dim})"
        return f"strided({self.dim}, {self.split})"


@dataclass(frozen=True)
class Mesh:
    """A named device mesh: its dimensions (name, size), outermost first, over `gpus` in
    row-major order (torch's DeviceMesh: the last dimension varies fastest)."""

    dims: tuple[tuple[str, int], ...]
    gpus: tuple[int, ...]
    gpu_set: tuple["GpuSetItem", ...] = field(default=(), compare=False, hash=False)
    loc: Optional[Location] = _loc()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.dims)

    def coordinate(self, gpu: int) -> Optional[tuple[int, ...]]:
        """`gpu`'s coordinate in the mesh, or None when it is not in it."""
        try:
            index = self.gpus.index(gpu)
        except ValueError:
            return None
        coord = []
        for size in reversed(self.shape):
            index, c = divmod(index, size)
            coord.append(c)
        return tuple(reversed(coord))


@dataclass(frozen=True)
class LayoutRule:
    """`"pattern" [mesh (...) on GPUS] P0 P1 ...`: the tensors whose name matches `pattern`
    (fnmatch: `*`, `?`, `[...]`) are split by one DimPlacement per dimension of the mesh:
    the rule's own `mesh` (a sub-mesh, e.g. one pipeline stage's GPUs) or, when None, the
    placement's. The first rule that matches a tensor is its rule."""

    pattern: str
    placements: tuple[DimPlacement, ...]
    mesh: Optional[Mesh] = None
    loc: Optional[Location] = _loc()


@dataclass(frozen=True)
class MeshLayout:
    """A placement's mesh layout (`mesh (dp 2, tp 2) on 0..3 { rules }`): its mesh
    dimensions over the placement's GPU list and the per-tensor rules."""

    dims: tuple[tuple[str, int], ...]
    rules: tuple[LayoutRule, ...]
    loc: Optional[Location] = _loc()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.dims)


@dataclass(frozen=True)
class Placement:
    """One model-stage's layout in a plan: dp replicas of a pp x ep x tp mesh on `gpus`.

    `gpus` is the resolved, ordered GPU list; mesh order is replica-major, then pipeline
    stage, then expert-parallel rank, then TP innermost:
    gpu(r, p, e, t) = gpus[r*pp*ep*tp + p*ep*tp + e*tp + t]. Within a pipeline stage a GPU
    is named by its *stage rank* u = e*tp + t (0 <= u < ep*tp; u = t when ep is 1), which
    is what `gpu_of` and the layout pass take. With ep > 1 the non-expert tensors are
    replicated on the ep ranks (data-parallel for attention, Megatron's expert-data-parallel
    arrangement) and each expert lives whole on one of them (docs/ir.md)."""

    model_stage: ModelStage
    dp: int
    tp: int
    pp: int
    gpus: tuple[int, ...]
    # The set as written, for printing. Excluded from equality: `0..7` and `n0` (8 GPUs a
    # node) place the same GPUs, and a placement built by code may leave it empty.
    gpu_set: tuple[GpuSetItem, ...] = field(compare=False, hash=False)
    offload: bool = False
    # ZeRO stage of a training model-stage (ZERO_STAGES): 1 shards the fp32 master weights
    # and Adam state over the dp replicas (Megatron's distributed optimizer), 3 the bf16
    # weights (and grads) too (FSDP); 0 replicates them on every replica. The partitioning
    # is nereus.passes.layout.zero_boxes.
    zero: int = 0
    loc: Optional[Location] = _loc()
    key_locs: tuple[tuple[str, Location], ...] = _key_locs()
    ep: int = 1  # expert-parallel degree (MoE models; 1 for dense)
    # weight format of a generation placement (QUANT_FORMATS): "fp8" holds the linear
    # layers' weights as e4m3 with an fp32 scale per 128 x 128 block, quantized by the
    # weight sync from the training weights (docs/ir.md, "Quantized generation weights")
    quant: Optional[str] = None
    # A mesh layout (`tensors` models): one unit over all of `gpus`, each tensor split as
    # its rule says; then dp = pp = ep = 1 and tp = len(gpus) (the unit's width).
    layout: Optional[MeshLayout] = None

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.ep

    @property
    def stage_width(self) -> int:
        """GPUs per pipeline stage of one replica: ep x tp."""
        return self.ep * self.tp

    def gpu_of(self, replica: int, pp_stage: int, tp_rank: int) -> int:
        """The GPU at (replica, pp stage, stage rank): `tp_rank` is the TP rank when ep is 1
        and the stage rank ep_rank * tp + tp_rank otherwise (the name kept for callers)."""
        width = self.stage_width
        return self.gpus[replica * self.pp * width + pp_stage * width + tp_rank]

    def replica_gpus(self, replica: int) -> tuple[int, ...]:
        n = self.pp * self.stage_width
        return self.gpus[replica * n : (replica + 1) * n]

    def layout_mesh(self) -> Mesh:
        """The placement's own mesh (mesh layouts only): its dimensions over `gpus`."""
        assert self.layout is not None
        return Mesh(self.layout.dims, self.gpus, self.gpu_set, self.layout.loc)


@dataclass(frozen=True)
class Plan:
    """A plan. `declared` holds the entries as written (for `plan S2 = S1 {...}` only the
    overrides); `placements` holds every model-stage's resolved placement in workload order."""

    name: str
    base: Optional[str]
    declared: tuple[Placement, ...]
    placements: tuple[Placement, ...]
    loc: Optional[Location] = _loc()

    def placement(self, model_stage: ModelStage | str) -> Placement:
        key = ModelStage.parse(model_stage) if isinstance(model_stage, str) else model_stage
        for placement in self.placements:
            if placement.model_stage == key:
                return placement
        raise KeyError(str(key))


@dataclass(frozen=True)
class Transition:
    source: str
    target: str
    loc: Optional[Location] = _loc()

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}"


@dataclass(frozen=True)
class Module:
    """A whole `.nir` file: one cluster, its models, one workload, plans and transitions,
    each tuple in declaration order."""

    cluster: Cluster
    models: tuple[Model, ...]
    workload: Workload
    plans: tuple[Plan, ...]
    transitions: tuple[Transition, ...]
    file: str = field(default="<input>", compare=False, hash=False, repr=False)

    def model(self, name: str) -> Model:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(name)

    def plan(self, name: str) -> Plan:
        for plan in self.plans:
            if plan.name == name:
                return plan
        raise KeyError(name)
