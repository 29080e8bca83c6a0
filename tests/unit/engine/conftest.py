"""Engine tests run torch on one thread.

The machines have two cores shared with other suites; two OpenMP threads
fighting other processes for them are several times slower than one thread,
and the tests assert exactness, never speed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: A small Llama for the loader and blend tests: 4 layers, grouped-query attention.
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


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face folder of a small random-weight Llama (float32), written by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("small-llama")
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
