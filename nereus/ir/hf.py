"""`model actor = hf("path")`: a model's fields read from a Hugging Face config.json.

Input: the path as written (a checkpoint directory or its config.json, relative to the
`.nir` file) and the word that wrote it. Output: `HfConfig`, the Model fields the config
gives (same names as the `.nir` keys) and the checkpoint directory. Invariant: every
field the config sets that changes the computation is either read or rejected; fields
that do not (token ids, dropout 0, cache flags, max positions) are ignored.

Everything is read as transformers 5 reads it: both spellings of rotary settings,
`rope_theta` + `rope_scaling` (the published Llama-3.x / Qwen configs) and
`rope_parameters` (what transformers 5 writes), merged as it merges them when both stand;
a key left out takes the family's config-class default; no `architectures` reads
`model_type`. Errors are SemanticErrors at the path's token, naming config.json's field,
with a hint.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

from .diagnostics import SemanticError
from .model import RopeScaling
from .syntax import Word

# transformers' class name (config.json `architectures`) -> Nereus family
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # reward models and critics: the same body with a scalar `score` head (`head value`)
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
}
# config.json `model_type` -> the causal LM class transformers builds for it (read when
# `architectures` is left out)
HF_MODEL_TYPES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                  "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
HF_DTYPES: dict[str, str] = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# Defaults of transformers' config classes for a key config.json leaves out: Qwen2Config
# and Qwen3Config default num_key_value_heads to 32 and Qwen3MoeConfig to 4 (LlamaConfig
# to the attention heads); Qwen3Config defaults head_dim to 128 (the others, and every
# null, to hidden / heads). A null where the class takes only an integer (Qwen3Config's
# head_dim, Qwen3MoeConfig's num_key_value_heads) transformers refuses: so does Nereus.
_ABSENT_KV_HEADS: dict[str, int] = {"qwen2": 32, "qwen3": 32, "qwen3_moe": 4}
_ABSENT_HEAD_DIM: dict[str, int] = {"qwen3": 128}
_NOT_NULL: dict[str, tuple[str, ...]] = {"qwen3": ("head_dim",), "qwen3_moe": ("num_key_value_heads",)}
# max_position_embeddings when config.json leaves it out (a llama3 rope scaling without
# original_max_position_embeddings takes it)
_MAX_POSITIONS: dict[str, int] = {"llama": 2048, "qwen2": 32768, "qwen3": 32768, "qwen3_moe": 32768}
# config.json field -> Model field, for the plain integer sizes
_SIZES: tuple[tuple[str, str], ...] = (
    ("num_hidden_layers", "layers"), ("hidden_size", "hidden"), ("num_attention_heads", "heads"),
    ("intermediate_size", "ffn"), ("vocab_size", "vocab"),
)


@dataclass(frozen=True)
class HfConfig:
    """What a config.json gives: Model fields by `.nir` key, and the checkpoint directory."""

    fields: dict
    directory: str


class _Reader:
    """Reads fields of one config.json, raising errors located at the `hf("...")` path."""

    def __init__(self, config: dict, where: Word, shown: str):
        self.config = config
        self.where = where
        self.shown = shown  # the config file as the user wrote it, for messages

    def error(self, message: str, hint: str) -> SemanticError:
        return SemanticError(f"{self.shown}: {message}", self.where.loc, hint, width=self.where.width)

    def int(self, key: str, default: Optional[int] = None) -> int:
        value = self.config.get(key)
        if value is None:  # absent or null: transformers reads null as its default too
            value = default
        if value is None:
            raise self.error(f"'{key}' is missing", f"a transformers config.json sets {key}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise self.error(f"'{key}' must be a positive integer, found {json.dumps(value)}",
                             "is this a transformers config.json?")
        return value

    def float(self, key: str, value) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise self.error(f"'{key}' must be a positive number, found {json.dumps(value)}",
                             "is this a transformers config.json?")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if not isinstance(value, bool):
            raise self.error(f"'{key}' must be true or false, found {json.dumps(value)}",
                             "is this a transformers config.json?")
        return value

    def unsupported(self, key: str, value, hint: str) -> SemanticError:
        return self.error(f"{key} {json.dumps(value)} is not supported", hint)


def _resolve(path: str, nir_file: str) -> str:
    path = os.path.expanduser(path)
    if os.path.isabs(path):
        return path
    here = os.path.dirname(nir_file) if nir_file and not nir_file.startswith("<") else ""
    return os.path.normpath(os.path.join(here or os.getcwd(), path))


# what a Hugging Face Hub id looks like: ORG/NAME, no dots leading either part
_HUB_ID = re.compile(r"[A-Za-z0-9][\w\-.]*/[A-Za-z0-9][\w\-.]*")


def _load(word: Word, path: str, nir_file: str) -> tuple[dict, str, str]:
    """(parsed config.json, its directory, the config file as written) or a located error."""
    resolved = _resolve(path, nir_file)
    directory_given = os.path.isdir(resolved) or not path.endswith(".json")
    file = os.path.join(resolved, "config.json") if directory_given else resolved
    shown = os.path.join(path, "config.json") if directory_given else path
    if not os.path.isfile(file):
        hint = (f"hf(\"...\") takes a checkpoint directory holding config.json (or that file), "
                f"relative to the .nir file (looked for {file})")
        if _HUB_ID.fullmatch(path) and not os.path.exists(os.path.dirname(resolved)):
            name = path.split("/")[1]
            hint += (f"; if {path} is a Hub id: Nereus reads local directories and downloads nothing, so fetch "
                     f"it first (`huggingface-cli download {path} --local-dir ckpt/{name}`, then "
                     f"hf(\"ckpt/{name}\"))")
        raise SemanticError(f"no config.json at '{path}'" if directory_given else f"no file '{path}'", word.loc,
                            hint, width=word.width)
    try:
        with open(file, encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, UnicodeDecodeError) as error:
        raise SemanticError(f"cannot read {shown}: {error}", word.loc, "check the file's permissions and encoding",
                            width=word.width) from None
    except json.JSONDecodeError as error:
        raise SemanticError(f"{shown} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}",
                            word.loc, "transformers writes config.json with save_pretrained; fix or re-export it",
                            width=word.width) from None
    if not isinstance(config, dict):
        raise SemanticError(f"{shown} is not a JSON object", word.loc, "a config.json holds one {...} object",
                            width=word.width)
    return config, os.path.dirname(file), shown


def _architecture(read: _Reader) -> tuple[str, str]:
    """(Nereus family, transformers class): `architectures`' one class, else (absent, null
    or empty, as `Qwen2Config(...).save_pretrained` writes it) the causal LM of
    `model_type`, the class transformers' AutoModelForCausalLM builds."""
    config = read.config
    names = config.get("architectures")
    if not names and "model_type" in config:
        kind = config["model_type"]
        if kind not in HF_MODEL_TYPES:
            raise read.error(f"unsupported model_type {kind!r} (and no 'architectures')", f"supported model types: {', '.join(HF_MODEL_TYPES)}")
        return HF_ARCHITECTURES[HF_MODEL_TYPES[kind]], HF_MODEL_TYPES[kind]
    if not isinstance(names, list) or len(names) != 1:
        raise read.error(f"'architectures' must list one class, found {json.dumps(names)}",
                         f"supported: {', '.join(HF_ARCHITECTURES)}; or leave it out and set model_type")
    if names[0] not in HF_ARCHITECTURES:
        raise read.error(f"unsupported architecture '{names[0]}'", f"supported: {', '.join(HF_ARCHITECTURES)}")
    return HF_ARCHITECTURES[names[0]], names[0]


def _rope(read: _Reader, family: str) -> tuple[float, Optional[RopeScaling]]:
    """(rope theta, scaling) as transformers 5 merges the two spellings
    (RotaryEmbeddingConfigMixin.convert_rope_params_to_dict, standardize_rope_params): a
    non-empty `rope_scaling` replaces `rope_parameters` whole (its rope_theta is then
    lost); the dict's own rope_theta wins, else the top-level `rope_theta`, else 10000;
    the type is `rope_type`, else `type`, else default; a llama3 scaling without
    original_max_position_embeddings takes max_position_embeddings. (Reading
    rope_parameters alone while a top-level rope_scaling stood beside it moved the logits
    of a real-scale model by 0.5-0.9.)"""
    config = read.config
    scaling_key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    params = config.get(scaling_key) or {}
    if not isinstance(params, dict):
        raise read.error(f"'{scaling_key}' must be an object or null, found {json.dumps(params)}",
                         "is this a transformers config.json?")
    if any(isinstance(value, dict) for value in params.values()):
        raise read.unsupported(scaling_key, params, "rotary settings per layer type are not implemented; "
                                                    "one set for every layer is")
    if "rope_theta" in params:
        theta = read.float(f"{scaling_key}.rope_theta", params["rope_theta"])
    else:
        theta = read.float("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise read.unsupported(f"{scaling_key}.rope_type", kind, "supported rope scaling: llama3 (or none)")
    values = {}
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise read.error(f"'{scaling_key}.{key}' is missing", "llama3 rope scaling sets factor, low_freq_factor, "
                             "high_freq_factor and original_max_position_embeddings")
        values[key] = read.float(f"{scaling_key}.{key}", params[key])
    original_key = f"{scaling_key}.original_max_position_embeddings"
    original = params.get("original_max_position_embeddings")
    if original is None:  # transformers fills it with the context length
        original_key, original = "max_position_embeddings", config.get(
            "max_position_embeddings", _MAX_POSITIONS[family])
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise read.error(f"'{original_key}' must be a positive integer, found "
                         f"{json.dumps(original)}", "llama3 rope scaling sets it (8192 for Llama-3.1)")
    return theta, RopeScaling("llama3", original_max_position_embeddings=original, **values)


def _nullable(read: _Reader, family: str, key: str, absent: Optional[int]) -> Optional[int]:
    """config.json's `key` as transformers' config class of `family` reads it: its
    class default when the key is absent (`absent`; None: derived by the caller), None
    for a null the class accepts (derived too), else the positive integer."""
    if key not in read.config:
        return absent
    if read.config[key] is None:
        if key in _NOT_NULL.get(family, ()):
            raise read.error(f"'{key}' is null", f"transformers' {family} config takes an integer here (or leave "
                                                 "the key out for its default)")
        return None
    return read.int(key)


def _head_count(read: _Reader, family: str, heads: int) -> int:
    """num_key_value_heads, defaulted as transformers defaults it (_ABSENT_KV_HEADS)."""
    value = _nullable(read, family, "num_key_value_heads", _ABSENT_KV_HEADS.get(family))
    return heads if value is None else value


def _head_dim(read: _Reader, family: str) -> Optional[int]:
    """head_dim, defaulted as transformers defaults it; None: hidden / heads."""
    return _nullable(read, family, "head_dim", _ABSENT_HEAD_DIM.get(family))


def _reject_unsupported(read: _Reader, family: str) -> None:
    """Fields whose non-default values change the computation in ways Nereus does not implement."""
    config = read.config
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise read.unsupported("hidden_act", act, "the llama/qwen MLP here is SwiGLU (silu)")
    if config.get("mlp_bias", False):
        raise read.unsupported("mlp_bias", True, "MLP biases are not implemented")
    if family != "qwen2" and config.get("attention_bias", False):
        raise read.unsupported("attention_bias", True, "an o_proj bias is not implemented; only qwen2's q/k/v bias is")
    if config.get("use_sliding_window", False):
        raise read.unsupported("use_sliding_window", True, "sliding-window attention is not implemented")
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and any(t != "full_attention" for t in layer_types):
        bad = next(t for t in layer_types if t != "full_attention")
        raise read.unsupported("layer_types entry", bad, "only full attention layers are implemented")


def _moe_fields(read: _Reader) -> dict:
    """Qwen3MoeConfig's expert fields. Every layer must be sparse: Nereus's qwen3_moe has
    no dense-MLP layers (decoder_sparse_step 1, mlp_only_layers empty, as published)."""
    config = read.config
    step = config.get("decoder_sparse_step", 1)
    if step != 1:
        raise read.unsupported("decoder_sparse_step", step, "qwen3_moe here has experts in every layer (step 1)")
    if config.get("mlp_only_layers"):
        raise read.unsupported("mlp_only_layers", config["mlp_only_layers"], "dense-MLP layers in a MoE model are not "
                               "implemented; every layer has experts")
    # transformers 5 writes the expert count as num_local_experts (its Qwen3MoeConfig
    # attribute map reads either); published (4.x) configs say num_experts
    experts = "num_local_experts" if "num_experts" not in config and "num_local_experts" in config else "num_experts"
    return {"experts": read.int(experts), "experts_per_token": read.int("num_experts_per_tok"),
            "expert_ffn": read.int("moe_intermediate_size"),
            "norm_topk_prob": read.bool("norm_topk_prob", False)}


def read_hf_config(word: Word, path: str, nir_file: str, overridden: frozenset = frozenset()) -> HfConfig:
    """Input: the `hf("...")` argument (`word` is its token, `path` its text) and the
    `.nir` file's name. Output: the Model fields the config gives and the checkpoint
    directory. Raises a SemanticError at `word` for a missing or unreadable file, bad
    JSON, an unsupported architecture or field. `overridden`: the keys the braces set,
    whose config.json fields are not read (a dtype the braces replace need not be one
    Nereus supports)."""
    config, directory, shown = _load(word, path, nir_file)
    read = _Reader(config, word, shown)
    family, architecture = _architecture(read)
    _reject_unsupported(read, family)
    fields: dict = {"architecture": family}
    if architecture.endswith("ForSequenceClassification"):
        # no id2label: transformers' default, 2 labels (transformers 5 leaves the default
        # out of config.json; a 1-label model always writes its id2label)
        labels = config.get("id2label") or {"0": "LABEL_0", "1": "LABEL_1"}
        if config.get("num_labels", len(labels)) != 1:
            raise read.unsupported("id2label", labels, "a reward model or critic scores with one label "
                                                       "(`num_labels=1`, Nereus' `head value`)")
        fields["head"] = "value"
    for hf_key, key in _SIZES:
        fields[key] = read.int(hf_key)
    fields["kv_heads"] = _head_count(read, family, fields["heads"])
    head_dim = _head_dim(read, family)
    if head_dim is not None:
        fields["head_dim"] = head_dim
    elif fields["hidden"] % fields["heads"] == 0:
        fields["head_dim"] = fields["hidden"] // fields["heads"]
    fields["rope_theta"], fields["rope_scaling"] = _rope(read, family)
    fields["norm_eps"] = read.float("rms_norm_eps", config.get("rms_norm_eps", 1e-6))
    fields["tie_embeddings"] = read.bool("tie_word_embeddings", False)
    fields["qkv_bias"] = family == "qwen2"  # Qwen2Attention always has q/k/v biases
    fields["qk_norm"] = family in ("qwen3", "qwen3_moe")  # Qwen3(Moe)Attention normalizes q and k per head
    if family == "qwen3_moe":
        fields.update(_moe_fields(read))
    dtype_key = "torch_dtype" if "torch_dtype" in config else "dtype"
    dtype = config.get(dtype_key) if "dtype" not in overridden else None
    if dtype is not None:
        if dtype not in HF_DTYPES:
            raise read.unsupported(dtype_key, dtype, f"dtypes: {', '.join(HF_DTYPES)}; or set dtype in braces")
        fields["dtype"] = HF_DTYPES[dtype]
    return HfConfig(fields, directory)
