"""Which weights a `quant fp8` generation layout holds in FP8, and the format's constants
(no torch: the compiler reads them).

FP8 here is e4m3 (`float8_e4m3fn`: largest finite value 448) with one fp32 scale per
BLOCK x BLOCK block of a 2-D weight, the block-FP8 layout of DeepSeek-V3 and vLLM
(`weight_block_size: [128, 128]`): value = fp8 code x scale, scale = amax(|block|) / 448
(1 for an all-zero block). Quantized are the dense linear layers of every layer (the
tensors the forward multiplies by activations: fused qkv, o, fused gate_up, down);
embeddings, norms, biases, the lm/value head and a MoE model's experts and router keep the
model's dtype, as DeepSeek-V3's and vLLM's FP8 checkpoints keep embeddings, norms and
heads.
"""

from __future__ import annotations

import re

from nereus.ir.model import Model

from .tensors import tensor_table

BLOCK = 128
E4M3_MAX = 448.0
FORMAT = "fp8_e4m3"  # the JSON program's name of the format (docs/program.md)
SCALE_BYTES = 4  # fp32
_LINEAR = re.compile(r"layers\.[0-9]+\.(attn\.qkv|attn\.o|mlp\.gate_up|mlp\.down)\.weight")


def is_quantized(local_name: str) -> bool:
    """True for a weight (local name, no `{model}/` prefix) that a `quant fp8` layout holds in FP8."""
    return _LINEAR.fullmatch(local_name) is not None


def quantized_names(model: Model) -> tuple[str, ...]:
    """The global names (`{model}/{local}`) of `model`'s FP8 weights, in table order."""
    return tuple(f"{model.name}/{spec.name}" for spec in tensor_table(model)
                 if len(spec.shape) == 2 and is_quantized(spec.name))


def blocks(rows: int, cols: int, block: int = BLOCK) -> tuple[int, int]:
    """The scale grid of a rows x cols local tensor: (block rows, block columns)."""
    return -(-rows // block), -(-cols // block)
