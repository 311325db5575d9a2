"""The device memory model (nereus.passes.memory_model) in the compiler and the verifier.

On CUDA a send out of a shard staged or offloaded to host memory takes device memory on
its source GPU too (ring slots, pieces copied up whole): the "cuda" model, which the
compiler compiles for and the program records in its header (`memory_model`), charges
it; "cpu", the model of v1 programs before the field, does not. The tight swap plan of
tests/data/swap-staging.nir (two models trading GPUs, the cycle broken by host staging)
shows the difference: its cpu-model program needs more than a GPU holds once the
source's buffers count."""

from __future__ import annotations

import json
import pathlib
from dataclasses import replace

import pytest
from click.testing import CliRunner

import nereus.ir as ir
from nereus.backends.json_program import program_json
from nereus.backends.rank_json import rank_program_json, split_by_rank
from nereus.cli import nereusc
from nereus.ir.diagnostics import ProgramError, SemanticError
from nereus.passes import compile_transition
from nereus.passes.memory_model import packed, xfer_padding
from nereus.passes.verify import verify_program

SWAP = pathlib.Path(__file__).resolve().parents[1] / "data" / "swap-staging.nir"
# odd shapes: 36-byte rows, tensors whose bytes are no multiple of 8 (the packed layout pads)
ODD = SWAP.with_name("swap-odd.nir")


def _swap(memory_model: str):
    return compile_transition(ir.parse_file(str(SWAP)), "A", "B", memory_model=memory_model)


def test_the_swaps_cpu_model_program_does_not_fit_a_gpu_once_the_sources_buffers_count():
    old = program_json(_swap("cpu"))
    assert old["memory_model"] == "cpu"
    assert verify_program(old).worst_fraction < 0.9  # what the old model proves
    with pytest.raises(ProgramError, match=r"round 1, .*: GPU 0 needs 2\.2 MiB, capacity 1\.9 MiB \(over by"):
        verify_program(dict(old, memory_model="cuda"))


def test_the_compiler_schedules_the_buffers_of_sends_out_of_staged_shards():
    compiled = _swap("cuda")
    program = program_json(compiled)
    assert program["memory_model"] == "cuda" and compiled.summary["peak_memory"]["memory_model"] == "cuda"
    report = verify_program(program)
    assert report.memory_model == "cuda" and report.warnings == ()
    peak = compiled.summary["peak_memory"]
    assert report.peak_bytes[peak["gpu"]] == peak["bytes"] == max(report.peak_bytes.values())
    assert peak["fraction"] <= 1.0
    staged = {op["unit"] for rnd in program["rounds"] for op in rnd["ops"] if op["op"] == "stage_out"}
    assert staged  # still a cycle broken through host memory, its sends cut to fit the sources
    old = _swap("cpu")
    assert compiled.program.num_rounds > old.program.num_rounds
    assert compiled.summary["bytes"] == old.summary["bytes"]


def test_a_program_without_the_field_is_proven_with_v1s_model():
    old = program_json(_swap("cpu"))
    before_the_field = {k: v for k, v in old.items() if k != "memory_model"}
    report = verify_program(before_the_field)
    assert report.memory_model == "cpu" and report.peak_bytes == verify_program(old).peak_bytes
    assert report.warnings == ()
    assert "(cpu memory model)" in str(report)


@pytest.mark.parametrize("value", ["tpu", 1, None])
def test_an_unknown_memory_model_is_an_error_naming_the_field(value):
    program = dict(program_json(_swap("cuda")), memory_model=value)
    with pytest.raises(ProgramError, match="header field 'memory_model' must be one of 'cuda', 'cpu'"):
        verify_program(program)


def test_verify_cli_names_the_model_and_rejects_the_old_program_relabelled(tmp_path):
    old = program_json(_swap("cpu"))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(dict(old, memory_model="cuda")))
    out = CliRunner().invoke(nereusc, ["verify", str(path)])
    assert out.exit_code == 2 and "GPU 0 needs 2.2 MiB" in out.output, out.output
    path.write_text(json.dumps(program_json(_swap("cuda"))))
    out = CliRunner().invoke(nereusc, ["verify", str(path)])
    assert out.exit_code == 0 and "(cuda memory model)" in out.output, out.output


def test_nereusc_compiles_for_cuda_unless_told_and_records_it(tmp_path):
    runner = CliRunner()
    for flags, want in (([], "cuda"), (["--memory-model", "cpu"], "cpu")):
        path = tmp_path / f"{want}.json"
        out = runner.invoke(nereusc, [str(SWAP), "--transition", "A:B", "--emit", "json", "-o", str(path)] + flags)
        assert out.exit_code == 0, out.output
        assert json.loads(path.read_text())["memory_model"] == want
        text = runner.invoke(nereusc, [str(SWAP), "--transition", "A:B", "--emit", "summary"] + flags).output
        assert ("(cpu memory model)" in text) == (want == "cpu"), text
    out = runner.invoke(nereusc, [str(SWAP), "--memory-model", "tpu"])
    assert out.exit_code == 2 and "tpu" in out.output


def test_an_unknown_model_is_a_compile_error():
    with pytest.raises(SemanticError, match="unknown memory model 'tpu'"):
        compile_transition(ir.parse_file(str(SWAP)), "A", "B", memory_model="tpu")


def test_rank_parts_state_the_model_of_the_whole_program():
    compiled = _swap("cuda")
    whole = program_json(compiled)
    cut = split_by_rank(whole)
    for rank in (0, 1):
        assert rank_program_json(compiled, rank) == cut[rank]
        assert cut[rank]["memory_model"] == "cuda"
    old = {k: v for k, v in whole.items() if k != "memory_model"}  # a program before the field
    assert all("memory_model" not in part for part in split_by_rank(old).values())


@pytest.mark.parametrize("memory_model", ["cuda", "cpu"])
def test_a_v2_program_is_proven_with_the_peaks_of_its_v1_program(memory_model):
    """A ranged segment stands for one segment per member, each padded on its own (GPUs of
    150 kB: sends of two layers at once, one ranged segment each)."""
    module = ir.parse_file(str(ODD))
    module = replace(module, cluster=replace(module.cluster, gpu=replace(module.cluster.gpu, mem_bytes=150_000)))
    compiled = compile_transition(module, "A", "B", check_fit=False, memory_model=memory_model)
    v1, v2 = program_json(compiled, version=1), program_json(compiled, version=2)
    assert any(s["at"][0][1] - s["at"][0][0] > 1 for rnd in v2["rounds"] for op in rnd["ops"] if op["op"] == "send"
               for s in op["segments"] if "at" in s)
    assert verify_program(v2).peak_bytes == verify_program(v1).peak_bytes
    assert max(verify_program(v2).peak_bytes.values()) == compiled.summary["peak_memory"]["bytes"]


def test_padding_the_scheduler_counts_is_the_packed_layouts_of_the_segments():
    compiled = compile_transition(ir.parse_file(str(ODD)), "A", "B", check_fit=False)
    dag, program = compiled.dag, program_json(compiled, version=1)
    tensors = {t["name"]: t for t in program["tensors"]}
    size = {"bf16": 2, "fp32": 4}

    def nbytes(seg):
        n = size[tensors[seg["tensor"]]["dtype"]]
        for lo, hi in seg["box"]:
            n *= hi - lo
        return n

    for k, (rnd, messages) in enumerate(zip(program["rounds"], compiled.program.messages)):
        segments = [nbytes(s) for op in rnd["ops"] if op["op"] == "send" for s in op["segments"]]
        scheduled = sum(xfer_padding(dag, x) for m in messages for x in m.xfers)
        assert scheduled == sum(packed(n) - n for n in segments), k
    assert any(packed(n) != n for rnd in program["rounds"] for op in rnd["ops"] if op["op"] == "send"
               for n in map(nbytes, op["segments"]))
    peak = compiled.summary["peak_memory"]
    assert verify_program(program).peak_bytes[peak["gpu"]] == peak["bytes"]
