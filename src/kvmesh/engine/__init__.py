"""kvmesh's own engines: a tiny transformer with a vLLM-style paged KV cache, and a blender.

Besides what is exported here, ``engine.llama`` runs a Llama-architecture HF
model layer by layer, ``engine.blend`` is CacheBlend's selective recompute over
it and ``engine.segment_store`` keeps documents' K/V in a storage node
(docs/blend.md).

Public API: :class:`Engine` / :class:`EngineConfig` / :class:`RequestOutput`
(the step loop), :class:`TinyTransformer` / :class:`ModelConfig` (the model),
:class:`SharedKVCache` and :class:`BlockAllocator` (the paged KV cache).
"""

from kvmesh.engine.engine import Engine, EngineConfig, RequestOutput
from kvmesh.engine.kv_cache import (
    NULL_BLOCK_ID,
    BlockAllocator,
    LayerRegion,
    NoFreeBlocksError,
    SharedKVCache,
    blocks_needed,
)
from kvmesh.engine.model import ModelConfig, TinyTransformer

__all__ = [
    "NULL_BLOCK_ID",
    "BlockAllocator",
    "Engine",
    "EngineConfig",
    "LayerRegion",
    "ModelConfig",
    "NoFreeBlocksError",
    "RequestOutput",
    "SharedKVCache",
    "TinyTransformer",
    "blocks_needed",
]
