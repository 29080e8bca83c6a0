"""A small random-weight Llama written as a Hugging Face folder, for engine and blend tests."""

from __future__ import annotations

from pathlib import Path

import torch

#: 4 layers, grouped-query attention.
SMALL_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
}


def write_small_llama(folder: Path) -> Path:
    """Write the model (float32, seeded) into ``folder`` with transformers; returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SMALL_LLAMA, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    # Random init gives near-uniform attention; larger projections make positions and
    # context matter, so a misplaced or stale key shows in the logits.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    model.save_pretrained(folder)
    return folder
