"""Parameter counts of the published configs (tests/data/hf/*/config.json, fields as the
Hugging Face hub publishes them) equal transformers' num_parameters(), and `nereusc check
--json` reports them."""

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import nereus.ir as ir
from nereus.cli import nereusc
from nereus.models import parameter_count, tensor_table

DATA = Path(__file__).parents[1] / "data" / "hf"
# transformers 5.24 AutoModelForCausalLM.from_config(...).num_parameters() on the meta device
PUBLISHED = {
    "Llama-3.1-8B": 8_030_261_248,
    "Llama-3.1-70B": 70_553_706_496,
    "Llama-3.2-1B": 1_235_814_400,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen3-8B": 8_190_735_360,
}


def _nir(checkpoint: Path) -> str:
    return ("cluster c { nodes 1 gpus_per_node 8 gpu { mem 141GB flops 989TFLOPS hbm 4.8TB/s } intra 900GB/s "
            f"inter 25GB/s host_mem 2TB }}\nmodel actor = hf(\"{checkpoint}\")\n"
            "workload w { batch 8 prompt 512 response 512 microbatch 1 inference: actor }\n"
            "plan A { actor.inference dp 2 tp 4 on 0..7 }\n")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_counts(name):
    model = ir.parse_source(_nir(DATA / name), "<count>").model("actor")
    assert parameter_count(model) == PUBLISHED[name]
    assert sum(spec.numel for spec in tensor_table(model)) == PUBLISHED[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_counts_equal_transformers(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(DATA / name)
    with torch.device("meta"):  # shapes only: no memory
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
    model = ir.parse_source(_nir(DATA / name), "<count>").model("actor")
    assert parameter_count(model) == hf_model.num_parameters()
    hf_shapes = {n: tuple(p.shape) for n, p in hf_model.named_parameters()}
    from nereus.models.hf import hf_targets

    assert {n: t.shape for n, t in hf_targets(model).items()} == hf_shapes


def test_check_json_reports_parameters_and_bytes(tmp_path):
    shutil.copytree(DATA / "Qwen3-8B", tmp_path / "qwen3")
    (tmp_path / "plan.nir").write_text(_nir(Path("qwen3")))
    result = CliRunner().invoke(nereusc, ["check", str(tmp_path / "plan.nir"), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["models"] == [{"model": "actor", "architecture": "qwen3", "parameters": 8_190_735_360,
                                 "dtype": "bf16", "bytes": 2 * 8_190_735_360, "checkpoint": "qwen3"}]
