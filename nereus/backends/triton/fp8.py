"""Block-FP8 quantization of a 2-D piece: one Triton launch, one program per block.

nereus.runtime.fp8 specifies it (and is the CPU path and the reference): each program
loads the piece's part of one receiving block (B x B, rows strided, columns contiguous),
takes its amax (or the given one of a block other writers share), computes the scale
amax / 448 (IEEE division), divides (correctly rounded: IEEE, or on sm_89+ a
reciprocal and one fma correction per element), saturates at +-448, rounds to e4m3 (to
nearest even: the GPU's own conversion on sm_89 and later, else `_e4m3`) and stores the codes (uint8, rows of the piece's width) and the scale. Traffic: reads the
piece once (2 bytes an element for bf16), writes 1 byte an element and 4 per block.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .kernels import _LAUNCH_TURNS

E4M3_MAX = 448.0


@triton.jit
def _e4m3(q):
    """The e4m3fn code (uint8) of fp32 values within +-448, rounded to nearest even, in
    integer arithmetic: exact on every target (Triton's interpreter rounds 31.8 to 16
    with `.to(tl.float8e4nv)`: its mantissa carry is lost). Normal codes round the fp32
    bits at bit 20 (a carry moves into the exponent); below 2^-6 the code is the value in
    units of 2^-9, rounded (its 8 is the smallest normal, 2^-6: the two ranges meet)."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    bits = bits & 0x7FFFFFFF
    exponent = (bits >> 23) - 127
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - 960
    # below 2^-6 the shift is 21..31 (a tinier value rounds to 0 at 31 as well): int32 holds
    # the sum (significand < 2^24, half-step <= 2^30); above it the value is not used
    significand = (bits & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(14 - exponent, 1), 31)
    small = (significand + (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift
    code = tl.where(exponent >= -6, normal, small)
    return (code | sign).to(tl.uint8)


@triton.jit
def quantize_kernel(src, stride, h, w, pr, pc, given, codes, ostride, scales, tj,
                    B: tl.constexpr, GIVEN: tl.constexpr, LIMIT: tl.constexpr, HARDWARE: tl.constexpr):
    pid = tl.program_id(0)
    a = pid // tj
    b = pid - a * tj
    rows = (a * B - pr + tl.arange(0, B)).to(tl.int64)
    cols = (b * B - pc + tl.arange(0, B)).to(tl.int64)
    inside = ((rows >= 0) & (rows < h))[:, None] & ((cols >= 0) & (cols < w))[None, :]
    raw = tl.load(src + rows[:, None] * stride + cols[None, :], mask=inside, other=0.0)
    amax = tl.max(tl.max(tl.abs(raw), axis=1), axis=0).to(tl.float32)  # exact in the source dtype
    x = raw.to(tl.float32)
    if GIVEN:
        known = tl.load(given + pid)
        amax = tl.where(known >= 0, known, amax)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, LIMIT), 1.0)
    if HARDWARE and scale >= 1.1754943508222875e-38:
        # x / scale correctly rounded without a division per element (Markstein: with
        # rcp = RN(1 / scale) and q0 = RN(x * rcp) within an ulp, fma(x - q0 * scale, rcp, q0)
        # is RN(x / scale)); a normal scale keeps rcp finite, and a q0 that underflows is a
        # value far below e4m3's 2^-10, which codes to 0 either way. IEEE division (H100:
        # 0.81 vs 0.98 of the copy ceiling at 1 GiB) is kept for the interpreter, whose fma
        # is not fused, and for a subnormal scale.
        rcp = tl.math.div_rn(1.0, scale)
        q0 = x * rcp
        q = tl.fma(tl.fma(-q0, scale, x), rcp, q0)
        q = tl.where(x == 0.0, x, q)  # -0.0: the fmas' exact zero rounds to +0.0 (an H100 run coded 0x00, not 0x80)
    else:
        q = tl.math.div_rn(x, scale)
    q = tl.minimum(tl.maximum(q, -LIMIT), LIMIT)
    if HARDWARE:  # cvt.rn.satfinite.e4m3x2.f32 (sm_89+): the same round-to-nearest-even code
        out = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        out = _e4m3(q)
    tl.store(codes + rows[:, None] * ostride + cols[None, :], out, mask=inside)
    tl.store(scales + pid, scale)


def hardware_e4m3(device) -> bool:
    """Whether the GPU converts fp32 to e4m3 itself (sm_89 and later; never under the
    interpreter, whose conversion loses the mantissa carry: `_e4m3` is used there)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize(x: torch.Tensor, r0: int, c0: int, block: int, given: Optional[torch.Tensor] = None,
             codes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """nereus.runtime.fp8.quantize on CUDA (or under TRITON_INTERPRET=1); `codes` may be a
    view with strided rows (a region of the receiving shard)."""
    h, w = x.shape
    if x.stride(1) != 1 and w > 1:
        x = x.contiguous()
    ti, tj = -(-(r0 % block + h) // block), -(-(c0 % block + w) // block)
    if codes is None:
        codes = torch.empty((h, w), dtype=torch.uint8, device=x.device)
    scales = torch.empty((ti, tj), dtype=torch.float32, device=x.device)
    if h and w:
        known = given.contiguous() if given is not None else scales
        with _LAUNCH_TURNS:
            quantize_kernel[(ti * tj,)](x, x.stride(0), h, w, r0 % block, c0 % block, known, codes, codes.stride(0),
                                        scales, tj,
                                        B=block, GIVEN=given is not None, LIMIT=E4M3_MAX,
                                        HARDWARE=hardware_e4m3(x.device), num_warps=8)
    return codes, scales
