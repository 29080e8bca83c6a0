"""A tiny random-weight Llama and a word-level tokenizer, made locally (no download).

Real vLLM runs it like any Hugging Face model directory. Prompts are token ids,
so the tokenizer only has to load; its words are ``w0 … w31999``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

#: Shape of the model: small enough for 2 cores, long context.
TINY = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 16384,
}
_MARKER = "kvmesh-tiny-model.json"


def make_tiny_model(folder: Path, seed: int = 0) -> Path:
    """Write the model into ``folder`` (reused when an identical one is already there)."""
    folder = Path(folder)
    marker = folder / _MARKER
    wanted = {"shape": TINY, "seed": seed, "tokenizer": 2}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return folder
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**TINY, tie_word_embeddings=False, torch_dtype="bfloat16")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(TINY["vocab_size"])}
    # Unknown words are w0: a separate "<unk>" sharing id 0 made loading the saved
    # tokenizer lose one of the two at random (a hash map's order).
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="w0", bos_token="w1", eos_token="w2"
    ).save_pretrained(folder)
    marker.write_text(json.dumps(wanted))
    logger.info("made the tiny model in %s", folder)
    return folder
