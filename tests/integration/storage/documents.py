"""A CacheBlend document in the test engine's geometry: raw keys and values, written into
a request's tokens with the keys roped where they sit, and checked there.

The oracle of every segment test: RoPE applied directly (kvmesh.kernels.rope.apply_rope)
to the raw keys at a position is what a full prefill would have written there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvmesh.api.common.v1 import common_pb2
from kvmesh.kernels.rope import RopeParams, apply_rope
from tests.integration.storage.support import BLOCK_SIZE, HEAD_DIM, KV_HEADS, NUM_LAYERS, Engine

#: The RoPE parameters the test engines register, and the same as kvmesh's type.
ROPE = common_pb2.RopeParameters(base=10000.0, style=common_pb2.ROPE_STYLE_NEOX)
PARAMS = RopeParams(head_dim=HEAD_DIM, base=10000.0)
#: fp16 keys rotated twice (there and back) stay this close to keys roped once.
KEY_TOLERANCE = 1e-2


def rows(table: list[int], start: int, count: int) -> list[tuple[int, int]]:
    """(block, row) of each token of ``[start, start + count)`` in a request's table."""
    return [(table[t // BLOCK_SIZE], t % BLOCK_SIZE) for t in range(start, start + count)]


class Document:
    """``count`` tokens' raw keys (fp32) and values (fp16), ``[layers, tokens, heads, dim]``."""

    def __init__(self, count: int, seed: int = 3) -> None:
        rng = np.random.default_rng(seed)
        shape = (NUM_LAYERS, count, KV_HEADS, HEAD_DIM)
        self.count = count
        self.keys = rng.standard_normal(shape).astype(np.float32)
        self.values = rng.standard_normal(shape).astype(np.float16)

    def roped(self, start: int) -> np.ndarray[Any, Any]:
        """The keys roped at ``start..``, as fp16."""
        positions = torch.arange(start, start + self.count)
        out = [apply_rope(torch.from_numpy(layer), positions, PARAMS) for layer in self.keys]
        return torch.stack(out).to(torch.float16).numpy()

    def write(self, engine: Engine, table: list[int], start: int) -> None:
        """Put the document into a request's tokens at ``start`` (keys roped there)."""
        keys = self.roped(start)
        for t, (block, row) in enumerate(rows(table, start, self.count)):
            engine.kv[:, 0, block, row] = keys[:, t]
            engine.kv[:, 1, block, row] = self.values[:, t]

    def read(self, engine: Engine, table: list[int], start: int) -> np.ndarray[Any, Any]:
        """``[layers, 2, tokens, heads, dim]`` of the request's tokens at ``start``."""
        picked = [np.asarray(engine.kv[:, :, b, r]) for b, r in rows(table, start, self.count)]
        return np.stack(picked, axis=2)

    def assert_at(self, engine: Engine, table: list[int], start: int) -> None:
        """The request holds the document at ``start``: keys as if computed there, values
        bit for bit (they carry no position)."""
        got = self.read(engine, table, start)
        np.testing.assert_allclose(
            got[:, 0].astype(np.float32),
            self.roped(start).astype(np.float32),
            atol=KEY_TOLERANCE,
            rtol=0,
        )
        assert np.array_equal(got[:, 1], self.values)
