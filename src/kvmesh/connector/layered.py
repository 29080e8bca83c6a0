"""Loads by layer: a retrieve cut into parts by layers, so the forward pass starts early.

An engine that waits for each layer's KV right before that layer's attention
(vLLM calls ``wait_for_layer_load`` there) need not wait for a whole load
before its forward pass: the worker sends the retrieve as a few parts of
consecutive layers, in layer order, and the forward pass of layer ``i`` waits
only for the part that holds ``i``. The first part is one layer, each next one
twice the size of the one before, so the node copies ahead of the forward pass
with few calls (30 layers: 5 calls). See docs/vllm.md, "Loads by layer".
"""

from __future__ import annotations

import bisect
import threading


def layer_groups(num_layers: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, end)`` ranges covering ``num_layers`` layers: 1, 2, 4, ... layers."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    groups = []
    start, size = 0, 1
    while start < num_layers:
        end = min(start + size, num_layers)
        groups.append((start, end))
        start, size = end, size * 2
    return groups


class LayeredLoad:
    """Which parts of one load by layers are done; the forward pass waits on them.

    The thread running the parts calls :meth:`part_done` after each and
    :meth:`finish` at the end, whatever happened (a failed part releases every
    waiter: the load is reported failed and the engine recomputes the blocks).
    """

    def __init__(self, groups: list[tuple[int, int]]) -> None:
        self.groups = groups
        self._starts = [start for start, _ in groups]
        self._done = [threading.Event() for _ in groups]

    def part_done(self, part: int) -> None:
        self._done[part].set()

    def finish(self) -> None:
        for event in self._done:
            event.set()

    def wait_for_layer(self, layer: int | None) -> None:
        """Block until the part holding ``layer`` is done (None or out of range: every part)."""
        if layer is None or not 0 <= layer < self.groups[-1][1]:
            for event in self._done:
                event.wait()
            return
        self._done[bisect.bisect_right(self._starts, layer) - 1].wait()
