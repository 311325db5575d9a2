"""FP8 weights in the forward: `Fp8Weight` (e4m3 codes and fp32 block scales, the format of
nereus.models.quant) and `linear(x, w)`, which the llama forward uses for its linear
layers so that a generation engine can hold them in FP8.

CPU: the weight is dequantized (codes x block scale, in x's dtype) and multiplied.
CUDA: `torch.nn.functional.scaled_mm` with 1 x 128 activation scales (x quantized per
token and 128 columns, amax / 448) and the weight's 128 x 128 scales, the recipe
DeepSeek-V3 and vLLM use, on Hopper; where torch or the GPU refuses it (shapes not
multiples of 128, no blockwise kernel), the same dequantized matmul as on CPU. `PATHS`
counts which ran, for the benchmarks and tests to report.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from .quant import BLOCK, E4M3_MAX

PATHS: Counter = Counter()  # "dequantize" | "scaled_mm" -> calls


@dataclass(frozen=True)
class Fp8Weight:
    """A quantized local weight: codes [rows, cols] float8_e4m3fn, scales [ceil(rows/B),
    ceil(cols/B)] fp32 (block (i, j) covers rows iB.., columns jB..)."""

    codes: torch.Tensor
    scales: torch.Tensor
    block: int = BLOCK

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = self.codes.shape
        expanded = self.scales.repeat_interleave(self.block, 0)[:rows].repeat_interleave(self.block, 1)[:, :cols]
        return (self.codes.float() * expanded).to(dtype)

    @staticmethod
    def empty(shape: tuple, device, block: int = BLOCK) -> "Fp8Weight":
        rows, cols = shape
        return Fp8Weight(torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device),
                         torch.ones((-(-rows // block), -(-cols // block)), dtype=torch.float32, device=device), block)


def linear(x: torch.Tensor, w, bias=None) -> torch.Tensor:
    """x @ w.t() (+ bias) for a tensor (`F.linear`) or an Fp8Weight (module docstring)."""
    if not isinstance(w, Fp8Weight):
        return torch.nn.functional.linear(x, w, bias)
    out = _scaled_mm(x, w) if x.is_cuda and w.block == BLOCK else None
    if out is not None:
        PATHS["scaled_mm"] += 1
    else:
        PATHS["dequantize"] += 1
        out = x @ w.dequantize(x.dtype).t()
    return out if bias is None else out + bias


def quantize_rows(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] → (e4m3 codes, fp32 scales [M, K / block]): amax / 448 per token
    and `block` columns (K a multiple of `block`)."""
    m, k = x.shape
    groups = x.float().view(m, k // block, block)
    amax = groups.abs().amax(dim=2)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (groups / scales.unsqueeze(2)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(m, k), scales


def _scaled_mm(x: torch.Tensor, w: Fp8Weight):
    """The blockwise FP8 matmul, or None where it cannot run here."""
    scaled_mm = getattr(torch.nn.functional, "scaled_mm", None)
    ScalingType = getattr(torch.nn.functional, "ScalingType", None)
    n, k = w.codes.shape
    if scaled_mm is None or ScalingType is None or k % BLOCK or n % BLOCK:
        return None
    lead = x.shape[:-1]
    flat = x.reshape(-1, k)
    try:
        codes, scales = quantize_rows(flat)
        # torch's layouts (its meta checks): activation scales [M, K/128] with stride
        # [1, M]; weight scales [L4, N/128] with stride [1, L4], L4 = K/128 rounded up to 4
        sa = scales.t().contiguous().t()
        l4 = -(-(k // BLOCK) // 4) * 4
        padded = torch.zeros(n // BLOCK, l4, dtype=torch.float32, device=x.device)
        padded[:, :k // BLOCK] = w.scales
        out = scaled_mm(codes, w.codes.t(), sa, ScalingType.BlockWise1x128, padded.t(), ScalingType.BlockWise128x128,
                        output_dtype=x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.bfloat16)
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError):  # not on this torch/GPU
        return None
    return out.to(x.dtype).reshape(*lead, n)
