"""vLLM as the generation engine of the actor (docs/runtime.md, "vLLM engines").

One engine per generation replica, started on the replica's driver rank (its first GPU)
with `tensor_parallel_size` = the plan's tp. It implements the RL loop's
GenerationEngine protocol (nereus.rl.engine): `generate(prompts, ...)` and
`update_weights(weights)`. New weights go through vLLM's public weight-loading path,
`LLM.collective_rpc("reload_weights", ...)` (each worker's model_runner re-runs the
model's `load_weights` and then its post-load processing, e.g. the CPU backend's weight
repacking; with the engine core in another process, through the worker extension of
nereus.runtime.vllm_worker, since tensors do not survive collective_rpc's codec),
followed by `reset_prefix_cache()` so no KV block computed with the old weights is reused.

Name mapping, Nereus local name → vLLM/HF parameter name. vLLM's llama `load_weights`
fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` itself, and accepts the
pre-fused names too (its QKV/merged-column weight loaders split a fused tensor into its
parts, then TP-slice each part); Nereus' fused layouts [q; k; v] and [gate; up] are
exactly those parts in that order, so fused tensors pass through unsplit:

    embed.weight                     model.embed_tokens.weight
    layers.{i}.input_norm.weight     model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.qkv.weight       model.layers.{i}.self_attn.qkv_proj.weight
    layers.{i}.attn.o.weight         model.layers.{i}.self_attn.o_proj.weight
    layers.{i}.post_attn_norm.weight model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.gate_up.weight    model.layers.{i}.mlp.gate_up_proj.weight
    layers.{i}.mlp.down.weight       model.layers.{i}.mlp.down_proj.weight
    final_norm.weight                model.norm.weight
    lm_head.weight                   lm_head.weight

Qwen2 and Qwen3 models pass under the checkpoint's unfused names instead (q/k/v biases,
q/k norms included); a tied model has no lm_head. The checkpoint that starts the engine
(`save_hf_checkpoint`) is the family's, under the unfused HF names (q_proj/k_proj/v_proj,
gate_proj/up_proj) as transformers writes them, with the model's eps, rope theta and
scaling, head_dim and tying in config.json (`hf_config`).

What the engine takes: whole tensors ("checkpoint format"): vLLM slices its TP shards
itself. So the engine's input layout is the replica's whole weights on its driver rank;
`engine_placement` gives that layout, and the compiled sync (nereus.runtime.vllm_sync)
targets it. With tp=1 it is the generation layout itself.

Sampling: vLLM samples with its own per-request generator; the caller's uniforms seed
it (one seed per row, derived from the row's uniforms), so rows are reproducible and
independent of batching, but the tokens differ from NativeEngine's inverse-CDF sampling.
Greedy decoding is exact argmax in both.

Only this module imports vllm (lazily, in VllmEngine); the name mapping needs torch only.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Iterable, Optional

import torch

from nereus.ir.diagnostics import NereusError, SemanticError
from nereus.ir.model import Model

from nereus.models.fp8 import Fp8Weight

from .vllm_fp8 import FP8_CONFIG, fp8_hf_weights
from .vllm_sync import WeightSync, driver_replica, engine_placement

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_LAYER_NAMES = {
    "input_norm.weight": "input_layernorm.weight",
    "attn.qkv.weight": "self_attn.qkv_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_up.weight": "mlp.gate_up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_EDGE_NAMES = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
               "lm_head.weight": "lm_head.weight"}
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def local_name(name: str) -> str:
    """`actor/layers.0.attn.qkv.weight` → `layers.0.attn.qkv.weight` (local names pass through)."""
    return name.split("/", 1)[1] if "/" in name else name


def vllm_name(name: str) -> str:
    """The vLLM/HF parameter name of a Nereus tensor (global or local name); fused
    tensors keep vLLM's fused names. Raises NereusError for optimizer state, value heads
    and unknown names (a generation engine takes lm weights only)."""
    local = local_name(name)
    if local in _EDGE_NAMES:
        return _EDGE_NAMES[local]
    match = _LAYER.fullmatch(local)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise NereusError(f"no vLLM parameter corresponds to {name!r}",
                      hint="pass the actor's weights only: no optimizer state (#...), no value head")


def to_vllm_weights(weights: dict, model: Optional[Model] = None) -> list[tuple[str, torch.Tensor]]:
    """Input: whole tensors by Nereus name (and the model they belong to). Output: (vLLM
    name, tensor) pairs in name order, the tensors themselves or row views of them (no
    copy): vLLM's loader copies them into its params. A llama passes its fused tensors
    (vllm_name); the other families pass the HF checkpoint's unfused names, the ones
    every vLLM model's load_weights reads (their fused-name handling is not relied on).
    FP8 weights (nereus.models.fp8.Fp8Weight, a `quant fp8` generation) always pass
    unfused, as an FP8 checkpoint holds them (fp8_hf_weights)."""
    if any(isinstance(t, Fp8Weight) for t in weights.values()):
        if model is None:
            raise NereusError("FP8 weights need their model to be named for vLLM", hint="pass model=")
        full = {f"{model.name}/{local_name(name)}": tensor for name, tensor in weights.items()}
        return sorted(fp8_hf_weights(model, full).items())
    if model is None or model.architecture == "llama":
        return [(vllm_name(name), tensor) for name, tensor in sorted(weights.items())]
    from nereus.models.hf import nereus_to_hf

    full = {f"{model.name}/{local_name(name)}": tensor for name, tensor in weights.items()}
    return sorted(nereus_to_hf(model, full).items())


def hf_checkpoint_weights(model: Model, weights: dict) -> dict:
    """Whole tensors by Nereus name (global or local) → the HF state dict of `model`'s
    family, as transformers writes it: unfused q/k/v (weights and biases) and gate/up, no
    lm_head when the embedding is tied (contiguous copies, as safetensors wants). The
    names come from the family's table (nereus.models.hf), as the loader's do."""
    from nereus.models.hf import nereus_to_hf

    full = {f"{model.name}/{local_name(name)}": tensor for name, tensor in weights.items()}
    check_complete(model, full)
    named = fp8_hf_weights(model, full) if any(isinstance(t, Fp8Weight) for t in full.values()) else \
        nereus_to_hf(model, full)
    return {name: tensor.contiguous().clone() for name, tensor in named.items()}


# family → (transformers class, model_type, q/k/v bias, q/k norm): what each HF class computes
HF_CLASSES = {"llama": ("LlamaForCausalLM", "llama", False, False),
              "qwen2": ("Qwen2ForCausalLM", "qwen2", True, False),
              "qwen3": ("Qwen3ForCausalLM", "qwen3", False, True)}


def _rope_parameters(model: Model, rope_theta: float) -> dict:
    """transformers 5's rope_parameters (rope_scaling too: older readers take that)."""
    scaling = model.rope_scaling
    if scaling is None:
        return {"rope_theta": rope_theta, "rope_type": "default"}
    return {"rope_theta": rope_theta, "rope_type": scaling.type, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}


def hf_config(model: Model, *, max_position_embeddings: int = 4096, rms_norm_eps: Optional[float] = None,
              rope_theta: Optional[float] = None) -> dict:
    """config.json of `model` as its family's HF causal LM (LlamaForCausalLM,
    Qwen2ForCausalLM or Qwen3ForCausalLM) with the model's numerics: norm eps, rope theta
    and llama3 scaling (eps and theta overridable), head_dim, tied embeddings. Reading
    it back with `hf("dir")` gives the same model. bos/eos ids are set but generation
    ignores eos. Raises SemanticError for what no HF class of the family computes (a
    value head; a llama with q/k/v bias or q/k norm, whose HF class would add an o_proj
    bias or lack the norm)."""
    if model.head != "lm" or model.architecture not in HF_CLASSES:
        raise SemanticError(f"model {model.name} is not a llama/qwen2/qwen3 with an lm head; vLLM generates from "
                            "actors only", model.loc)
    architecture, model_type, bias, qk_norm = HF_CLASSES[model.architecture]
    if (model.qkv_bias, model.qk_norm) != (bias, qk_norm):
        raise SemanticError(f"model {model.name}: {architecture} has {'' if bias else 'no '}q/k/v bias and "
                            f"{'' if qk_norm else 'no '}q/k norm, the model has qkv_bias "
                            f"{str(model.qkv_bias).lower()}, qk_norm {str(model.qk_norm).lower()}", model.loc,
                            hint="use the family that computes it (qwen2: bias, qwen3: q/k norm) or the native engine")
    rms_norm_eps = model.norm_eps if rms_norm_eps is None else rms_norm_eps
    rope_theta = model.rope_theta if rope_theta is None else rope_theta
    rope = _rope_parameters(model, rope_theta)
    config = {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": model.vocab, "hidden_size": model.hidden, "intermediate_size": model.ffn,
        "num_hidden_layers": model.layers, "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads, "head_dim": model.head_dim, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta, "rope_parameters": rope,
        "tie_word_embeddings": model.tie_embeddings, "mlp_bias": False,
        "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": VLLM_DTYPES[model.dtype],
        "dtype": VLLM_DTYPES[model.dtype],
    }
    if model.rope_scaling is not None:
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if model_type != "qwen2":  # Qwen2's biases are implied by its class
        config["attention_bias"] = False
    if model_type != "llama":  # no sliding windows (Nereus computes full attention only)
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=model.layers,
                      layer_types=["full_attention"] * model.layers)
    return config


def save_hf_checkpoint(model: Model, weights: dict, path: str | os.PathLike, **config) -> Path:
    """Write `weights` (whole tensors by Nereus name) as a HF checkpoint directory of the
    model's family (config.json + model.safetensors) that vLLM and transformers load, and
    `nereus train` reads back with `hf("dir")`. FP8 weights (Fp8Weight) make it a
    block-FP8 checkpoint (FP8_CONFIG; vLLM loads it, `hf("dir")` does not). Needs safetensors."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    settings = hf_config(model, **config)
    if any(isinstance(t, Fp8Weight) for t in weights.values()):
        settings["quantization_config"] = dict(FP8_CONFIG)
    (out / "config.json").write_text(json.dumps(settings, indent=2))
    save_file(hf_checkpoint_weights(model, weights), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def row_seeds(uniforms: torch.Tensor) -> list[int]:
    """One vLLM sampling seed per row, a deterministic function of the row's uniforms."""
    scaled = (uniforms.double() * (1 << 31)).long()
    weights = torch.arange(1, scaled.shape[1] + 1, dtype=torch.long)
    return [int(v) % (1 << 31) for v in (scaled * weights).sum(dim=1)]


class VllmEngine:
    """A vLLM engine holding one generation replica of `model` (GenerationEngine protocol).

    Input: the model, its initial whole weights by Nereus name (written to a HF checkpoint
    under `workdir` for the engine to start from), `tp` (vLLM's tensor_parallel_size).
    `llm_options` go to `vllm.LLM` unchanged. `in_process` (default: on CPU when this
    process has no torch.distributed group) runs vLLM's engine core in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0), so weights reach the worker without
    serialization; otherwise they are serialized to the engine core. CPU attention
    needs head_dim in {32, 64, 80, 96, 112, 128, ...} (vLLM's CPU_ATTN list)."""

    def __init__(self, model: Model, weights: dict, *, workdir: str | os.PathLike, tp: int = 1,
                 max_model_len: int = 512, seed: int = 0, max_num_seqs: int = 64,
                 in_process: Optional[bool] = None, **llm_options):
        self.model, self.tp = model, tp
        self.checkpoint = save_hf_checkpoint(model, weights, workdir, max_position_embeddings=max(max_model_len, 64))
        cpu = not torch.cuda.is_available()
        if cpu:
            if tp != 1:
                raise NereusError(f"vLLM on CPU runs tensor_parallel_size 1 only, the plan asks tp={tp}",
                                  hint="place actor.generation with tp 1 on CPU, or run on GPUs")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            llm_options.setdefault("gpu_memory_utilization", 0.3)
        if in_process is None:
            # vLLM's worker sets up its own torch.distributed world: it can share this
            # process only when the caller has none (a torchrun rank keeps the engine
            # core in a child process, and weights travel to it serialized)
            import torch.distributed as dist

            in_process = cpu and not (dist.is_available() and dist.is_initialized())
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        self.in_process = in_process
        import vllm

        if not in_process:
            llm_options.setdefault("worker_extension_cls", "nereus.runtime.vllm_worker.NereusWorkerExtension")
        started = time.perf_counter()
        self.llm = vllm.LLM(model=str(self.checkpoint), skip_tokenizer_init=True, dtype=VLLM_DTYPES[model.dtype],
                            tensor_parallel_size=tp, max_model_len=max_model_len, seed=seed,
                            max_num_seqs=max_num_seqs, enforce_eager=llm_options.pop("enforce_eager", True),
                            **llm_options)
        self.start_seconds = time.perf_counter() - started
        self.last_update_seconds = 0.0

    def generate(self, prompts: torch.Tensor, max_new_tokens: int, uniforms: Optional[torch.Tensor] = None,
                 temperature: float = 1.0, greedy: bool = False, pad: Optional[torch.Tensor] = None) -> torch.Tensor:
        """prompts [B, P] int64 → tokens [B, max_new_tokens] (eos ignored: always full length);
        `pad` [B]: leading pad tokens of each prompt, left out of what the engine reads."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rows = prompts.tolist()
        if pad is not None:
            rows = [row[int(n):] for row, n in zip(rows, pad.tolist())]
        seeds = row_seeds(uniforms) if (uniforms is not None and not greedy) else [None] * len(rows)
        # ignore_eos alone gives full-length responses; min_tokens must stay unset: it masks
        # the eos id (0 in hf_config, a real token here) to -inf, so greedy would skip it
        params = [SamplingParams(temperature=0.0 if greedy else temperature, max_tokens=max_new_tokens,
                                 ignore_eos=True, detokenize=False, seed=s)
                  for s in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        if any(len(t) != max_new_tokens for t in tokens):
            raise NereusError(f"vLLM returned {sorted({len(t) for t in tokens})} tokens, expected {max_new_tokens}")
        return torch.tensor(tokens, dtype=torch.long)

    def update_weights(self, weights: dict) -> None:
        """Push whole tensors (by Nereus name) into the engine through reload_weights, then
        drop cached prefixes. Every weight of the model must be present."""
        check_complete(self.model, weights)  # a partial reload would leave layers unloaded
        started = time.perf_counter()
        items = to_vllm_weights(weights, self.model)
        if self.in_process:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        else:
            from .vllm_worker import pack_weights

            self.llm.collective_rpc("nereus_load_weights", args=(pack_weights(items),))
        self.llm.reset_prefix_cache()
        self.last_update_seconds = time.perf_counter() - started

    def parameter_names(self) -> list[str]:
        """vLLM's parameter names of the loaded model (for checks)."""

        def names(worker) -> list[str]:
            return [n for n, _ in worker.model_runner.model.named_parameters()]

        return self.llm.collective_rpc(names)[0]

    def close(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None


class VllmGeneration:
    """The actor's generation stage on vLLM inside a Nereus job; one instance per rank.

    Driver ranks (first GPU of a generation replica) own a VllmEngine; every rank takes
    part in the compiled sync, whose target is the engines' input layout
    (`engine_placement`). `push(plan, training_state)` is collective: it moves this step's
    trained weights and loads them into the engines. When a plan changes the generation
    layout, the engines are restarted on the new drivers with the new tp (vLLM cannot
    change its TP degree live), from the weights just synced."""

    def __init__(self, module, plan: str, *, workdir: str | os.PathLike, source: str = "actor.training",
                 target: str = "actor.generation", sync_mode: str = "dense", sync_full_every: int = 0,
                 **engine_options):
        import torch.distributed as dist

        self.module, self.source, self.target = module, source, target
        self.rank = dist.get_rank()
        self.workdir, self.engine_options = Path(workdir), engine_options
        # sync_mode "delta": only changed words cross between ranks; the driver still hands
        # the engine whole tensors (vLLM's reload_weights has no sparse in-place update)
        self.sync = WeightSync(module, source=source, target=target, engine_input=True, mode=sync_mode,
                               full_every=sync_full_every)
        self.engine: Optional[VllmEngine] = None
        self._layout = None
        self.plan = plan

    def _driver_tp(self, plan: str) -> Optional[int]:
        placement = self.module.plan(plan).placement(self.target)
        replica = driver_replica(placement, self.rank)
        return None if replica is None else placement.tp

    def push(self, plan: str, source_state: dict, reload: bool = True):
        """Collective: sync `source_state` (this rank's training shards) into the engines
        of `plan`, starting or restarting them when the layout changed (`reload=False`:
        an engine that stays keeps the weights it has). Returns the SyncResult (its
        weights are the engine input on driver ranks, {} elsewhere)."""
        result = self.sync.run(plan, source_state)
        layout = self._driver_tp(plan)
        if layout != self._layout and self.engine is not None:
            self.engine.close()
            self.engine = None
        if layout is not None and self.engine is None:
            model = self.module.model(self.target.partition(".")[0])
            self.engine = VllmEngine(model, result.weights, workdir=self.workdir / f"{plan}-{self.rank}",
                                     tp=layout, **self.engine_options)
        elif layout is not None and reload:
            self.engine.update_weights(result.weights)
        self._layout, self.plan = layout, plan
        return result

    def drivers(self, plan: str) -> tuple:
        """(driver rank, tp) of each engine in `plan`: where the engines run and how wide."""
        placement = self.module.plan(plan).placement(self.target)
        return tuple((placement.replica_gpus(r)[0], placement.tp) for r in range(placement.dp))

    def follow(self, plan: str, source_state: dict):
        """Collective, after a plan transition: put the engines where `plan` wants them.
        When no engine moves (same drivers, same tp) nothing runs and None is returned;
        otherwise a push whose engines that stay keep their weights (already current) and
        moved ones start from the synced weights. Returns that push's SyncResult."""
        if self.drivers(plan) == self.drivers(self.plan):
            self.plan = plan
            return None
        return self.push(plan, source_state, reload=False)

    def generate(self, prompts: torch.Tensor, max_new_tokens: int, uniforms: Optional[torch.Tensor] = None,
                 temperature: float = 1.0, greedy: bool = False, pad: Optional[torch.Tensor] = None
                 ) -> Optional[torch.Tensor]:
        """This driver's engine generates (None on ranks that drive no replica)."""
        if self.engine is None:
            return None
        return self.engine.generate(prompts, max_new_tokens, uniforms, temperature, greedy, pad)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def check_complete(model: Model, weights: Iterable[str]) -> None:
    """Raise NereusError unless `weights` names every lm weight of `model` exactly."""
    from nereus.models import tensor_table

    want = {s.name for s in tensor_table(model)}
    have = {local_name(n) for n in weights}
    if want != have:
        missing, extra = sorted(want - have), sorted(have - want)
        raise NereusError(f"weights for the engine: missing {missing[:3]}, unexpected {extra[:3]}",
                          hint="the engine takes a replica's whole weights (engine_placement's layout)")


__all__ = ["VllmEngine", "VllmGeneration", "check_complete", "driver_replica", "engine_placement", "hf_checkpoint_weights",
           "hf_config", "local_name", "row_seeds", "save_hf_checkpoint", "to_vllm_weights", "vllm_name"]
