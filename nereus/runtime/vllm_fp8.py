"""What vLLM takes from a `quant fp8` generation (docs/program.md, "Weight-sync codecs"):
the tensors of a block-FP8 checkpoint as DeepSeek-V3's are named, and its
quantization_config. Used by nereus.runtime.vllm_engine for the engine's start-up
checkpoint and for every reload; torch only, no vLLM.
"""

from __future__ import annotations

from nereus.ir.diagnostics import NereusError
from nereus.ir.model import Model
from nereus.models.fp8 import Fp8Weight

# config.json's quantization_config of a block-FP8 checkpoint (DeepSeek-V3's, which vLLM's
# fp8 method reads: e4m3 weights, `weight_scale_inv` = the scale a weight's code is multiplied by)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def fp8_hf_weights(model: Model, full: dict) -> dict:
    """Whole tensors by global Nereus name, FP8 ones as Fp8Weight → the HF names of a
    block-FP8 checkpoint: each FP8 weight's codes under its HF name and its block scales
    under `...weight_scale_inv`, fused q|k|v and gate|up split into their parts (views, no
    copy). A part must start on a block row (its rows a multiple of 128, as vLLM's block
    FP8 needs anyway): its scales are then whole rows of the fused scale grid."""
    from nereus.models.hf import hf_targets

    out = {}
    for hf, target in hf_targets(model).items():
        tensor = full[target.tensor]
        lo, hi = target.rows
        if not isinstance(tensor, Fp8Weight):
            out[hf] = tensor[lo:hi]
            continue
        block, rows = tensor.block, tensor.codes.shape[0]
        if lo % block or (hi % block and hi != rows):
            raise NereusError(f"{hf}: rows {lo}..{hi} of {target.tensor} cut a {block}-row FP8 block",
                              hint="vLLM's block FP8 needs q, k, v, gate and up rows in multiples of 128")
        out[hf] = tensor.codes[lo:hi]
        out[hf.removesuffix(".weight") + ".weight_scale_inv"] = tensor.scales[lo // block: -(-hi // block)]
    return out
