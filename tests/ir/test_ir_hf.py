"""Models read from Hugging Face checkpoints (`= hf("path")`) and the numerics keys that
hand-written models share with them: values, printing, round trips, located errors."""

import json
import shutil
from pathlib import Path

import pytest

import nereus.ir as ir

DATA = Path(__file__).parents[1] / "data" / "hf"
CLUSTER = ("cluster c { nodes 1 gpus_per_node 8 gpu { mem 141GB flops 989TFLOPS hbm 4.8TB/s } intra 900GB/s "
           "inter 25GB/s host_mem 2TB }\n")


def _module(models: str, placements: str = "actor.training dp 1 tp 8 on 0..7") -> str:
    return (CLUSTER + models + "\nworkload w { batch 8 prompt 16 response 16 microbatch 1 training: actor }\n"
            f"plan A {{ {placements} }}\n")


@pytest.fixture
def checkpoints(tmp_path):
    """The published configs copied beside a .nir file in tmp_path (paths are relative)."""
    for name in ("Llama-3.1-8B", "Llama-3.2-1B", "Qwen2.5-7B", "Qwen3-8B"):
        shutil.copytree(DATA / name, tmp_path / "ckpt" / name)
    return tmp_path


def _parse(directory: Path, text: str) -> ir.Module:
    path = directory / "plan.nir"
    path.write_text(text)
    return ir.parse_file(path)


def test_llama_31_fields_from_config(checkpoints):
    module = _parse(checkpoints, _module('model actor = hf("ckpt/Llama-3.1-8B")'))
    actor = module.model("actor")
    assert (actor.architecture, actor.layers, actor.hidden, actor.heads, actor.kv_heads, actor.ffn, actor.vocab) == \
        ("llama", 32, 4096, 32, 8, 14336, 128256)
    assert (actor.dtype, actor.rope_theta, actor.norm_eps, actor.head_dim) == ("bf16", 500000.0, 1e-5, 128)
    assert actor.rope_scaling == ir.RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert not (actor.tie_embeddings or actor.qkv_bias or actor.qk_norm)
    assert actor.checkpoint == "ckpt/Llama-3.1-8B"
    assert actor.checkpoint_dir == str(checkpoints / "ckpt" / "Llama-3.1-8B")


@pytest.mark.parametrize("name, family, flags", [
    ("Llama-3.2-1B/config.json", "llama", dict(tie_embeddings=True, head_dim=64, qkv_bias=False, qk_norm=False)),
    ("Qwen2.5-7B", "qwen2", dict(qkv_bias=True, qk_norm=False, norm_eps=1e-6, rope_theta=1e6, rope_scaling=None)),
    ("Qwen3-8B", "qwen3", dict(qk_norm=True, qkv_bias=False, head_dim=128, norm_eps=1e-6, rope_theta=1e6)),
])
def test_families_from_config(checkpoints, name, family, flags):
    actor = _parse(checkpoints, _module(f'model actor = hf("ckpt/{name}")', "actor.training dp 8 on 0..7")) \
        .model("actor")
    assert actor.architecture == family
    assert {key: getattr(actor, key) for key in flags} == flags


def test_braces_override_and_print_keeps_hf(checkpoints):
    text = _module('model actor = hf("ckpt/Qwen3-8B") { dtype fp32  norm_eps 1e-5 }  # from the hub\n'
                   "model critic = actor { head value }")
    text = text.replace("training: actor", "training: actor, critic").replace(
        "on 0..7 }", "on 0..7 critic.training dp 1 tp 8 on 0..7 }")
    module = _parse(checkpoints, text)
    actor, critic = module.model("actor"), module.model("critic")
    assert (actor.dtype, actor.norm_eps, actor.qk_norm) == ("fp32", 1e-5, True)
    assert critic.checkpoint == actor.checkpoint and critic.head == "value"
    printed = ir.print_module(module)
    assert 'model actor  = hf("ckpt/Qwen3-8B") { dtype fp32 norm_eps 1e-5 }' in printed
    assert "model critic = actor { head value }" in printed
    assert ir.parse_source(printed, str(checkpoints / "plan.nir")) == module
    formatted = ir.format_source(text, str(checkpoints / "plan.nir"))
    assert 'hf("ckpt/Qwen3-8B") { dtype fp32 norm_eps 1e-5 }  # from the hub' in formatted


def test_hand_written_numerics_keys_round_trip():
    text = _module("model actor = qwen3 { layers 2 hidden 64 heads 4 kv_heads 2 ffn 128 vocab 256 head_dim 32 "
                   "rope_theta 1e6 norm_eps 1e-6 tie_embeddings true rope_scaling { type llama3 factor 32 } }",
                   "actor.training dp 2 on 0..1")
    actor = ir.parse_source(text).model("actor")
    assert (actor.head_dim, actor.rope_theta, actor.norm_eps, actor.tie_embeddings, actor.qk_norm) == \
        (32, 1e6, 1e-6, True, True)
    assert actor.rope_scaling == ir.RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)  # unwritten keys: Llama-3.1's
    printed = ir.print_module(ir.parse_source(text))
    assert ("model actor = qwen3 { layers 2 hidden 64 heads 4 kv_heads 2 ffn 128 vocab 256 dtype bf16 head_dim 32 "
            "rope_theta 1000000 rope_scaling { type llama3 factor 32 low_freq_factor 1 high_freq_factor 4 "
            "original_max_position_embeddings 8192 } norm_eps 1e-6 tie_embeddings true }") in printed
    assert ir.parse_source(printed) == ir.parse_source(text)


def test_defaults_are_the_plain_llama_and_print_nothing_new():
    text = _module("model actor = llama { layers 2 hidden 64 heads 4 kv_heads 2 ffn 128 vocab 256 }\n"
                   "model ref = actor { rope_scaling { type llama3 } }\nmodel ref2 = ref { rope_scaling none }")
    module = ir.parse_source(text.replace("training: actor", "training: actor, ref, ref2").replace(
        "tp 8 on 0..7 }", "tp 4 on 0..3 ref.training dp 1 on 0 ref2.training dp 1 on 1 }"))
    actor = module.model("actor")
    assert (actor.rope_theta, actor.rope_scaling, actor.norm_eps, actor.head_dim) == (10000.0, None, 1e-5, 16)
    assert not (actor.tie_embeddings or actor.qkv_bias or actor.qk_norm)
    assert module.model("ref2").rope_scaling is None and module.model("ref").rope_scaling is not None
    printed = ir.print_module(module)
    assert "model actor = llama { layers 2 hidden 64 heads 4 kv_heads 2 ffn 128 vocab 256 dtype bf16 }" in printed
    assert "model ref2  = ref { rope_scaling none }" in printed
    assert ir.parse_source(printed) == module
    qwen2 = text.replace("= llama {", "= qwen2 {").replace("tp 8 on 0..7", "tp 4 on 0..3")
    assert ir.parse_source(qwen2).model("actor").qkv_bias  # the family's default


def test_explicit_head_dim_lifts_the_divisibility_rule():
    text = _module("model actor = qwen3 { layers 2 hidden 1000 heads 8 kv_heads 2 ffn 128 vocab 256 head_dim 64 }",
                   "actor.training dp 1 tp 2 on 0..1")
    assert ir.parse_source(text).model("actor").head_dim == 64


def test_tied_embeddings_need_pp_1():
    text = _module("model actor = llama { layers 2 hidden 64 heads 4 kv_heads 2 ffn 128 vocab 256 "
                   "tie_embeddings true }", "actor.training dp 1 pp 2 on 0..1")
    with pytest.raises(ir.SemanticError) as caught:
        ir.parse_source(text, "t.nir")
    assert "ties its embedding and lm head, which needs pp 1" in caught.value.message
    assert caught.value.loc.line == 4


def _error(directory: Path, text: str) -> str:
    with pytest.raises(ir.NereusError) as caught:
        _parse(directory, text)
    return caught.value.format().replace(str(directory), "TMP")


def test_missing_checkpoint_is_located_at_the_path(tmp_path):
    assert _error(tmp_path, _module('model actor = hf("ckpt/nope")')).splitlines() == [
        "TMP/plan.nir:2:18: error: no config.json at 'ckpt/nope'",
        '    2 | model actor = hf("ckpt/nope")',
        "      |                  ^^^^^^^^^^^",
        'hint: hf("...") takes a checkpoint directory holding config.json (or that file), relative to the .nir '
        "file (looked for TMP/ckpt/nope/config.json); if ckpt/nope is a Hub id: Nereus reads local directories "
        "and downloads nothing, so fetch it first (`huggingface-cli download ckpt/nope --local-dir ckpt/nope`, "
        'then hf("ckpt/nope"))']
    (tmp_path / "ckpt").mkdir()  # a local folder: no word of the Hub
    assert _error(tmp_path, _module('model actor = hf("ckpt/nope")')).splitlines()[-1].endswith(
        "(looked for TMP/ckpt/nope/config.json)")


def _write_config(directory: Path, config) -> None:
    (directory / "ckpt").mkdir(exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (directory / "ckpt" / "config.json").write_text(text)


def _llama_config(**changes) -> dict:
    config = json.loads((DATA / "Llama-3.1-8B" / "config.json").read_text())
    config.update(changes)
    return config


@pytest.mark.parametrize("config, message, hint", [
    ('{"architectures": ["LlamaForCausalLM"],', "ckpt/config.json is not valid JSON: Expecting property name "
     "enclosed in double quotes at line 1 column 40", "transformers writes config.json with save_pretrained"),
    (_llama_config(architectures=["MistralForCausalLM"]), "ckpt/config.json: unsupported architecture "
     "'MistralForCausalLM'", "supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    (_llama_config(hidden_act="gelu"), 'ckpt/config.json: hidden_act "gelu" is not supported',
     "the llama/qwen MLP here is SwiGLU (silu)"),
    (_llama_config(attention_bias=True), "ckpt/config.json: attention_bias true is not supported",
     "an o_proj bias is not implemented"),
    (_llama_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
     'ckpt/config.json: rope_scaling.rope_type "yarn" is not supported', "supported rope scaling: llama3"),
    (_llama_config(hidden_size="4096"), "ckpt/config.json: 'hidden_size' must be a positive integer, found \"4096\"",
     "is this a transformers config.json?"),
    (_llama_config(torch_dtype="float8_e4m3fn"), 'ckpt/config.json: torch_dtype "float8_e4m3fn" is not supported',
     "dtypes: bfloat16, float16, float32"),
])
def test_config_errors_are_located_at_the_path(tmp_path, config, message, hint):
    _write_config(tmp_path, config)
    lines = _error(tmp_path, _module('model actor = hf("ckpt/config.json")')).splitlines()
    assert lines[0] == f"TMP/plan.nir:2:18: error: {message}"
    assert lines[2] == "      |                  " + "^" * len('"ckpt/config.json"')
    assert lines[3].startswith(f"hint: {hint}")


def test_unknown_function_and_bad_values(tmp_path):
    assert _error(tmp_path, _module('model actor = hff("x")')).splitlines()[0::3] == [
        "TMP/plan.nir:2:15: error: unknown function 'hff'",
        "hint: did you mean 'hf'? a model is read from a checkpoint with hf(\"path/to/checkpoint\")"]
    sizes = "layers 2 hidden 64 heads 4 kv_heads 2 ffn 128 vocab 256"
    for keys, message in [("norm_eps 0", "norm_eps must be positive, found 0"),
                          ("qk_norm yes", "qk_norm must be 'true' or 'false', found 'yes'"),
                          ("rope_scaling { type yarn }", "type must be 'llama3', found 'yarn'"),
                          ("rope_scaling { factor 8 low_freq_factor 4 high_freq_factor 1 }",
                           "rope_scaling high_freq_factor (1) must be above low_freq_factor (4)"),
                          ("rope_theta 5GB", "rope_theta takes a plain number, found unit 'GB'")]:
        with pytest.raises(ir.SemanticError) as caught:
            ir.parse_source(_module(f"model actor = llama {{ {sizes} {keys} }}", "actor.training dp 1 on 0"))
        assert caught.value.message == message


@pytest.mark.parametrize("overrides", ["hidden 1024", "head_dim 128", "rope_scaling none", "tie_embeddings false",
                                       "norm_eps 1e-6 rope_theta 10000", "heads 16 kv_heads 4", "qk_norm true",
                                       "rope_scaling { type llama3 factor 4 }", "dtype fp32 head value"])
def test_overrides_of_a_checkpoint_round_trip(checkpoints, overrides):
    text = _module(f'model actor = hf("ckpt/Llama-3.2-1B") {{ {overrides} }}\nmodel ref = actor {{ layers 4 }}',
                   "actor.training dp 8 on 0..7")
    module = _parse(checkpoints, text)
    printed = ir.print_module(module)
    assert ir.parse_source(printed, str(checkpoints / "plan.nir")) == module
    assert ir.print_module(ir.parse_source(printed, str(checkpoints / "plan.nir"))) == printed
    if overrides == "hidden 1024":  # the config's head_dim was hidden / heads: it follows the override
        assert module.model("actor").head_dim == 32 and 'hf("ckpt/Llama-3.2-1B") { hidden 1024 }' in printed


def test_a_hash_inside_the_path_is_not_a_comment(tmp_path):
    shutil.copytree(DATA / "Qwen2.5-7B", tmp_path / "run#2")
    text = _module('model actor = hf("run#2")  # Qwen2.5', "actor.training dp 2 tp 4 on 0..7")
    (tmp_path / "plan.nir").write_text(text)
    formatted = ir.format_source(text, str(tmp_path / "plan.nir"))
    assert 'model actor = hf("run#2")  # Qwen2.5' in formatted
    assert ir.parse_source(formatted, str(tmp_path / "plan.nir")).model("actor").architecture == "qwen2"


def test_sequence_classification_checkpoints_are_value_heads(checkpoints):
    """Reward models are saved as ...ForSequenceClassification with one label: the same
    body and a scalar `score` head, which is Nereus' `head value`."""
    directory = checkpoints / "ckpt" / "Qwen2.5-7B"
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["Qwen2ForSequenceClassification"]
    config["id2label"] = {"0": "LABEL_0"}
    (directory / "config.json").write_text(json.dumps(config))
    actor = _parse(checkpoints, _module('model actor = hf("ckpt/Qwen2.5-7B")', "actor.training dp 8 on 0..7")) \
        .model("actor")
    assert (actor.architecture, actor.head, actor.qkv_bias) == ("qwen2", "value", True)
    config["id2label"] = {"0": "bad", "1": "good"}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ir.SemanticError, match="id2label .* is not supported") as err:
        _parse(checkpoints, _module('model actor = hf("ckpt/Qwen2.5-7B")', "actor.training dp 8 on 0..7"))
    assert "one label" in err.value.hint


def test_no_id2label_means_transformers_default_of_two_labels(checkpoints):
    """transformers 5 leaves id2label out of config.json when it is the default, 2 labels:
    such a classifier is no reward model (its score head has 2 rows), whatever the file
    omits; num_labels 1 written out is one."""
    directory = checkpoints / "ckpt" / "Qwen2.5-7B"
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["Qwen2ForSequenceClassification"]
    config.pop("id2label", None)
    config.pop("num_labels", None)
    (directory / "config.json").write_text(json.dumps(config))
    text = _module('model actor = hf("ckpt/Qwen2.5-7B")', "actor.training dp 8 on 0..7")
    with pytest.raises(ir.SemanticError, match="id2label .* is not supported"):
        _parse(checkpoints, text)
    config["num_labels"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    assert _parse(checkpoints, text).model("actor").head == "value"


def test_a_null_kv_head_count_is_transformers_default(checkpoints):
    """"num_key_value_heads": null reads as the attention heads (multi-head attention), as
    transformers reads it."""
    directory = checkpoints / "ckpt" / "Qwen2.5-7B"
    config = json.loads((directory / "config.json").read_text())
    config["num_key_value_heads"] = None
    (directory / "config.json").write_text(json.dumps(config))
    actor = _parse(checkpoints, _module('model actor = hf("ckpt/Qwen2.5-7B")', "actor.training dp 8 on 0..7")) \
        .model("actor")
    assert actor.kv_heads == actor.heads == config["num_attention_heads"]


def test_a_dtype_set_in_braces_replaces_an_unsupported_config_dtype(tmp_path):
    """The hint of an unsupported config dtype says "or set dtype in braces": that works."""
    _write_config(tmp_path, _llama_config(torch_dtype="float64"))
    module = _parse(tmp_path, _module('model actor = hf("ckpt") { dtype fp32 }'))
    assert module.model("actor").dtype == "fp32"


def test_a_home_relative_path_is_expanded(tmp_path, monkeypatch):
    _write_config(tmp_path, _llama_config())
    monkeypatch.setenv("HOME", str(tmp_path))
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert _parse(other, _module('model actor = hf("~/ckpt")')).model("actor").hidden == 4096


def test_a_hub_id_is_told_to_download_first(tmp_path):
    text = _error(tmp_path, _module('model actor = hf("Qwen/Qwen3-8B")'))
    assert "error: no config.json at 'Qwen/Qwen3-8B'" in text
    assert "Nereus reads local directories and downloads nothing" in text
    assert "huggingface-cli download Qwen/Qwen3-8B --local-dir" in text


def test_a_config_without_architectures_reads_its_model_type(tmp_path):
    """`Qwen2Config(...).save_pretrained(dir)` writes model_type and no architectures:
    transformers' AutoModelForCausalLM loads it as Qwen2ForCausalLM, and Nereus refused it."""
    transformers = pytest.importorskip("transformers")

    transformers.Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=96).save_pretrained(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert "architectures" not in config or not config["architectures"]
    actor = _parse(tmp_path, _module('model actor = hf("ckpt")', "actor.training dp 1 on 0")).model("actor")
    assert (actor.architecture, actor.qkv_bias, actor.kv_heads, actor.head) == ("qwen2", True, 2, "lm")
    config.pop("architectures", None)
    config["model_type"] = "gpt2"
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ir.SemanticError, match="unsupported model_type 'gpt2'") as error:
        _parse(tmp_path, _module('model actor = hf("ckpt")', "actor.training dp 1 on 0"))
    assert "llama, qwen2, qwen3, qwen3_moe" in error.value.hint
