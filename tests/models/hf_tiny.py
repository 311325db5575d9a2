"""Tiny random transformers models of each family, written as checkpoints (config.json +
model.safetensors), for the numerics and loading tests. Needs transformers (`nereus[hf]`)."""

from __future__ import annotations

from pathlib import Path

import torch

transformers = __import__("pytest").importorskip("transformers")

# name -> (transformers config class, its arguments): each exercises one family's traits
TINY: dict[str, tuple[str, dict]] = {
    # GQA (4 query heads on 2 KV heads), Llama-3.1 rope scaling with a short original context
    "llama31": ("LlamaConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=96, rms_norm_eps=1e-5,
                                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                    rope_theta=500000.0)),
    # Llama-3.2-like: tied embeddings, an explicit head_dim that is not hidden / heads
    "llama32_tied": ("LlamaConfig", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=1, head_dim=32, vocab_size=96,
                                         tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0,
                                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 32})),
    # Qwen2.5: q/k/v biases, eps 1e-6, theta 1e6
    "qwen2": ("Qwen2Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=96, rms_norm_eps=1e-6, rope_theta=1e6)),
    # Qwen3: q/k RMSNorm, head_dim 32 with hidden 64 and 4 heads
    "qwen3": ("Qwen3Config", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32, vocab_size=96, rms_norm_eps=1e-6,
                                  rope_theta=1e6)),
}
# Qwen3-MoE (kept apart from TINY: transformers 5's state_dict() stacks the experts, so its
# tests read the per-expert names save_pretrained writes): 4 experts of width 8, 2 per token
MOE_TINY: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=8, vocab_size=32, num_experts=4, num_experts_per_tok=2,
                                         norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6)),
}
CLASSES = {"LlamaConfig": "LlamaForCausalLM", "Qwen2Config": "Qwen2ForCausalLM", "Qwen3Config": "Qwen3ForCausalLM",
           "Qwen3MoeConfig": "Qwen3MoeForCausalLM"}


def tiny_model(name: str, seed: int = 0, value_head: bool = False, sizes: dict | None = None):
    """A random fp32 transformers model; norms and biases random too, so that each weight
    changes the logits (transformers initializes norms to 1 and biases to 0). value_head:
    the family's ...ForSequenceClassification with one label (a reward model). `sizes`:
    config arguments that replace the family's tiny ones."""
    config_class, arguments = {**TINY, **MOE_TINY}[name]
    arguments = {**arguments, **(sizes or {}), **({"num_labels": 1} if value_head else {})}
    config = getattr(transformers, config_class)(**arguments)
    torch.manual_seed(seed)
    model_class = CLASSES[config_class]
    if value_head:
        model_class = model_class.replace("ForCausalLM", "ForSequenceClassification")
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name:
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            elif parameter_name.endswith("bias"):
                parameter.copy_(0.1 * torch.randn_like(parameter))
            elif parameter_name.endswith("mlp.gate.weight"):  # a decisive router: no near-ties in top-k
                parameter.copy_(torch.randn_like(parameter))
            elif ".mlp.experts." in parameter_name:  # experts that weigh in the logits (init std is 0.02)
                parameter.copy_(0.2 * torch.randn_like(parameter))
    return model


def write_checkpoint(name: str, directory: Path, seed: int = 0, dtype=torch.float32, value_head: bool = False,
                     sizes: dict | None = None):
    """Save a tiny model with save_pretrained (config.json + model.safetensors); returns it."""
    model = tiny_model(name, seed, value_head, sizes).to(dtype)
    model.save_pretrained(directory)
    return model


def nir(checkpoint: str, placement: str = "actor.inference dp 1 on 0", extra: str = "") -> str:
    """A .nir file that runs `model actor = hf(checkpoint)` in inference."""
    return ("cluster c { nodes 1 gpus_per_node 8 gpu { mem 80GB flops 100TFLOPS hbm 1TB/s } intra 100GB/s "
            f"inter 10GB/s host_mem 100GB }}\nmodel actor = hf(\"{checkpoint}\"){extra}\n"
            "workload w { batch 2 prompt 4 response 4 microbatch 1 inference: actor }\n"
            f"plan A {{ {placement} }}\n")
