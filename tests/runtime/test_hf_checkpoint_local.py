"""shard_checkpoint on one process: every GPU's local tensors equal the shards of the full
state dict, for a checkpoint split over several safetensors files and for a model dtype
that differs from the checkpoint's (read, then cast)."""

from __future__ import annotations

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
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    for text, message in (("{", "not valid JSON"), ("{}", "no 'weight_map'"),
                          ('{"weight_map": {"a": "model-00002.safetensors"}}', "lists model-00002.safetensors")):
        index.write_text(text)
        with pytest.raises(ir.NereusError) as raised:
            _load(tmp_path)
        assert str(index) in str(raised.value) and message in str(raised.value)
