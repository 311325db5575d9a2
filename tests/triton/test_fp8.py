"""The block-FP8 quantize kernel (nereus.backends.triton.fp8) against the torch path of
nereus.runtime.fp8 under the interpreter: the same codes and scales, for pieces aligned
with the receiver's blocks and pieces that start and end inside blocks, with and without
given amaxes; and the format itself (scale = block amax / 448, error within e4m3's)."""

import pytest
import torch

from nereus.backends.triton import fp8 as kernels
from nereus.models.fp8 import Fp8Weight
from nereus.runtime import fp8


def _piece(h, w, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    full = (torch.randn(h + 3, w + 5, generator=gen) * 0.05).to(dtype)
    full[1, 2] = 0.9  # a large value in one block
    return full[2:2 + h, 1:1 + w]  # a strided view, as a piece of a source shard is


@pytest.mark.parametrize("r0, c0, h, w", [(0, 0, 256, 128), (64, 32, 100, 200), (127, 0, 3, 129), (0, 0, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_gives_the_torch_codes_and_scales(r0, c0, h, w, dtype):
    x = _piece(h, w, seed=h * 7 + w, dtype=dtype)
    codes_t, scales_t = fp8.quantize(x, r0, c0, 128)
    codes_k, scales_k = kernels.quantize(x, r0, c0, 128)
    assert torch.equal(scales_k, scales_t)
    assert torch.equal(codes_k, codes_t)
    given = torch.full_like(scales_t, -1.0)
    given[0, 0] = 2.0  # a block whose amax comes from its other writers
    codes_t, scales_t = fp8.quantize(x, r0, c0, 128, given)
    codes_k, scales_k = kernels.quantize(x, r0, c0, 128, given)
    assert scales_t[0, 0] == 2.0 / 448 and torch.equal(scales_k, scales_t) and torch.equal(codes_k, codes_t)


def test_codes_into_a_strided_region():
    x = _piece(130, 140, seed=3)
    out = torch.zeros(200, 300, dtype=torch.uint8)
    kernels.quantize(x, 0, 0, 128, codes=out[10:140, 20:160])
    assert torch.equal(out[10:140, 20:160], fp8.quantize(x, 0, 0, 128)[0])
    assert not out[:10].any() and not out[:, :20].any() and not out[:, 160:].any()


def test_scale_is_the_block_amax_over_448_and_the_error_is_e4m3s():
    x = _piece(256, 256, seed=11, dtype=torch.float32)
    codes, scales = fp8.quantize(x, 0, 0, 128)
    expect = x.abs().reshape(2, 128, 2, 128).amax(dim=(1, 3)) / 448
    assert torch.equal(scales, expect)
    back = Fp8Weight(codes.view(torch.float8_e4m3fn), scales).dequantize(torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal codes, and below the
    # smallest normal (2^-6 x scale) an absolute error of at most half its subnormal step
    bound = torch.maximum(x.abs() * 2 ** -4, scales.repeat_interleave(128, 0).repeat_interleave(128, 1) * 2 ** -10)
    assert ((back - x).abs() <= bound).all()


def test_rounding_to_e4m3_is_ieee_round_to_nearest_even():
    """Every e4m3 value, the midpoints between neighbours and one fp32 ulp either side,
    signed, zeros and subnormals: the kernel's integer rounding equals torch's cast (with
    scale 1: a given amax of 448)."""
    codes = torch.arange(0, 127, dtype=torch.uint8)  # 127 = 0x7f is NaN
    values = codes.view(torch.float8_e4m3fn).float()
    mids = (values[1:] + values[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids + 1), values,
                      torch.tensor([0.0, 1e-30, 2.0 ** -10, 2.0 ** -9 * 0.5, 447.99, 448.0])])
    near = torch.cat([near, -near]).reshape(1, -1)
    given = torch.tensor([[448.0]]).expand(1, -(-near.shape[1] // 128)).contiguous()
    got, scales = kernels.quantize(near, 0, 0, 128, given)
    assert (scales == 1).all()
    assert torch.equal(got, near.to(torch.float8_e4m3fn).view(torch.uint8))
