"""Some layers of a chunk: what one part of a load split by layers copies.

An engine that waits for each layer's KV just before that layer's attention
(vLLM's ``wait_for_layer_load``) can start its forward pass once the first
layers are in place, while the node copies the rest: a retrieve may name a
range of layers (``LayerRange``, docs/vllm.md, "Loads by layer").

:func:`select_layers` narrows a cache and its chunks to layers
``[start, end)``. The L1 chunk object is ``[kv_size, num_layers, tokens,
hidden]``, so a layer range of it is a strided view whose every
``[plane, layer]`` run is still contiguous: vLLM's CPU layouts are copied a
layer at a time and take that view as is; the other kinds' kernels copy whole
contiguous chunks, so they get the range copied out first (one extra read of
those layers; those kinds are loaded by layer only on request).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.common.layer_range import check_layer_range
from kvmesh.kernels.layouts import PagedKVCache


def select_layers(
    kv: PagedKVCache, chunks: Sequence[torch.Tensor], start: int, end: int
) -> tuple[PagedKVCache, list[torch.Tensor]]:
    """``kv`` and ``chunks`` (full chunk tensors of ``kv``) narrowed to layers ``[start, end)``."""
    check_layer_range(kv.num_layers, start, end)
    if (start, end) == (0, kv.num_layers):
        return kv, list(chunks)
    sub = kv.sub_layers(start, end)
    if kv.kind.is_vllm_cpu:
        return sub, [chunk[:, start:end] for chunk in chunks]
    return sub, [chunk[:, start:end].contiguous() for chunk in chunks]
