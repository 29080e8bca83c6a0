"""kvmesh's Llama loader against transformers' own LlamaForCausalLM, and its bad inputs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh.engine.llama import LlamaConfig, LlamaModel, ModelFolderError, SequenceKV

TOKENS = [5, 17, 300, 2, 44, 91, 8, 250, 511, 0, 7, 7, 120, 64, 33, 400]


@pytest.fixture(scope="module")
def model(llama_folder: Path) -> LlamaModel:
    return LlamaModel.load(llama_folder)


def test_logits_match_transformers_llama(llama_folder: Path, model: LlamaModel) -> None:
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(llama_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([TOKENS])).logits[0, -1]
    logits, kv = model.prefill(TOKENS)
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert len(kv) == len(TOKENS)
    assert len(kv.keys) == model.num_layers


def test_prefill_after_a_cached_prefix_equals_one_prefill(model: LlamaModel) -> None:
    whole, kv = model.prefill(TOKENS)
    _, prefix = model.prefill(TOKENS[:10])
    after, kv2 = model.prefill(TOKENS[10:], past=prefix)
    torch.testing.assert_close(after, whole, atol=1e-5, rtol=1e-5)
    for a, b in zip(kv.keys + kv.values, kv2.keys + kv2.values, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_decode_continues_the_prompt(model: LlamaModel) -> None:
    logits, kv = model.prefill(TOKENS)
    tokens = model.generate(logits, kv, 4)
    assert len(tokens) == 4
    # Each generated token is what a full prefill of the prompt so far predicts.
    for i, token in enumerate(tokens):
        again, _ = model.prefill(TOKENS + tokens[:i])
        assert int(torch.argmax(again)) == token


def test_read_attention_is_attend_with_its_weights(model: LlamaModel) -> None:
    """The explicit softmax gives attend's output within rounding, and weights that
    are each query's causal softmax over the keys, averaged over the heads."""
    hidden = model.embed(TOKENS)
    positions = torch.arange(len(TOKENS))
    _, keys, values = model.qkv(0, hidden, positions)
    rows = torch.tensor([3, 9, 15])  # some queries, over every key
    q, _, _ = model.qkv(0, hidden[rows], rows)
    attended, weights = model.read_attention(q, rows, keys, values, positions)
    torch.testing.assert_close(
        model.finish(0, hidden[rows], attended),
        model.attend(0, hidden[rows], q, rows, keys, values, positions),
        atol=1e-5,
        rtol=1e-5,
    )
    assert weights.shape == (3, len(TOKENS))
    torch.testing.assert_close(weights.sum(-1), torch.ones(3))
    assert torch.all(weights[0, 4:] == 0)  # row 3 sees positions 0..3 only
    c = model.config
    expanded = keys.repeat_interleave(c.num_heads // c.num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, expanded) / c.head_dim**0.5
    scores = scores.masked_fill(positions[None, :] > rows[:, None], float("-inf"))
    torch.testing.assert_close(weights, torch.softmax(scores, -1).mean(0))


def test_sequence_kv_slices_and_joins(model: LlamaModel) -> None:
    _, kv = model.prefill(TOKENS)
    joined = SequenceKV.cat([kv.slice(0, 5), kv.slice(5, len(TOKENS))])
    assert all(torch.equal(a, b) for a, b in zip(joined.keys, kv.keys, strict=True))
    assert joined.nbytes == kv.nbytes


def test_bad_token_ids_and_empty_prompts_are_refused(model: LlamaModel) -> None:
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 512\)"):
        model.prefill([1, 512])
    with pytest.raises(ValueError, match="at least one token"):
        model.prefill([])


def _config(**change: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    base.update(change)
    return {k: v for k, v in base.items() if v is not None}


def test_the_config_reads_both_places_of_rope_theta() -> None:
    assert LlamaConfig.from_hf(_config(rope_theta=5e5)).rope_theta == 5e5
    new_style = _config(rope_parameters={"rope_theta": 1e5, "rope_type": "default"})
    assert LlamaConfig.from_hf(new_style).rope.base == 1e5
    assert LlamaConfig.from_hf(_config()).head_dim == 4


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "only 'llama'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "RoPE scaling"),
        ({"vocab_size": None}, "no vocab_size"),
        ({"num_key_value_heads": 3, "num_attention_heads": 4}, "not a multiple"),
    ],
)
def test_configs_it_cannot_run_are_refused_by_name(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelFolderError, match=message):
        LlamaConfig.from_hf(_config(**change))


def test_folders_without_config_or_weights_are_refused(llama_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match=r"no readable config\.json"):
        LlamaModel.load(tmp_path)
    shutil.copy(llama_folder / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelFolderError, match=r"no model\.safetensors"):
        LlamaModel.load(tmp_path)
    config = json.loads((llama_folder / "config.json").read_text())
    config["num_hidden_layers"] += 1  # a layer the weights do not have
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(llama_folder / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ModelFolderError, match=r"no model\.layers\.4\."):
        LlamaModel.load(tmp_path)
