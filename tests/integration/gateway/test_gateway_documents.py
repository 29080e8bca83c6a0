"""Documents computed for reuse (engine.documents) into a real node, found in prompts.

Each document is kept twice: after the system prompt, with the system prompt's
tokens in front, and after the system prompt and a primer, under its tokens
alone. A prompt's first document must come back in the first form (exact), the
others in the second, even when two documents are as long as each other (the
first forms then share their first tokens and their length).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvmesh.engine.blend import blend_prefill
from kvmesh.engine.documents import DocumentWriter
from kvmesh.engine.llama import LlamaModel
from kvmesh.engine.segment_store import SegmentStore
from tests.integration.gateway.support import Stack
from tests.support.small_llama import write_small_llama

SYSTEM = list(range(10, 30))
PRIMER = list(range(300, 340))
DOC_A = list(range(100, 140))
DOC_B = list(range(200, 240))  # as long as DOC_A
QUESTION = [7, 8, 9]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaModel]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # exactness, not speed, on a host shared with other suites
    yield LlamaModel.load(write_small_llama(tmp_path_factory.mktemp("llama") / "m"))
    torch.set_num_threads(before)


def _store(stack: Stack, model: LlamaModel) -> SegmentStore:
    c = model.config
    return SegmentStore(
        stack.client.target, "small", c.rope, num_layers=c.num_layers, kv_heads=c.num_kv_heads
    )


def test_the_first_document_comes_back_exact_and_the_others_primed(
    stack: Stack, model: LlamaModel
) -> None:
    with _store(stack, model) as store:
        writer = DocumentWriter(model, store, SYSTEM, PRIMER)
        assert writer.put(DOC_A) == 2
        assert writer.put(DOC_B) == 2
        assert writer.put(DOC_B) == 0  # both forms there already
        for first, second in ((DOC_A, DOC_B), (DOC_B, DOC_A)):
            prompt = SYSTEM + first + second + QUESTION
            segments = store.segments(prompt)
            assert [(s.tokens, s.kv is not None) for s in segments] == [
                (SYSTEM + first, True),
                (second, True),
                (QUESTION, False),
            ]
            # The first form is the prompt's own prefill of its rows.
            logits, full = model.prefill(prompt)
            lead = segments[0].kv
            assert lead is not None
            rows = len(SYSTEM + first)
            for layer in range(model.num_layers):
                torch.testing.assert_close(lead.keys[layer], full.keys[layer][:rows])
                torch.testing.assert_close(lead.values[layer], full.values[layer][:rows])
            # The second form was computed after the primer, not after the system
            # prompt alone.
            _, alone = model.prefill(SYSTEM + second)
            primed = segments[1].kv
            assert primed is not None
            last = model.num_layers - 1
            assert not torch.allclose(primed.values[last], alone.values[last][len(SYSTEM) :])
            # Blending reuses every stored row; recomputing them all is the prefill.
            assert blend_prefill(model, segments, 0.0).reused_tokens == rows + len(second)
            torch.testing.assert_close(blend_prefill(model, segments, 1.0).logits, logits)
        assert stack.locked() == 0


def test_empty_texts_are_refused_by_name(stack: Stack, model: LlamaModel) -> None:
    with _store(stack, model) as store:
        with pytest.raises(ValueError, match="system prompt"):
            DocumentWriter(model, store, [], PRIMER)
        with pytest.raises(ValueError, match="primer"):
            DocumentWriter(model, store, SYSTEM, [])
        with pytest.raises(ValueError, match="document"):
            DocumentWriter(model, store, SYSTEM, PRIMER).put([])
