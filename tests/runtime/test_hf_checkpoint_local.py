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
