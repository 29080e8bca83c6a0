"""Documents' K/V computed once, in the two forms a blend reuses (docs/blend.md,
"Computing documents for reuse").

A document's K/V depends on what came before it when it was computed. A
prompt gives it one of two contexts:

- *first*, right after the system prompt: the K/V computed right after the
  system prompt is exactly what the prompt's own prefill gives. It is kept
  with the system prompt's tokens in front (one segment, system prompt +
  document), so it is found only where the document really follows the
  system prompt, and it needs no recompute at all;
- *after other documents*: no stored K/V is exact there. Computed after the
  system prompt alone, the document's rows saw a few dozen tokens where the
  prompt gives them hundreds; computed after the system prompt and a
  *primer* (any document of the same kind), they are measurably closer to
  what the prompt computes (docs/blend.md has the figures). This form is
  kept under the document's tokens alone, found anywhere.

The segment index finds the longest stored segment at each position, so a
prompt's first document is served in the first form and the others in the
second.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.engine.llama import LlamaModel
from kvmesh.engine.segment_store import SegmentStore


class DocumentWriter:
    """Computes documents after ``system`` (and ``system`` + ``primer``) into ``store``."""

    def __init__(
        self,
        model: LlamaModel,
        store: SegmentStore,
        system: Sequence[int],
        primer: Sequence[int],
    ) -> None:
        if not system:
            raise ValueError("the system prompt has no tokens")
        if not primer:
            raise ValueError("the primer has no tokens")
        self.model = model
        self.store = store
        self.system = list(system)
        #: The system prompt's K/V (a prefix of every prompt).
        _, self.system_kv = model.prefill(self.system)
        self._primer_end = len(self.system) + len(primer)
        _, self._primed_kv = model.prefill(list(primer), past=self.system_kv)

    def put(self, document: Sequence[int]) -> int:
        """Store ``document`` in both forms; the number of forms that were not stored yet."""
        if not document:
            raise ValueError("the document has no tokens")
        tokens = list(document)
        _, first = self.model.prefill(tokens, past=self.system_kv)
        stored = int(self.store.put(self.system + tokens, first, source_start=0))
        _, primed = self.model.prefill(tokens, past=self._primed_kv)
        start = self._primer_end
        rows = primed.slice(start, start + len(tokens))
        stored += int(self.store.put(tokens, rows, source_start=start))
        return stored
