"""KV movement between engine paged layouts and kvmesh's L1 chunk format.

Public API:

- :class:`KVLayoutKind`, :class:`PagedKVCache` — the engine's per-layer paged
  tensors, validated once.
- :func:`gather_chunks` (store: paged → chunks) and :func:`scatter_chunks`
  (retrieve: chunks → paged), the fast ops; :func:`set_copy_threads` /
  :func:`copy_threads` for how many threads one CPU copy uses.
- :func:`ref_gather_chunks` / :func:`ref_scatter_chunks` — the plain reference
  implementation the tests compare against.
"""

from kvmesh.kernels._plan import BlockIds, blocks_for_tokens
from kvmesh.kernels.layouts import SUPPORTED_DTYPES, KVLayoutKind, PagedKVCache, paged_layer_shape
from kvmesh.kernels.ops import copy_threads, gather_chunks, scatter_chunks, set_copy_threads
from kvmesh.kernels.reference import ref_gather_chunks, ref_scatter_chunks

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
