"""KV movement between engine paged layouts and kvmesh's L1 chunk format.

Public API:

- :class:`KVLayoutKind`, :class:`PagedKVCache` — the engine's per-layer paged
  tensors, validated once.
- :func:`gather_chunks` (store: paged → chunks) and :func:`scatter_chunks`
  (retrieve: chunks → paged), the fast ops; :func:`set_copy_threads` /
  :func:`copy_threads` for how many threads one CPU copy uses.
- :func:`ref_gather_chunks` / :func:`ref_scatter_chunks` — the plain reference
  implementation the tests compare against.

The names load on first use: importing the package (or its torch-free
modules, :mod:`~kvmesh.kernels.kinds` and :mod:`~kvmesh.kernels.native`)
loads no torch, so a storage node starts serving without it (about 0.9 s of
CPU) and loads it when the first engine registers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.kernels._plan import BlockIds, blocks_for_tokens
    from kvmesh.kernels.kinds import KVLayoutKind, paged_layer_shape
    from kvmesh.kernels.layouts import SUPPORTED_DTYPES, PagedKVCache
    from kvmesh.kernels.ops import gather_chunks, scatter_chunks
    from kvmesh.kernels.parallel import copy_threads, set_copy_threads
    from kvmesh.kernels.reference import ref_gather_chunks, ref_scatter_chunks

#: Where each public name lives.
_HOMES = {
    "BlockIds": "_plan",
    "blocks_for_tokens": "_plan",
    "KVLayoutKind": "kinds",
    "paged_layer_shape": "kinds",
    "SUPPORTED_DTYPES": "layouts",
    "PagedKVCache": "layouts",
    "copy_threads": "parallel",
    "gather_chunks": "ops",
    "scatter_chunks": "ops",
    "set_copy_threads": "parallel",
    "ref_gather_chunks": "reference",
    "ref_scatter_chunks": "reference",
}

__all__ = [
    "SUPPORTED_DTYPES",
    "BlockIds",
    "KVLayoutKind",
    "PagedKVCache",
    "blocks_for_tokens",
    "copy_threads",
    "gather_chunks",
    "paged_layer_shape",
    "ref_gather_chunks",
    "ref_scatter_chunks",
    "scatter_chunks",
    "set_copy_threads",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # later reads skip this function
    return value
