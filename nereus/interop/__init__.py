"""Bring your own model: PyTorch modules (FSDP2, tensor parallelism, both) and Nereus.

    from nereus.interop import reshard_module, layout_of, placements_for

    report = reshard_module(src_model, src_optim, dst_model, dst_optim)  # collective
    text = layout_of(model, optim)                     # the module's layout as .nir text
    spec = placements_for("plan.nir", "S2", "actor.training")  # a Nereus plan as DTensor placements

An adapter layer: it reads DTensor layouts into the IR (`tensors` models, mesh layouts)
and hands the compiler and the runtime what they already take; neither imports it.
docs/interop.md is the reference.
"""

from .errors import InteropError
from .reshard import ReshardReport, reshard_module


def layout_of(model, optim=None, *, plan: str = "current", name: str = "module") -> str:
    """Collective: `model`'s layout (and its optimizer states') as a `.nir` module with one
    plan, `plan`, that `nereusc check` reads and any other layout of the same module can
    join as another plan."""
    import torch.distributed as dist

    import torch

    from .layouts import module_layout
    from .nir import module_text
    from .reshard import _device, _free_bytes, _gloo, _local_bytes, _machine

    layout = module_layout(model, optim, _gloo(), name)
    room = torch.tensor([_free_bytes(_device()) + sum(_local_bytes(model, optim))], dtype=torch.int64)
    dist.all_reduce(room, op=dist.ReduceOp.MIN, group=_gloo())
    return module_text({plan: layout}, _machine(int(room.item()), dist.get_world_size()), name)


def placements_for(plan_file, plan: str, model_stage: str):
    """A Nereus plan's placement of an architecture model as DTensor placements of its
    Hugging Face parameters (nereus.interop.placements)."""
    from .placements import placements_for as find

    return find(plan_file, plan, model_stage)


__all__ = ["InteropError", "ReshardReport", "layout_of", "placements_for", "reshard_module"]
