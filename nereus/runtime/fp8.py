"""Block-FP8 quantization of one piece of a weight sync (docs/program.md, "Weight-sync
codecs"; the format in nereus.models.quant).

A piece is a 2-D region of a source shard that lands at local rows [r0, r0 + h) and
columns [c0, c0 + w) of a quantized receiving shard. The receiver's blocks (B x B from
its local origin, nereus.ir.scale_blocks) that the piece meets form a grid of
ti x tj blocks starting at block (r0 // B, c0 // B). `quantize(x, r0, c0, block, given)`
returns the piece's e4m3 codes (uint8, the piece's shape) and the scale of every block it
meets: amax(|block|) / 448 (1 for an all-zero block), the amax taken from the piece where
`given` says -1 (the block lies wholly in the piece) and from `given` otherwise (the
block's amax over all its writers: the sender's own pieces and the amax ops it received).
Division and rounding are IEEE round-to-nearest-even in both implementations, and codes
saturate at +-448, so the torch path (CPU) and the Triton kernel (CUDA,
nereus.backends.triton.fp8) give the same bytes.
"""

from __future__ import annotations

from typing import Optional

import torch

from nereus.models.quant import BLOCK, E4M3_MAX

FP8 = torch.float8_e4m3fn


def grid_of(r0: int, c0: int, h: int, w: int, block: int = BLOCK) -> tuple[int, int]:
    """(ti, tj): the blocks a piece at (r0, c0) of shape (h, w) meets."""
    return -(-(r0 % block + h) // block), -(-(c0 % block + w) // block)


def quantize(x: torch.Tensor, r0: int, c0: int, block: int = BLOCK, given: Optional[torch.Tensor] = None,
             codes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. `codes`: an out tensor (uint8, x's shape, rows contiguous)."""
    if x.is_cuda:
        from nereus.backends.triton.fp8 import quantize as kernel

        return kernel(x, r0, c0, block, given, codes)
    h, w = x.shape
    ti, tj = grid_of(r0, c0, h, w, block)
    pr, pc = r0 % block, c0 % block
    values = x.float()
    padded = torch.zeros(ti * block, tj * block, dtype=torch.float32, device=x.device)
    padded[pr:pr + h, pc:pc + w] = values.abs()
    amax = padded.view(ti, block, tj, block).amax(dim=(1, 3))
    if given is not None:
        amax = torch.where(given >= 0, given, amax)
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    expanded = scales.repeat_interleave(block, 0).repeat_interleave(block, 1)[pr:pr + h, pc:pc + w]
    out = (values / expanded).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).view(torch.uint8)
    if codes is not None:
        codes.copy_(out)
        out = codes
    return out, scales


def block_amax(x: torch.Tensor, r0: int, c0: int, block: int = BLOCK) -> torch.Tensor:
    """amax(|x|) of the piece's part of each block it meets ([ti, tj] fp32)."""
    h, w = x.shape
    ti, tj = grid_of(r0, c0, h, w, block)
    pr, pc = r0 % block, c0 % block
    padded = torch.zeros(ti * block, tj * block, dtype=torch.float32, device=x.device)
    padded[pr:pr + h, pc:pc + w] = x.float().abs()
    return padded.view(ti, block, tj, block).amax(dim=(1, 3))
