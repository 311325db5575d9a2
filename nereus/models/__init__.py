"""Model families: per architecture, one file with its tensor table, sharding rules and
forward (`llama.py`; `qwen2.py` and `qwen3.py` reuse llama's code through its flags and
document what differs); `tensors.py` holds what all families share (TensorSpec, sharding
kinds, optimizer-state names, the pipeline split) and dispatches on the architecture;
`hf.py` maps transformers' parameter names onto the tables.

    from nereus.models import tensor_table, parameter_count
    tensor_table(model)          # every weight tensor, in execution order, local names

    logits(model, hf_state_dict, input_ids)   # fp32 CPU reference forward (torch)

The tables import neither torch nor triton (the compiler reads them); each family's
forward imports torch on first use, and so does `logits` (nereus.models.reference).
"""

from .tensors import (
    COLUMN,
    FAMILIES,
    OPTIMIZER_DTYPE,
    OPTIMIZER_STATES,
    REPLICATED,
    ROW,
    VOCAB,
    FusedPart,
    TensorSpec,
    edge_tensors,
    family,
    layer_parameter_count,
    layer_tensors,
    optimizer_name,
    parameter_count,
    pp_layer_range,
    tensor_table,
)


def __getattr__(name: str):
    # `logits` needs torch: import its module on first use only, so that the compiler
    # can import this package for the tables.
    if name == "logits":
        from .reference import logits

        return logits
    raise AttributeError(f"module 'nereus.models' has no attribute {name!r}")


__all__ = [
    "COLUMN", "FAMILIES", "OPTIMIZER_DTYPE", "OPTIMIZER_STATES", "REPLICATED", "ROW", "VOCAB",
    "FusedPart", "TensorSpec", "edge_tensors", "family", "layer_parameter_count", "layer_tensors",
    "optimizer_name", "parameter_count", "pp_layer_range", "tensor_table", "logits",
]
