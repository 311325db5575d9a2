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

from nereus.ir.diagnostics import NereusError
from nereus.ir.model import Model

from .hf import hf_to_nereus
from .parallel import TpGroup
from .tensors import family


@torch.no_grad()
def logits(model: Model, hf_state_dict: dict, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits [B, T, vocab] (fp32, CPU) of `input_ids` [B, T] under `model` with the
    weights of `hf_state_dict` (transformers' names). Raises NereusError for a missing,
    unknown or mis-shaped weight."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        got = f"shape {list(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise NereusError(f"input_ids must be a [batch, tokens] tensor of token ids, got {got}",
                          hint="one row of ids per sequence, e.g. torch.tensor([[1, 2, 3]])")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise NereusError(f"input_ids must be a [batch, tokens] tensor of token ids, got {input_ids.dtype}",
                          hint="token ids are integers (torch.long)")
    if input_ids.numel():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= model.vocab:
            raise NereusError(f"input_ids holds {low if low < 0 else high}, outside the vocabulary "
                              f"[0, {model.vocab}) of {model.name}", hint="tokenize with the model's own tokenizer")
    prefix = f"{model.name}/"
    weights = {name[len(prefix):]: tensor.detach().to("cpu", torch.float32)
               for name, tensor in hf_to_nereus(model, hf_state_dict).items()}
    forward = family(model)
    tp = TpGroup()
    hidden = forward.hidden_states(model, weights, input_ids.to("cpu"), tp)
    if model.head == "value":
        return forward.values(weights, hidden)
    return forward.local_logits(weights, hidden, tp)
