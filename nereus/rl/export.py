"""A trained model out of a checkpoint as a Hugging Face checkpoint (`nereus export OUT
--hf DIR`, `nereus train --export-hf DIR`).

Input: a run's output folder (OUT/run/config.json names the plan file and its --set
values; OUT/checkpoints/step_N the state), the step (default: the latest complete
checkpoint), the model (default: actor) and the target folder. Output: DIR/config.json
(the family's transformers config with the model's real rope theta and scaling, norm
eps, head_dim, tying and dtype; bos/eos/pad from the tokenizer), the weights as
safetensors under transformers' names (unfused q/k/v and gate/up), one file or
`model-0000i-of-0000n.safetensors` shards of at most `max_shard_bytes` with
`model.safetensors.index.json`, and the tokenizer's files copied (the run's --tokenizer,
else the model's hf() folder). transformers' `from_pretrained` loads it (config.json by the same `hf_config` the vLLM
engine path starts its engines from).
Invariant: the weights are the checkpoint's bytes at the model's dtype (not the fp32
master); one Nereus tensor is in memory at a time (plus the shard being filled).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from nereus.ir.diagnostics import NereusError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "generation_config.json")
MAX_SHARD_BYTES = 2 << 30


def run_config(out: str) -> dict:
    path = os.path.join(out, "run", "config.json")
    if not os.path.isfile(path):
        raise NereusError(f"{out} is not a `nereus train` output folder (no run/config.json)",
                          hint="pass the --out folder of a training run")
    with open(path) as handle:
        return json.load(handle)


def run_module(config: dict):
    import nereus.ir as ir

    module = ir.parse_file(config["plan_file"])
    if config.get("overrides"):
        module = ir.apply_overrides(module, list(config["overrides"]))
    return module


def _stage_of(module, model: str, stored: dict) -> str:
    for stage in ("training", "inference"):
        if any(name.startswith(f"{model}.{stage}/") for name in stored):
            return f"{model}.{stage}"
    models = sorted({name.split(".", 1)[0] for name in stored})
    raise NereusError(f"the checkpoint holds no model {model!r}", hint=f"models: {', '.join(models)}")


def _max_positions(model, config: dict) -> int:
    """The source checkpoint's max_position_embeddings, else room for the run's sequences."""
    if model.checkpoint_dir:
        try:
            with open(os.path.join(model.checkpoint_dir, "config.json")) as handle:
                return int(json.load(handle)["max_position_embeddings"])
        except (OSError, KeyError, ValueError):
            pass
    return 4096


def _tokenizer_dir(config: dict, model) -> Optional[str]:
    return config.get("tokenizer") or model.checkpoint_dir


def export_hf(out: str, target: str, *, step: Optional[int] = None, model_name: str = "actor",
              max_shard_bytes: int = MAX_SHARD_BYTES) -> dict:
    """Write the HF checkpoint (module docstring); returns what was written."""
    from safetensors.torch import save_file

    from nereus.models import tensor_table
    from nereus.models.hf import hf_targets
    from nereus.runtime.vllm_engine import hf_config

    from .checkpoint_read import latest, read_full, stored_tensors

    config = run_config(out)
    step, path = latest(out, step)
    module = run_module(config)
    try:
        model = module.model(model_name)
    except KeyError:
        raise NereusError(f"no model {model_name!r} in {config['plan_file']}",
                          hint=f"models: {', '.join(m.name for m in module.models)}") from None
    stored = stored_tensors(path)
    stage = _stage_of(module, model_name, stored)
    hf_config_dict = hf_config(model, max_position_embeddings=_max_positions(model, config))
    tokenizer = _tokenizer_dir(config, model)
    if tokenizer and os.path.isdir(tokenizer):
        try:
            from .data import load_tokenizer

            tok = load_tokenizer(tokenizer)
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # None where it has none
                value = getattr(tok, key, None)
                hf_config_dict[key] = int(value) if value is not None else None
        except NereusError:
            tokenizer = None
    os.makedirs(target, exist_ok=True)
    pieces: dict[str, list] = {}  # Nereus tensor -> its HF names and rows
    for hf, where in hf_targets(model).items():
        pieces.setdefault(where.tensor, []).append((hf, where.rows))
    shards: list[dict] = [{}]
    sizes = [0]
    read = 0
    for spec in tensor_table(model):
        name = f"{model.name}/{spec.name}"
        full, count = read_full(path, [f"{stage}/{name}"])
        read += count.data
        tensor = full[f"{stage}/{name}"]
        for hf, (lo, hi) in pieces.get(name, ()):
            part = tensor[lo:hi].contiguous().clone()
            nbytes = part.numel() * part.element_size()
            if shards[-1] and sizes[-1] + nbytes > max_shard_bytes:
                shards.append({})
                sizes.append(0)
            shards[-1][hf] = part
            sizes[-1] += nbytes
        del full, tensor
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(files, shards):
        save_file(shard, os.path.join(target, file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes)},
                 "weight_map": {hf: file for file, shard in zip(files, shards) for hf in shard}}
        with open(os.path.join(target, "model.safetensors.index.json"), "w") as handle:
            json.dump(index, handle, indent=2)
    with open(os.path.join(target, "config.json"), "w") as handle:
        json.dump(hf_config_dict, handle, indent=2)
    copied = []
    if tokenizer and os.path.isdir(tokenizer):
        for file in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer, file)):
                shutil.copyfile(os.path.join(tokenizer, file), os.path.join(target, file))
                copied.append(file)
    return {"step": step, "checkpoint": path, "model": model_name, "stage": stage, "target": target,
            "files": files, "bytes": sum(sizes), "bytes_read": read, "tokenizer_files": copied}
