"""The `tensors` family: a model given as its tensor table (docs/ir.md, "Models given as
tensor tables").

`model policy = tensors { ... }` declares any module by its tensors' names and shapes: no
architecture, no forward, no sharding rules of its own. Its placements carry mesh layouts
(nereus.ir.mesh) that say, per tensor, how each mesh dimension splits it. The table is one
slot (slot 0, the "first" kind): the layout pass's slot machinery sees a model of no layers.
"""

from __future__ import annotations

from functools import lru_cache

from nereus.ir.mesh import Box, mesh_boxes
from nereus.ir.model import Model, Placement

from .tensors import TensorSpec

EXPLICIT = "explicit"  # a TensorSpec sharding: the placement's mesh layout gives the boxes


def layer_tensors(model: Model) -> tuple[TensorSpec, ...]:
    return ()


def edge_tensors(model: Model) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Every tensor of the table, in its canonical order, before the (absent) layers."""
    return table_specs(model), ()


@lru_cache(maxsize=64)
def table_specs(model: Model) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(t.name, t.shape, model.dtype, EXPLICIT, None, role="table") for t in model.tensors)


def placement_boxes(spec: TensorSpec, placement: Placement, rank: int) -> tuple[Box, ...]:
    """Boxes of a table tensor on the GPU at stage rank `rank` (its index in the
    placement's GPU list) of a mesh-layout placement."""
    return mesh_boxes(spec.name, spec.shape, placement, rank)
