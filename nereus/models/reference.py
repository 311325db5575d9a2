"""The single-process reference forward: an HF state dict and token ids → logits.

Input: a Model (any family), its weights under transformers' names (e.g. a
LlamaForCausalLM's `state_dict()` or the tensors of its safetensors files) and token ids
[B, T]. Output: logits [B, T, vocab] in fp32 on the CPU (values [B, T] for `head value`).
Invariant (tests/models/test_reference_numerics.py): equal to transformers' logits
within 1e-4 for each family; the distributed forward (llama.py over TP groups and the RL
pipeline) computes the same function on shards.

It runs the family's own forward at tp = 1 (every collective a no-op) on fp32 copies, so
it checks the code the RL loop runs rather than a second implementation.
"""

from __future__ import annotations

import torch

from nereus.ir.model import Model

from .hf import hf_to_nereus
from .parallel import TpGroup
from .tensors import family


@torch.no_grad()
def logits(model: Model, hf_state_dict: dict, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, vocab] (fp32, CPU) of `input_ids` [B, T] under `model` with the
    weights of `hf_state_dict` (transformers' names). Raises NereusError for a missing,
    unknown or mis-shaped weight."""
    prefix = f"{model.name}/"
    weights = {name[len(prefix):]: tensor.detach().to("cpu", torch.float32)
               for name, tensor in hf_to_nereus(model, hf_state_dict).items()}
    forward = family(model)
    tp = TpGroup()
    hidden = forward.hidden_states(model, weights, input_ids.to("cpu"), tp)
    if model.head == "value":
        return forward.values(weights, hidden)
    return forward.local_logits(weights, hidden, tp)
