"""KVLayout: the geometry of an engine's paged KV cache, and of the L1 chunk objects it fills.

An engine registers one :class:`KVLayout` per instance (kind, layers, blocks,
block size, heads, head size, dtype); every field is checked on
construction, within bounds that no real model reaches, so a hostile layout
cannot ask for absurd mappings or index arithmetic. :func:`chunk_shape` and
:func:`chunk_nbytes` give the L1 object that holds one chunk of it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvmesh.common.errors import InvalidArgument
from kvmesh.kernels.kinds import KVLayoutKind, paged_layer_shape
from kvmesh.kernels.rope_params import RopeParams

if TYPE_CHECKING:  # torch loads with the first layout built (an engine registering)
    import torch

# Bounds that no real model reaches; they keep a hostile layout from asking for
# absurd mappings or index arithmetic (the region size check does the rest).
_MAX_LAYERS = 4096
_MAX_BLOCK_SIZE = 1 << 16
_MAX_KV_HEADS = 4096
_MAX_HEAD_DIM = 1 << 16
_MAX_NUM_BLOCKS = 1 << 31
_MAX_LAYER_BYTES = 1 << 44


@functools.cache
def _dtype_names() -> dict[str, torch.dtype]:
    import torch

    return {
        "float16": torch.float16,
        "half": torch.float16,
        "fp16": torch.float16,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float32": torch.float32,
        "float": torch.float32,
        "fp32": torch.float32,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8": torch.float8_e4m3fn,  # vLLM's kv_cache_dtype "fp8" is e4m3
        "float8_e5m2": torch.float8_e5m2,
        "fp8_e5m2": torch.float8_e5m2,
        "uint8": torch.uint8,
    }


def parse_dtype(value: torch.dtype | str) -> torch.dtype:
    """A KV dtype from a torch dtype or a name such as ``"bfloat16"`` or ``"fp8_e4m3"``.

    Raises :class:`InvalidArgument` for unknown or unsupported dtypes.
    """
    import torch

    from kvmesh.kernels.layouts import SUPPORTED_DTYPES

    if isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        names = _dtype_names()
        if name not in names:
            raise InvalidArgument(f"unknown KV dtype {value!r}", field="layout.dtype")
        dtype = names[name]
    else:
        raise InvalidArgument(
            f"dtype must be a torch.dtype or a name, got {type(value).__name__}",
            field="layout.dtype",
        )
    if dtype not in SUPPORTED_DTYPES:
        raise InvalidArgument(f"unsupported KV dtype {dtype}", field="layout.dtype")
    return dtype


@dataclass(frozen=True, init=False)
class KVLayout:
    """Geometry of one engine instance's paged KV cache (one entry per layer, all alike).

    ``kind`` and ``dtype`` may be given by name; they are normalized on
    construction, and every field is validated (raising
    :class:`InvalidArgument` naming ``layout.<field>``). MLA caches have one
    latent plane of ``head_dim`` per token, so ``kv_heads`` must be 1.
    """

    kind: KVLayoutKind
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    #: How the model rotates its keys; None: segments (CacheBlend) are refused.
    rope: RopeParams | None

    def __init__(
        self,
        kind: KVLayoutKind | str,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
        *,
        rope: RopeParams | None = None,
    ) -> None:
        if isinstance(kind, str):
            try:
                kind = KVLayoutKind[kind.strip().upper()]
            except KeyError:
                raise InvalidArgument(
                    f"unknown KV layout kind {kind!r}", field="layout.kind"
                ) from None
        if not isinstance(kind, KVLayoutKind):
            raise InvalidArgument(f"unknown KV layout kind {kind!r}", field="layout.kind")
        limits = {
            "num_layers": (num_layers, _MAX_LAYERS),
            "num_blocks": (num_blocks, _MAX_NUM_BLOCKS),
            "block_size": (block_size, _MAX_BLOCK_SIZE),
            "kv_heads": (kv_heads, _MAX_KV_HEADS),
            "head_dim": (head_dim, _MAX_HEAD_DIM),
        }
        for name, (value, limit) in limits.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgument(
                    f"layout.{name} must be an int, got {type(value).__name__}",
                    field=f"layout.{name}",
                )
            if not 0 < value <= limit:
                raise InvalidArgument(
                    f"layout.{name} must be in [1, {limit}], got {value}", field=f"layout.{name}"
                )
        if kind is KVLayoutKind.MLA and kv_heads != 1:
            raise InvalidArgument(
                f"MLA caches have one latent plane per token: kv_heads must be 1, got {kv_heads}",
                field="layout.kv_heads",
            )
        torch_dtype = parse_dtype(dtype)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "num_layers", num_layers)
        object.__setattr__(self, "num_blocks", num_blocks)
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "kv_heads", kv_heads)
        object.__setattr__(self, "head_dim", head_dim)
        object.__setattr__(self, "dtype", torch_dtype)
        if rope is not None and (kind is KVLayoutKind.MLA or rope.head_dim != head_dim):
            raise InvalidArgument(
                "RoPE parameters need a K/V layout whose head_dim they share "
                f"(layout {kind.name}, head_dim {head_dim}; RoPE head_dim {rope.head_dim})",
                field="layout.rope",
            )
        object.__setattr__(self, "rope", rope)
        if self.layer_nbytes > _MAX_LAYER_BYTES:
            raise InvalidArgument(
                f"one layer would be {self.layer_nbytes} bytes, more than {_MAX_LAYER_BYTES}",
                field="layout",
            )

    @property
    def kv_size(self) -> int:
        """K/V planes per chunk object: 2, or 1 for MLA."""
        return self.kind.kv_size

    @property
    def hidden(self) -> int:
        """Elements per token per plane (``kv_heads * head_dim``)."""
        return self.kv_heads * self.head_dim

    @property
    def itemsize(self) -> int:
        """Bytes per element of :attr:`dtype`."""
        return self.dtype.itemsize

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """Shape of one layer's paged tensor."""
        return paged_layer_shape(
            self.kind, self.num_blocks, self.block_size, self.kv_heads, self.head_dim
        )

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's paged tensor (what each handle's region must measure)."""
        n = self.itemsize
        for d in self.layer_shape:
            n *= d
        return n


def chunk_shape(layout: KVLayout, num_tokens: int) -> tuple[int, int, int, int]:
    """Shape ``[kv_size, num_layers, num_tokens, kv_heads*head_dim]`` of an L1 chunk object."""
    check_num_tokens(num_tokens, "num_tokens")
    return (layout.kv_size, layout.num_layers, num_tokens, layout.hidden)


def chunk_nbytes(layout: KVLayout, num_tokens: int) -> int:
    """Bytes of the L1 chunk object for ``num_tokens`` tokens of ``layout``."""
    kv_size, num_layers, tokens, hidden = chunk_shape(layout, num_tokens)
    return kv_size * num_layers * tokens * hidden * layout.itemsize


def check_num_tokens(value: object, field_name: str) -> int:
    """``value`` as a token count: an int >= 1 (InvalidArgument naming ``field_name``)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgument(f"{field_name} must be an int >= 1, got {value!r}", field=field_name)
    return int(value)
