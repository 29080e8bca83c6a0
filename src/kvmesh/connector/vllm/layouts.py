"""What kvmesh reads off vLLM's objects: a request's salt and the CPU KV layout.

Importing this module loads no vLLM (the ISA probe imports it when called), so
kvmesh's own tests and tools can use it without starting vLLM's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.api.common.v1 import common_pb2
from kvmesh.common.keys import salt_with_lora

if TYPE_CHECKING:
    import torch
    from vllm.v1.request import Request as VLLMRequest


def cache_salt(request: VLLMRequest) -> str:
    """The request's salt, with its LoRA adapter: different adapters never share KV."""
    lora = request.lora_request
    if lora is None:
        return request.cache_salt or ""
    return salt_with_lora(request.cache_salt or "", lora.lora_name, lora.lora_int_id)


#: vLLM's CPU attention ISA → the KV layout it stores (kvmesh.kernels.vllm_cpu).
CPU_LAYOUTS = {
    "vec": common_pb2.KV_LAYOUT_KIND_VLLM_CPU,
    "amx": common_pb2.KV_LAYOUT_KIND_VLLM_CPU_AMX,
}


def cpu_layout(
    first: torch.Tensor, *, vllm_block_size: int
) -> tuple[common_pb2.KVLayoutKind.ValueType, str | None]:
    """The kvmesh layout of vLLM's CPU KV cache, or why kvmesh cannot move it."""
    unspecified = common_pb2.KV_LAYOUT_KIND_UNSPECIFIED
    if first.dim() != 4 or first.shape[3] % 2:
        return unspecified, (
            f"unexpected KV tensor shape {tuple(first.shape)} (want [blocks, heads, block, 2*dim])"
        )
    if first.shape[2] != vllm_block_size:
        return unspecified, (
            f"KV blocks of {first.shape[2]} tokens, vLLM's block size is {vllm_block_size}"
        )
    head_dim = first.shape[3] // 2
    try:
        # The ISA decides how vLLM's CPU attention lays out K and V inside a block.
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = str(_get_attn_isa(first.dtype, vllm_block_size, head_dim))
    except (ImportError, TypeError, NotImplementedError):
        isa = "unknown"
    kind = CPU_LAYOUTS.get(isa)
    if kind is None:
        return unspecified, (
            f"vLLM's CPU attention uses the {isa!r} KV layout; kvmesh moves "
            f"{' and '.join(repr(k) for k in CPU_LAYOUTS)}"
        )
    return kind, None
