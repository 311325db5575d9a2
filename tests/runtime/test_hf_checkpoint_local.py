"""shard_checkpoint on one process: every GPU's local tensors equal the shards of the full
state dict, for a checkpoint split over several safetensors files and for a model dtype
that differs from the checkpoint's (read, then cast)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from hf_tiny import nir, write_checkpoint  # noqa: E402

import nereus.ir as ir  # noqa: E402
from nereus.backends.json_program import plan_units_json  # noqa: E402
from nereus.models.hf import hf_to_nereus  # noqa: E402
from nereus.runtime.hf_checkpoint import shard_checkpoint  # noqa: E402
from nereus.runtime.state import shard_unit, unit_on_gpu  # noqa: E402


# the zero cases: the master is read at its own boxes (a dp chunk of the TP shard), under
# zero 3 the weight too; Adam state zeros of the chunk's shape
@pytest.mark.parametrize("name, dtype, extra, placement", [
    ("qwen2", torch.bfloat16, " { dtype fp32 }", "dp 1 tp 2 pp 2 on 3, 1, 0, 2"),
    ("qwen3", torch.float32, "", "dp 1 tp 2 pp 2 on 3, 1, 0, 2"),
    ("qwen3", torch.float32, "", "dp 2 tp 2 on 3, 1, 0, 2 zero 1"),
    ("qwen2", torch.bfloat16, " { dtype fp32 }", "dp 2 pp 2 on 0..3 zero 3")])
def test_sharded_files_and_casts(tmp_path, name, dtype, extra, placement):
    hf_model = write_checkpoint(name, tmp_path / "ckpt", dtype=dtype)
    hf_model.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")  # several files and an index
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    (tmp_path / "plan.nir").write_text(nir("ckpt", f"actor.training {placement}", extra)
                                       .replace("gpus_per_node 8", "gpus_per_node 4")
                                       .replace("inference: actor", "training: actor"))
    module = ir.parse_file(tmp_path / "plan.nir")
    model = module.model("actor")
    full = {k: v.to({"fp32": torch.float32, "bf16": torch.bfloat16}[model.dtype])
            for k, v in hf_to_nereus(model, hf_model.state_dict()).items()}
    units = plan_units_json(module, "A", "actor.training")
    for gpu in range(4):
        local = shard_checkpoint(model, ir.ModelStage("actor", "training"), unit_on_gpu(units, gpu), gpu,
                                 str(tmp_path / "ckpt"))
        states = {f"{k}#{state}": v.float() * (state == "master") for k, v in full.items()
                  for state in ("master", "exp_avg", "exp_avg_sq")}
        expected = shard_unit(unit_on_gpu(units, gpu), gpu, {**full, **states})
        assert set(local) == set(expected) | {"actor/#step"}
        for key, value in expected.items():
            assert local[key].dtype == value.dtype and torch.equal(local[key], value), key


def _load(tmp_path):
    module = ir.parse_file(tmp_path / "plan.nir")
    model = module.model("actor")
    units = plan_units_json(module, "A", "actor.inference")
    return shard_checkpoint(model, ir.ModelStage("actor", "inference"), unit_on_gpu(units, 0), 0,
                            str(tmp_path / "ckpt"))


def _rewrite(path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": t["model.layers.0.self_attn.q_proj.weight"].t()
                         .repeat(1, 2)}), "model.layers.0.self_attn.q_proj.weight has shape [64, 128], actor needs [64, 64]"),
    (lambda t: t.update({"model.norm.weight": torch.ones(2 * t["model.norm.weight"].numel())}),
     "model.norm.weight has shape [128], actor needs [64]"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}),
     "model.norm.weight is int32, not a floating-point weight"),
])
def test_a_tensor_of_another_shape_or_dtype_is_an_error(tmp_path, edit, message):
    """A file tensor larger than the model's is not cropped into it: the shape (and a
    non-float dtype) is checked against what the model needs before anything is read."""
    from safetensors.torch import load_file

    write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    edit(tensors)
    _rewrite(tmp_path / "ckpt" / "model.safetensors", tensors)
    with pytest.raises(ir.NereusError) as raised:
        _load(tmp_path)
    assert message in str(raised.value)


_SHORT = b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}'


@pytest.mark.parametrize("content, message", [
    (b"", "0 bytes, too short for a safetensors file"),
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 123\n", "exceeds the file"),
    (b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}", "the header is not valid JSON"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00[]", "the header is not a JSON object"),
    (len(_SHORT).to_bytes(8, "little") + _SHORT + bytes(8), "x spans 4 bytes, its shape [2] and dtype F32 make 8"),
])
def test_a_malformed_file_is_an_error_naming_it(tmp_path, content, message):
    write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(content)
    with pytest.raises(ir.NereusError) as raised:
        _load(tmp_path)
    assert str(tmp_path / "ckpt" / "model.safetensors") in str(raised.value) and message in str(raised.value)


def test_a_truncated_file_and_bad_indexes_are_errors_naming_them(tmp_path):
    write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    path = tmp_path / "ckpt" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ir.NereusError, match="the file ends at byte .* inside the tensor's data"):
        _load(tmp_path)
    path.unlink()  # an index is read only without a model.safetensors (transformers' order)
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    for text, message in (("{", "not valid JSON"), ("{}", "no 'weight_map'"),
                          ('{"weight_map": {"a": "model-00002.safetensors"}}', "lists model-00002.safetensors")):
        index.write_text(text)
        with pytest.raises(ir.NereusError) as raised:
            _load(tmp_path)
        assert str(index) in str(raised.value) and message in str(raised.value)


def _file_with(entries: dict, data: bytes = bytes(64)) -> bytes:
    import json

    header = json.dumps(entries).encode()
    return len(header).to_bytes(8, "little") + header + data


@pytest.mark.parametrize("entry, message", [
    ({"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}, "data_offsets must be two byte offsets"),
    ({"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}, "shape must be a list of sizes"),
    ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, "shape must be a list of sizes"),
    ({"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}, "shape must be a list of sizes"),
    ({"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}, "dtype must be one of"),
    ({"dtype": "float32", "shape": [2], "data_offsets": [0, 8]}, "dtype must be one of"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}, "data_offsets must be two byte offsets"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "data_offsets must be two byte offsets"),
])
def test_a_malformed_header_entry_is_an_error_naming_it(tmp_path, entry, message):
    """Each field of a header entry is checked before it is used: a wrong type is a
    located error (it was a TypeError), a negative or reversed span too (it read the header
    bytes as data)."""
    write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(_file_with({"x": entry}))
    with pytest.raises(ir.NereusError) as raised:
        _load(tmp_path)
    text = raised.value.format()
    assert f"{tmp_path / 'ckpt' / 'model.safetensors'}: the header entry of x: {message}" in text
    assert "hint: the file may be truncated" in text


def test_overlapping_tensors_are_an_error(tmp_path):
    write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(_file_with({
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}))
    with pytest.raises(ir.NereusError, match=r"a \[0, 16\) and b \[8, 24\) overlap"):
        _load(tmp_path)


def test_tensors_of_a_dtype_nereus_does_not_read_are_skipped_unless_needed(tmp_path):
    """A buffer in U8, BOOL or F8 that no weight maps to does not stop the load (it did);
    a needed weight in such a dtype is an error with a hint."""
    from safetensors.torch import load_file

    write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    path = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(str(path))
    before = _load(tmp_path)
    _rewrite(path, {**tensors, "some.buffer": torch.ones(3, dtype=torch.uint8),
                    "some.mask": torch.ones(2, dtype=torch.bool),
                    "some.scale": torch.ones(2).to(torch.float8_e4m3fn)})
    after = _load(tmp_path)
    assert all(torch.equal(before[k], after[k]) for k in before)
    _rewrite(path, {**tensors, "model.norm.weight": tensors["model.norm.weight"].to(torch.float8_e4m3fn)})
    with pytest.raises(ir.NereusError) as raised:
        _load(tmp_path)
    assert "model.norm.weight has dtype F8_E4M3, which Nereus does not read" in str(raised.value)
    assert raised.value.hint.startswith("Nereus reads BF16, F16, F32")


def test_model_safetensors_comes_before_an_index_as_in_transformers(tmp_path):
    """With both a model.safetensors and an index in one directory (transformers leaves an
    old index behind when it saves unsharded over a sharded checkpoint), both transformers
    and Nereus read model.safetensors: they load the same weights."""
    first = write_checkpoint("llama31", tmp_path / "ckpt", seed=1)
    first.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")
    second = write_checkpoint("llama31", tmp_path / "ckpt", seed=2)  # unsharded, over it
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    loaded = _load(tmp_path)
    model = ir.parse_file(tmp_path / "plan.nir").model("actor")
    expected = hf_to_nereus(model, second.state_dict())
    assert torch.equal(loaded["actor/final_norm.weight"], expected["actor/final_norm.weight"])


def test_missing_files_name_what_is_missing(tmp_path):
    write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    ckpt = tmp_path / "ckpt"
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    with pytest.raises(ir.NereusError) as raised:
        _load(tmp_path)
    assert "no model.safetensors.index.json listing model-00001-of-00002.safetensors" in str(raised.value)
    (ckpt / "model-00001-of-00002.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ir.NereusError) as raised:
        _load(tmp_path)
    assert "pytorch_model.bin" in str(raised.value) and "safetensors" in raised.value.hint


def test_stacked_experts_in_a_file_load_as_the_per_expert_names(tmp_path):
    """A Qwen3-MoE file with transformers 5's stacked experts (`mlp.experts.gate_up_proj`
    [E, 2F, H], `mlp.experts.down_proj` [E, H, F]: a live model's state_dict() saved with
    safetensors) loads as the per-expert checkpoint save_pretrained writes."""
    from safetensors.torch import save_file

    model_hf = write_checkpoint("qwen3_moe", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt", "actor.inference dp 1 tp 2 on 0, 1"))
    module = ir.parse_file(tmp_path / "plan.nir")
    model = module.model("actor")
    units = plan_units_json(module, "A", "actor.inference")
    per_expert = [shard_checkpoint(model, ir.ModelStage("actor", "inference"), unit_on_gpu(units, g), g,
                                   str(tmp_path / "ckpt")) for g in (0, 1)]
    state = model_hf.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "ckpt" / "model.safetensors"))
    from nereus.models.safetensors_header import checkpoint_entries, compare_with_model

    # the per-expert names listed for reading are no tensors of the file: none "unread"
    assert compare_with_model(model, checkpoint_entries(str(tmp_path / "ckpt"))) == ([], [])
    for g in (0, 1):
        stacked = shard_checkpoint(model, ir.ModelStage("actor", "inference"), unit_on_gpu(units, g), g,
                                   str(tmp_path / "ckpt"))
        assert set(stacked) == set(per_expert[g])
        assert all(torch.equal(stacked[k], per_expert[g][k]) for k in stacked)


def _nereusc(*args):
    import os
    import subprocess

    root = Path(__file__).parents[2]
    return subprocess.run([sys.executable, "-m", "nereus.cli", *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))), timeout=120)


@pytest.mark.parametrize("extra, located, message", [
    (" { hidden 32 }", "{ hidden 32 }", "the braces set hidden 32 (config.json: 64): remove them"),
    (" { layers 3 }", "{ layers 3 }", "lacks model.layers.2.input_layernorm.weight, which actor needs"),
])
def test_nereusc_check_compares_a_checkpoint_with_its_model(tmp_path, extra, located, message):
    """A brace override that no longer matches the checkpoint passed `nereusc check` and
    failed only after `nereus train` had started its processes; it is an error at the
    override now, from the safetensors headers alone."""
    write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt", extra=extra))
    assert _nereusc("check", tmp_path / "plan.nir", "--set", "cluster.gpu.mem=80GB").returncode == 2
    run = _nereusc("check", tmp_path / "plan.nir")
    assert run.returncode == 2, run.stdout + run.stderr
    first = run.stderr.splitlines()[0]
    assert first.startswith(f"{tmp_path / 'plan.nir'}:2:") and "error: model actor: its checkpoint ckpt" in first
    assert message in run.stderr and "Traceback" not in run.stderr


def test_checkpoint_tensors_no_weight_reads_are_a_warning(tmp_path):
    """`qkv_bias false` on a Qwen2 checkpoint drops its biases: the model computes another
    function than the checkpoint's, which was said nowhere."""
    write_checkpoint("qwen2", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt", extra=" { qkv_bias false }"))
    run = _nereusc("check", tmp_path / "plan.nir")
    assert run.returncode == 0, run.stdout + run.stderr
    assert ("warning: model actor: 6 tensors of ckpt are not read (the braces set qkv_bias): "
            "model.layers.0.self_attn.k_proj.bias") in run.stderr
    run = _nereusc("check", tmp_path / "plan.nir", "--json")
    assert json.loads(run.stdout)["warnings"][0].startswith("model actor: 6 tensors of ckpt are not read")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    run = _nereusc("check", tmp_path / "plan.nir")
    assert run.returncode == 0 and "warning" not in run.stderr


def test_a_config_without_weights_still_plans(tmp_path):
    """A checkpoint folder with only its config.json (planning a run at scale before the
    weights are downloaded) is checked as before: nothing to compare yet."""
    write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    run = _nereusc("check", tmp_path / "plan.nir")
    assert run.returncode == 0 and "warning" not in run.stderr, run.stdout + run.stderr



def test_the_brace_key_that_causes_a_mismatch_is_the_one_blamed(tmp_path):
    """{ layers 1 qk_norm true } on a Llama checkpoint lacks q_norm because of qk_norm, not
    layers (which only leaves tensors unread); a checkpoint that does not fit its own
    config.json blames no brace key."""
    write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt", extra=" { layers 1 qk_norm true }"))
    run = _nereusc("check", tmp_path / "plan.nir")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "hint: the braces set qk_norm true (config.json: false): remove them" in run.stderr
    line = (tmp_path / "plan.nir").read_text().splitlines()[1]
    assert f"plan.nir:2:{line.index('true') + 1}: error" in run.stderr  # at qk_norm's value
    assert "layers 1 (config" not in run.stderr


@pytest.mark.parametrize("kind", ["C64", "F4", "F6_E2M3"])
def test_a_tensor_of_a_later_format_dtype_no_weight_reads_is_skipped(tmp_path, kind):
    """safetensors 0.8 writes C64 and sub-byte F4/F6: an extra such tensor stopped the load."""
    import json as _json

    write_checkpoint("llama31", tmp_path / "ckpt")
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    path = tmp_path / "ckpt" / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = _json.loads(data[8:8 + length])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header["extra.tensor"] = {"dtype": kind, "shape": [2], "data_offsets": [end, end + 16]}
    text = _json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length:] + bytes(16))
    assert _load(tmp_path)  # the weights still load
    run = _nereusc("check", tmp_path / "plan.nir")
    assert run.returncode == 0 and "1 tensors of ckpt are not read" in run.stderr, run.stdout + run.stderr


def test_weights_not_downloaded_yet_plan_with_a_warning(tmp_path):
    """A folder with config.json and the index but no shards (`huggingface-cli download
    --include "*.json"`), or a Git LFS pointer for model.safetensors, planned before the
    checkpoint comparison existed: it still does, with a warning; a run refuses it."""
    model = write_checkpoint("llama31", tmp_path / "ckpt")
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")
    for shard in (tmp_path / "ckpt").glob("model*.safetensors"):
        shard.unlink()
    assert [p.name for p in (tmp_path / "ckpt").glob("*.safetensors*")] == ["model.safetensors.index.json"]
    (tmp_path / "plan.nir").write_text(nir("ckpt"))
    run = _nereusc("check", tmp_path / "plan.nir")
    assert run.returncode == 0, run.stdout + run.stderr
    (tmp_path / "ckpt" / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n")
    run = _nereusc("check", tmp_path / "plan.nir")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "warning: model actor: its weights cannot be read yet" in run.stderr


def test_a_header_past_the_formats_limit_is_refused_unread(tmp_path):
    """A corrupt length of 150 MB in a (sparse) 200 MB file made `nereusc check` read and
    parse it; safetensors refuses headers past 100 MB, and so does this reader now."""
    from nereus.models.safetensors_header import MAX_HEADER_BYTES, checkpoint_entries

    (tmp_path / "ckpt").mkdir()
    path = tmp_path / "ckpt" / "model.safetensors"
    with open(path, "wb") as handle:
        handle.write((150_000_000).to_bytes(8, "little"))
        handle.truncate(200_000_000)
    with pytest.raises(ir.NereusError, match=f"exceeds the format's limit \\({MAX_HEADER_BYTES} bytes\\)"):
        checkpoint_entries(str(tmp_path / "ckpt"))
