"""Weight-sync codec programs (docs/program.md, "Weight-sync codecs"): the quantize and
delta passes, and what the verifier proves of them (nereus.passes.verify_codec).

The model below has q = 256, kv = 128 rows: a training split of tp 4 cuts every 128-row
block of the fused qkv (64 q rows per rank), so an FP8 generation layout on one GPU needs
the amax exchange; tp 2 on both sides does not (blocks and splits aligned)."""

from __future__ import annotations

import copy

import pytest

import nereus.ir as ir
from nereus.ir.diagnostics import ProgramError
from nereus.passes.verify import verify_program
from nereus.runtime.vllm_sync import compile_weight_sync

SOURCE = """cluster c {
  nodes 1
  gpus_per_node 4
  gpu { mem 1GB flops 1TFLOPS hbm 100GB/s }
  intra 10GB/s
  inter 1GB/s
  host_mem 16GB
}
model actor = llama { layers 2 hidden 256 heads 4 kv_heads 2 ffn 384 vocab 64 dtype bf16 }
workload w {
  batch 8 prompt 8 response 8 microbatch 4
  generation: actor
  training: actor
}
plan CUT {
  actor.generation dp 1 tp 1 on 3 quant fp8
  actor.training dp 1 tp 4 on 0..3
}
plan ALIGNED {
  actor.generation dp 1 tp 2 on 2, 3 quant fp8
  actor.training dp 1 tp 2 on 0, 1
}
plan SAME {
  actor.generation dp 1 tp 4 on 0..3 quant fp8
  actor.training dp 1 tp 4 on 0..3
}
plan DENSE {
  actor.generation dp 1 tp 1 on 3
  actor.training dp 1 tp 4 on 0..3
}
"""


@pytest.fixture(scope="module")
def module():
    return ir.parse_source(SOURCE)


def _ops(program, kind):
    return [(k, i, op) for k, rnd in enumerate(program["rounds"]) for i, op in enumerate(rnd["ops"]) if op["op"] == kind]


def test_fp8_sync_verifies_and_moves_about_half_the_bf16_bytes(module):
    dense = compile_weight_sync(module, "DENSE")
    fp8 = compile_weight_sync(module, "CUT")
    assert fp8["quant"]["tensors"] and fp8["quant"]["block"] == [128, 128]
    sent = lambda p: sum(op["bytes"] for _, _, op in _ops(p, "send"))  # noqa: E731
    report = verify_program(fp8)
    assert report.bytes_moved == sent(fp8) + sum(op["bytes"] for _, _, op in _ops(fp8, "copy"))
    # embed, norms and the head stay bf16: the ratio is above one half, the linear layers at ~0.5
    assert 0.5 < sent(fp8) / sent(dense) < 0.6


def test_amax_ops_only_where_a_training_split_cuts_a_block(module):
    cut, aligned = compile_weight_sync(module, "CUT"), compile_weight_sync(module, "ALIGNED")
    assert not _ops(aligned, "amax")
    amax = _ops(cut, "amax")
    assert amax and all(k == 0 for k, _, _ in amax)
    pairs = {(op["src"], op["dst"]) for _, _, op in amax}
    assert pairs == {(b, a) for a, b in pairs}  # each writer of a cut block tells every other one
    # 64 q rows per training rank: each 128-row q block of every layer is cut between two ranks
    cut_q = {(e["tensor"], tuple(e["block"])) for _, _, op in amax for e in op["entries"]
             if e["tensor"].endswith("attn.qkv.weight") and e["block"][0] < 2}
    assert len(cut_q) == 2 * 2 * 2  # 2 layers x 2 q block rows x 2 block columns
    verify_program(aligned)


def test_keeps_of_quantized_weights_become_copies(module):
    same = compile_weight_sync(module, "SAME")
    quantized = set(same["quant"]["tensors"])
    kept = {s["tensor"] for _, _, op in _ops(same, "keep") for s in op["segments"]}
    copied = {s["tensor"] for _, _, op in _ops(same, "copy") for s in op["segments"]}
    assert quantized <= copied and not quantized & kept
    assert kept  # the norms are still handed over in place
    verify_program(same)


def test_a_missing_amax_op_is_refused(module):
    """An FP8 program whose block straddles the senders' shards without the extra move."""
    program = compile_weight_sync(module, "CUT")
    k, i, op = _ops(program, "amax")[0]
    del program["rounds"][k]["ops"][i]
    with pytest.raises(ProgramError, match=r"block \(\d+, \d+\) of .* is written by GPUs \[.*\], and GPU \d "
                                           r"never learns local rows"):
        verify_program(program)


def test_an_amax_part_that_leaves_out_rows_is_refused(module):
    program = compile_weight_sync(module, "CUT")
    _, _, op = _ops(program, "amax")[0]
    box = op["entries"][0]["parts"][0]["box"]
    box[0][1] -= 1  # one row of the sender's part missing: the receiver's view of the block has a hole
    with pytest.raises(ProgramError, match="never learns local rows"):
        verify_program(program)


@pytest.mark.parametrize("edit, message", [
    (lambda op: op["entries"][0]["parts"][0].update(box=[[0, 1], [0, 300]]), "is not a box of"),
    (lambda op: op.update(bytes=op["bytes"] + 4), "fp32 maxima"),
    (lambda op: op["entries"][0].update(block=[9, 0]), "is not in the"),
])
def test_malformed_amax_ops_are_located(module, edit, message):
    program = compile_weight_sync(module, "CUT")
    k, i, op = _ops(program, "amax")[0]
    edit(op)
    with pytest.raises(ProgramError, match=rf"round {k}, op {i} \(amax\).*{message}"):
        verify_program(program)


def test_quantized_byte_counts_are_checked(module):
    program = compile_weight_sync(module, "CUT")
    k, i, op = _ops(program, "send")[0]
    op["bytes"] += 1
    with pytest.raises(ProgramError, match=rf"round {k}, op {i} \(send\): declares .* quantized"):
        verify_program(program)


def test_a_keep_of_a_quantized_weight_is_refused(module):
    program = compile_weight_sync(module, "SAME")
    k, i, op = _ops(program, "copy")[0]
    quantized = set(program["quant"]["tensors"])
    name = next(s["tensor"] for s in op["segments"] if s["tensor"] in quantized)
    moved = [s for s in op["segments"] if s["tensor"] == name]  # the whole shard (every box): a keep's form
    op["segments"] = [s for s in op["segments"] if s["tensor"] != name]
    program["rounds"][k]["ops"].insert(i, {"op": "keep", "gpu": op["gpu"], "segments": moved,
                                           "id": 10 ** 6, "round": k})
    # the copy's bytes and the allocation are then re-declared, so the keep is what is caught
    from nereus.passes.quantize import Sizes, shard_index

    sizes = Sizes({t["name"]: t for t in program["tensors"]}, shard_index(program["units"]["after"]), quantized, 128)
    op["bytes"] = sum(sizes.segment(s, op["gpu"]) for s in op["segments"])
    for _, _, free in _ops(program, "free"):  # the kept bytes are no longer freed
        if free["gpu"] == op["gpu"] and free["unit"] == moved[0]["src_unit"]:
            free["bytes"] -= sum(sizes.dense_segment(s) for s in moved)
    with pytest.raises(ProgramError, match="keeps .* which the after unit holds quantized"):
        verify_program(program)


def _drop_one_element(program):
    """The first send's first 2-D segment with one element cut out (its box split in two:
    every row but the last whole, the last row short by one column); bytes re-declared."""
    k, i, op = _ops(program, "send")[0]
    j, seg = next((j, s) for j, s in enumerate(op["segments"]) if len(s["box"]) == 2 and s["box"][0][1] -
                  s["box"][0][0] > 1 and s["box"][1][1] - s["box"][1][0] > 1)
    (r0, r1), (c0, c1) = seg["box"]
    rows = dict(seg, box=[[r0, r1 - 1], [c0, c1]])
    last = dict(seg, box=[[r1 - 1, r1], [c0, c1 - 1]])
    op["segments"][j:j + 1] = [rows, last]
    element = {"bf16": 2, "fp32": 4}[next(t["dtype"] for t in program["tensors"] if t["name"] == seg["tensor"])]
    op["bytes"] -= element
    return seg["tensor"]


def test_a_delta_program_missing_one_element_is_refused(module):
    program = compile_weight_sync(module, "DENSE", mode="delta")
    assert program["delta"]["chunk"] and all(op["encoding"] == "delta" for _, _, op in _ops(program, "send"))
    verify_program(program)
    name = _drop_one_element(program)
    with pytest.raises(ProgramError, match=rf"{name} has (\d+) of \1\d* elements written|{name} has \d+ of \d+ "
                                           "elements written"):
        verify_program(program)


def test_delta_references_and_buffers_count_against_memory(module):
    """The dense program fits a capacity that the delta one (references kept between runs,
    encoded buffers beside the packed ones) does not."""
    dense = compile_weight_sync(module, "DENSE")
    delta = compile_weight_sync(module, "DENSE", mode="delta")
    peak = verify_program(dense).peak_bytes[3]
    assert verify_program(delta).peak_bytes[3] > peak
    for program in (dense, delta):
        for gpu in program["gpus"]:
            gpu["capacity_bytes"] = peak
    verify_program(dense)
    with pytest.raises(ProgramError, match="needs .* capacity"):
        verify_program(delta)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.pop("delta"), "a delta send in a program without header field 'delta'"),
    (lambda p: p["delta"].update(chunk=1000), "header field 'delta': delta chunk 1000 is not a power of two"),
    (lambda p: _ops(p, "send")[0][2].update(encoding="zstd"), "unknown encoding 'zstd'"),
])
def test_malformed_delta_fields_are_located(module, edit, message):
    program = compile_weight_sync(module, "DENSE", mode="delta")
    edit(program)
    with pytest.raises(ProgramError, match=message):
        verify_program(program)


def test_codec_fields_are_known_fields(module):
    for program in (compile_weight_sync(module, "CUT", mode="delta"), copy.deepcopy(compile_weight_sync(module, "SAME"))):
        assert verify_program(program).warnings == ()
