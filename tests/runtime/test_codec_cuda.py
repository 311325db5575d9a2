"""The weight-sync codecs on a CUDA device (CUDA only; the lead's GPU runs): the delta
kernels against the torch code on the CPU (the payload's chunk order may differ: a chunk
takes its place by an atomic add; sizes, directory forms and counts, checksums and the
decoded bytes may not), the FP8 quantize kernel byte for byte against the CPU, the FP8
linear path, and a one-process FP8 weight sync (same-GPU quantized copies) against the
torch quantization of the generation shards."""

from __future__ import annotations

import pytest
import torch

from nereus.runtime import delta_codec, fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ONE_GPU = """cluster c {
  nodes 1
  gpus_per_node 1
  gpu { mem 80GB flops 989TFLOPS hbm 3.35TB/s }
  intra 450GB/s
  inter 50GB/s
  host_mem 1TB
}
model actor = llama { layers 2 hidden 256 heads 4 kv_heads 2 ffn 320 vocab 64 dtype bf16 }
workload w {
  batch 8 prompt 8 response 8 microbatch 4
  generation: actor
  training: actor
}
plan Q {
  actor.generation dp 1 tp 1 on 0 quant fp8
  actor.training dp 1 tp 1 on 0
}
"""


@pytest.mark.parametrize("word", [1, 2, 4])
@pytest.mark.parametrize("changed", [0.0, 0.003, 0.05, 0.7])
def test_delta_kernels_agree_with_the_cpu_code(word, changed):
    gen = torch.Generator().manual_seed(int(changed * 1000) + word)
    n = (3 << 20) // word + 77
    old = torch.randint(-100, 100, (n,), generator=gen, dtype=torch.int32).to(delta_codec.WORDS[word])
    new = old.clone()
    where = torch.rand(n, generator=gen) < changed
    new[where] += 1
    cpu_head, cpu_payload = delta_codec.encode(new.view(torch.uint8).clone(), old.view(torch.uint8).clone(), word)
    ref = old.view(torch.uint8).cuda()
    head, payload = delta_codec.encode(new.view(torch.uint8).cuda(), ref, word)
    assert torch.equal(ref.cpu(), new.view(torch.uint8))
    assert delta_codec.header_of(head) == delta_codec.header_of(cpu_head)
    directory = lambda h: h[delta_codec.HEADER_BYTES:].view(torch.int32).view(-1, 2)[:, 1].cpu()  # noqa: E731
    assert torch.equal(directory(head), directory(cpu_head))  # counts and forms; offsets may differ
    total = delta_codec.header_of(head)[0]
    dst = old.view(torch.uint8).cuda()
    sums = delta_codec.decode(dst, head, payload[:total], word)
    assert torch.equal(dst.cpu(), new.view(torch.uint8)) and sums == delta_codec.header_of(cpu_head)[1:3]


def test_fp8_quantize_kernel_is_byte_exact_against_the_cpu():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(1000, 1300, generator=gen) * 0.03).to(torch.bfloat16)
    for r0, c0 in ((0, 0), (64, 100)):
        codes, scales = fp8.quantize(x[3:900, 5:1200], r0, c0, 128)
        got_codes, got_scales = fp8.quantize(x.cuda()[3:900, 5:1200], r0, c0, 128)
        assert torch.equal(got_scales.cpu(), scales) and torch.equal(got_codes.cpu(), codes)
    # a wide dynamic range within each block: e4m3 subnormals, codes that round to 0, the
    # saturation bound, ties and signed zeros (the GPU's own conversion on sm_89+)
    wide = (torch.randn(512, 640, generator=gen) * torch.exp(3 * torch.randn(512, 640, generator=gen))).to(torch.bfloat16)
    wide[0, :8] = torch.tensor([0.0, -0.0, 448.0, -448.0, 1e-30, -3e-7, 0.0117, 31.8], dtype=torch.bfloat16)
    wide[128:256, :128] = (torch.randn(128, 128, generator=gen) * 1e-38).to(torch.bfloat16)  # a subnormal scale
    wide[256:384, :128] = 0.0  # an all-zero block (scale 1)
    codes, scales = fp8.quantize(wide, 0, 0, 128)
    got_codes, got_scales = fp8.quantize(wide.cuda(), 0, 0, 128)
    assert torch.equal(got_scales.cpu(), scales)
    assert int((got_codes.cpu() != codes).sum()) == 0


def test_fp8_linear_on_the_gpu():
    from nereus.models.fp8 import PATHS, Fp8Weight, linear

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1024, generator=gen).to("cuda", torch.bfloat16)
    codes, scales = fp8.quantize((torch.randn(512, 1024, generator=gen) * 0.02).cuda(), 0, 0, 128)
    w = Fp8Weight(codes.view(torch.float8_e4m3fn), scales)
    PATHS.clear()
    got = linear(x, w).float()
    want = x.float() @ w.dequantize(torch.float32).t()
    assert sum(PATHS.values()) == 1
    # blockwise scaled_mm quantizes the activations too (1 x 128 groups): e4m3's error
    assert float((got - want).abs().max() / want.abs().max()) < 0.06


def test_one_process_fp8_sync_on_the_gpu():
    import nereus.ir as ir
    from nereus.backends.json_program import plan_units_json
    from nereus.models import tensor_table
    from nereus.models.quant import quantized_names
    from nereus.runtime.state import shard_unit, unit_on_gpu
    from nereus.runtime.vllm_sync import WeightSync

    from runtime_helpers import single_process_control

    module = ir.parse_source(ONE_GPU)
    control = single_process_control()
    gen = torch.Generator().manual_seed(2)
    full = {f"actor/{s.name}": (torch.randn(s.shape, generator=gen) * 0.05).to("cuda", torch.bfloat16)
            for s in tensor_table(module.model("actor"))}
    unit = unit_on_gpu(plan_units_json(module, "Q", "actor.training"), 0)
    unit = dict(unit, shards=[s for s in unit["shards"] if "#" not in s["tensor"]])
    sync = WeightSync(module, device=torch.device("cuda"), control=control)
    got = sync.run("Q", shard_unit(unit, 0, full)).weights
    expected = shard_unit(unit_on_gpu(plan_units_json(module, "Q", "actor.generation"), 0), 0, full)
    quantized = set(quantized_names(module.model("actor")))
    for name, tensor in expected.items():
        if name in quantized:
            codes, scales = fp8.quantize(tensor.cpu(), 0, 0, 128)
            assert torch.equal(got[name].codes.view(torch.uint8).cpu(), codes) and torch.equal(
                got[name].scales.cpu(), scales), name
        else:
            assert torch.equal(got[name], tensor), name
