"""Writes examples/rl/tiny-llama: the random Llama-3.1-shaped checkpoint (config.json +
model.safetensors, 0.3 MB) that examples/rl/grpo-hf-cpu.nir trains from. transformers'
own initialisation (normal(0, 0.02), norms 1) with a fixed seed; run from the repository
root with `nereus[hf]` installed: `python examples/rl/make_tiny_llama.py`."""

from pathlib import Path

import torch
import transformers

config = transformers.LlamaConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=32, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64},
    bos_token_id=10, eos_token_id=10)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).eval()
model.save_pretrained(Path(__file__).parent / "tiny-llama")
