"""A PyTorch module's live layout, read from its DTensors: which part of every parameter,
buffer and optimizer state each rank holds (collective over the default group).

    layout = module_layout(model, optim)       # every rank calls it; every rank gets the same

Input: an `nn.Module` whose parameters are DTensors (FSDP2, tensor parallelism, both,
any mesh shape and dimension order, Shard / _StridedShard / Replicate) or plain tensors
(replicated on every rank that has them), and optionally its torch.optim optimizer. Output:
`ModuleLayout`, the same on every rank: per tensor its global shape, dtype, the optimizer
states it carries, and one mesh (dimensions, GPUs, a placement per dimension) that says
where each part lives, in the IR's terms (nereus.ir.mesh).

Each rank reads only its own parameters' specs: a DTensor names the (sub)mesh it lives on
as seen from this rank, e.g. FSDP2 over a 2 x 2 (dp, tp) mesh gives the embedding the dp
column of the rank ([0, 2] on ranks 0 and 2, [1, 3] on ranks 1 and 3). The specs are
gathered, and a tensor whose ranks see k disjoint sub-meshes alike becomes one mesh with
an outer `rep k` dimension that replicates it: exactly what DTensor holds. Every rank
then checks the boxes the IR gives it against its local tensors' shapes. What the IR
cannot say (a Partial placement, a dtype it lacks, ranks that disagree on a tensor's
shape) is an `InteropError` naming the tensor, raised on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
import hashlib

import torch
import torch.distributed as dist

from nereus.ir.mesh import StridedLayoutError, shard_boxes
from nereus.ir.model import DimPlacement

from .errors import InteropError, verdict, agree_or_raise, raise_first

DTYPES: dict = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
TORCH_OF: dict = {name: dtype for dtype, name in DTYPES.items()}
PARAM, BUFFER = "param", "buffer"


@dataclass(frozen=True)
class TensorLayout:
    """One tensor of the module: `name` its FQN, `kind` param or (DTensor) buffer, the
    mesh it lives on (`dims` (name, size) outermost first over `gpus`, row-major) and a
    placement per mesh dimension; `states` the optimizer states it carries (param-shaped
    entries of `optimizer.state[param]`, laid out like it)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    dims: tuple[tuple[str, int], ...]
    gpus: tuple[int, ...]
    placements: tuple[DimPlacement, ...]
    states: tuple[str, ...] = ()

    @property
    def mesh_key(self) -> tuple:
        return self.dims, self.gpus


@dataclass(frozen=True)
class ModuleLayout:
    world: int
    tensors: tuple[TensorLayout, ...]  # in the module's order (named_parameters, then buffers)

    def by_name(self) -> dict[str, TensorLayout]:
        return {t.name: t for t in self.tensors}


def is_dtensor(tensor) -> bool:
    return hasattr(tensor, "placements") and hasattr(tensor, "device_mesh")


def local_of(tensor) -> torch.Tensor:
    """The local tensor of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _placement(p, ndim: int, name: str, rank: int) -> DimPlacement:
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if isinstance(p, _StridedShard):  # before Shard: some torch versions derive it from Shard
        return DimPlacement("strided", p.dim % ndim, int(p.split_factor))
    if isinstance(p, Shard):
        return DimPlacement("shard", p.dim % ndim)
    if isinstance(p, Replicate):
        return DimPlacement("replicate")
    raise InteropError(f"{name} has a {p} placement, which Nereus cannot move", name=name, rank=rank,
                       hint="a Partial placement holds unreduced sums: reduce it (e.g. redistribute to Replicate) "
                            "before resharding")


def _spec(tensor, name: str, rank: int) -> tuple:
    """(mesh ranks of this rank's (sub)mesh, its shape, dimension names, placements, this
    rank's coordinate) of a DTensor; a plain tensor is a mesh of this rank alone."""
    if not is_dtensor(tensor):
        return (rank,), (), (), (), ()
    mesh = tensor.device_mesh
    ranks, shape, names, coord = _mesh_facts(mesh)
    ndim = max(1, tensor.dim())
    placements = tuple(_placement(p, ndim, name, rank) for p in tensor.placements)
    return ranks, shape, names, placements, coord


_MESHES: dict = {}  # id(DeviceMesh) -> (mesh, its facts): reading a mesh's ranks builds a tensor each time


def _mesh_facts(mesh) -> tuple:
    """(ranks in row-major order, shape, dimension names, this rank's coordinate) of a
    DeviceMesh, once per mesh object (the entry keeps the mesh alive, so its id stays its own)."""
    found = _MESHES.get(id(mesh))
    if found is None or found[0] is not mesh:
        ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        names = tuple(mesh.mesh_dim_names or tuple(f"d{i}" for i in range(mesh.ndim)))
        coord = mesh.get_coordinate()
        found = _MESHES[id(mesh)] = (mesh, (ranks, tuple(mesh.shape), names,
                                             tuple(coord) if coord is not None else None))
    return found[1]


def _dtype(tensor, name: str, rank: int) -> str:
    found = DTYPES.get(tensor.dtype)
    if found is None:
        raise InteropError(f"{name} is {tensor.dtype}; Nereus moves bf16, fp16 and fp32 tensors", name=name, rank=rank)
    return found


def _optimizer_states(optim, param, name: str, rank: int) -> tuple[tuple[str, ...], dict]:
    """(names of the param-shaped state entries, {name: scalar value}) of `param` in `optim`."""
    if optim is None:
        return (), {}
    state = optim.state.get(param, {})
    tensors, scalars = [], {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            scalars[key] = value
            continue
        if tuple(value.shape) == tuple(param.shape) and value.dim() > 0:
            if value.dtype != param.dtype:
                raise InteropError(f"optimizer state '{key}' of {name} is {value.dtype}, its parameter {param.dtype}",
                                   name=name, rank=rank,
                                   hint="Nereus moves a parameter and its states together in one dtype")
            if is_dtensor(value) != is_dtensor(param) or (is_dtensor(value) and (
                    tuple(value.placements) != tuple(param.placements) or value.device_mesh != param.device_mesh)):
                raise InteropError(f"optimizer state '{key}' of {name} is laid out unlike its parameter", name=name,
                                   rank=rank, hint="torch.optim keeps states like their parameters; this one was moved")
            tensors.append(key)
        elif value.dim() == 0:
            scalars[key] = value
        else:
            raise InteropError(f"optimizer state '{key}' of {name} has shape {tuple(value.shape)}, neither a scalar "
                               f"nor the parameter's {tuple(param.shape)}", name=name, rank=rank)
    return tuple(sorted(tensors)), scalars


def local_entries(model, optim, rank: int) -> list[tuple]:
    """This rank's view of every tensor to move: (name, kind, shape, dtype, states,
    spec, local shape). Raises InteropError."""
    out = []
    for name, param in model.named_parameters():
        states, _ = _optimizer_states(optim, param, name, rank)
        out.append((name, PARAM, tuple(param.shape), _dtype(param, name, rank), states, _spec(param, name, rank),
                    tuple(local_of(param).shape)))
    for name, buffer in model.named_buffers():
        if is_dtensor(buffer):  # plain buffers are whole on every rank: copied, not moved
            out.append((name, BUFFER, tuple(buffer.shape), _dtype(buffer, name, rank), (), _spec(buffer, name, rank),
                        tuple(local_of(buffer).shape)))
    return out


_LAYOUTS: dict = {}  # every rank's digest of its entries -> the merged layout (the same module again)


def module_layout(model, optim=None, group=None, what: str = "module") -> ModuleLayout:
    """Collective: the layout of `model` (and `optim`'s states) on every rank (module
    docstring). A module whose ranks all report what they reported before (the specs do
    not change while it trains) costs one small gather: digests, not the entries."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    entries, error = [], None
    try:
        entries = local_entries(model, optim, rank)
    except InteropError as caught:
        error = caught
    digest = hashlib.sha256(repr(entries).encode()).hexdigest() if error is None else None
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, (digest, verdict(error)), group=group)
    raise_first([v for _, v in verdicts])
    key = (what, tuple(d for d, _ in verdicts))
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, [e[:6] for e in entries], group=group)
    error = None
    try:
        layout = merge(gathered, world, what)
        check_local(layout, entries, rank)
    except InteropError as caught:
        error, layout = caught, None
    agree_or_raise(error, group)
    if len(_LAYOUTS) > 64:
        _LAYOUTS.clear()
    _LAYOUTS[key] = layout
    return layout


def merge(gathered: list, world: int, what: str = "module") -> ModuleLayout:
    """Every rank's entries → one ModuleLayout (pure: the same on every rank)."""
    order: list[str] = []
    seen: dict[str, tuple] = {}
    meshes: dict[str, dict] = {}
    for rank, entries in enumerate(gathered):
        for name, kind, shape, dtype, states, spec in entries:
            facts = (kind, shape, dtype, states)
            if name not in seen:
                seen[name] = facts
                order.append(name)
                meshes[name] = {}
            elif seen[name] != facts:
                raise InteropError(f"ranks disagree on {name} of the {what}: {_facts(seen[name])} on one, "
                                   f"{_facts(facts)} on rank {rank}", name=name, rank=rank)
            ranks, mesh_shape, names, placements, _ = spec
            meshes[name].setdefault(ranks, (mesh_shape, names, placements))
    tensors = []
    for name in order:
        kind, shape, dtype, states = seen[name]
        dims, gpus, placements = _one_mesh(name, meshes[name])
        tensors.append(TensorLayout(name, kind, shape, dtype, dims, gpus, placements, states))
    return ModuleLayout(world, tuple(tensors))


def _facts(facts: tuple) -> str:
    kind, shape, dtype, states = facts
    return f"{kind} {list(shape)} {dtype}" + (f" with {', '.join(states)}" if states else "")


def _one_mesh(name: str, submeshes: dict) -> tuple:
    """The sub-meshes the ranks holding `name` see, as one mesh: alike and disjoint ones
    stacked under an outer replicating `rep` dimension."""
    items = sorted(submeshes.items(), key=lambda item: min(item[0]))
    (first_ranks, (shape, names, placements)) = items[0]
    used: set[int] = set()
    for ranks, (other_shape, other_names, other_placements) in items:
        if (other_shape, other_placements) != (shape, placements):
            raise InteropError(f"{name} is split differently on different ranks ({_text(placements)} over "
                               f"{list(shape)} and {_text(other_placements)} over {list(other_shape)})", name=name)
        if used & set(ranks):
            raise InteropError(f"{name} lives on overlapping meshes that differ", name=name)
        used |= set(ranks)
    dims = tuple(zip(names, shape))
    if len(items) == 1 and dims:
        return dims, first_ranks, placements
    rep = "rep" if "rep" not in names else "rep_"
    gpus = tuple(r for ranks, _ in items for r in ranks)
    return ((rep, len(items)),) + dims, gpus, (DimPlacement("replicate"),) + placements


def _text(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def check_local(layout: ModuleLayout, entries: list, rank: int) -> None:
    """Every local tensor of this rank has the shape its boxes in `layout` give (the IR's
    arithmetic agrees with DTensor's on this rank)."""
    by_name = layout.by_name()
    for name, kind, shape, dtype, states, spec, local_shape in entries:
        t = by_name[name]
        boxes = rank_boxes(t, rank)
        expected = _stacked_shape(shape, boxes)
        if tuple(local_shape) != expected and not (not boxes and 0 in local_shape):
            raise InteropError(f"{name} on rank {rank} is {list(local_shape)} locally, but its placements "
                               f"{_text(t.placements)} give {list(expected)}", name=name, rank=rank,
                               hint="a layout Nereus does not read right: please report it with the placements")


def rank_boxes(t: TensorLayout, rank: int) -> tuple:
    """The boxes of `t` on `rank` (stacked along dim 0 in local order), () when it holds none."""
    if rank not in t.gpus:
        return ()
    index = t.gpus.index(rank)
    coord = []
    for _, size in reversed(t.dims):
        index, c = divmod(index, size)
        coord.append(c)
    try:
        return shard_boxes(t.shape, tuple(s for _, s in t.dims), tuple(reversed(coord)), t.placements)
    except StridedLayoutError as error:
        raise InteropError(f"{t.name}: {error}; Nereus stacks a shard's parts along dim 0 only", name=t.name,
                           rank=rank) from None


def _stacked_shape(shape: tuple[int, ...], boxes: tuple) -> tuple[int, ...]:
    if not boxes:
        return ()
    rows = sum(b[0][1] - b[0][0] for b in boxes) if shape else 0
    return (rows,) + tuple(hi - lo for lo, hi in boxes[0][1:]) if shape else ()


def optimizer_scalars(model, optim) -> dict[str, dict]:
    """{parameter name: {state key: scalar}} of this rank's optimizer (the Adam step)."""
    if optim is None:
        return {}
    return {name: _optimizer_states(optim, p, name, -1)[1] for name, p in model.named_parameters()
            if p in optim.state}


def buffers_of(model) -> dict[str, torch.Tensor]:
    """Plain (non-DTensor) buffers, persistent or not, by name."""
    return {name: b for name, b in model.named_buffers() if not is_dtensor(b)}

