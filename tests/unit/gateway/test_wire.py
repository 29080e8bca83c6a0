"""The GatewayService's conversions between messages and the core's plain values."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.common.errors import InvalidArgument
from kvmesh.common.node_types import Slot
from kvmesh.gateway import wire
from kvmesh.gateway.core import EngineSpec, PrefetchStatus


def kv_layout(**overrides: object) -> common_pb2.KVLayout:
    fields: dict[str, object] = {
        "kind": common_pb2.KV_LAYOUT_KIND_FLASH_ATTN,
        "dtype": common_pb2.DTYPE_FLOAT16,
        "num_layers": 2,
        "kv_heads": 2,
        "head_dim": 8,
        "block_size": 16,
    }
    fields.update(overrides)
    return common_pb2.KVLayout(**fields)  # type: ignore[arg-type]


def test_a_prompt_range_keeps_every_field_and_its_tokens_as_uint32() -> None:
    rng = gateway_pb2.PromptRange(
        request_id="r", model_name="m", world_size=2, cache_salt="s",
        token_ids=[1, 2, 70_000], start_token=0, end_token=3,
    )  # fmt: skip
    spec = wire.prompt_range(rng)
    assert (spec.request_id, spec.model_name, spec.world_size, spec.cache_salt) == (
        "r",
        "m",
        2,
        "s",
    )
    assert (spec.start_token, spec.end_token) == (0, 3)
    assert spec.token_ids.dtype == np.uint32
    assert spec.token_ids.tolist() == [1, 2, 70_000]


def test_an_engine_spec_comes_from_either_registration() -> None:
    kv = gateway_pb2.RegisterKVCacheRequest(
        engine_id="e", model_name="m", world_size=2, worker_id=1, layout=kv_layout()
    )
    ctx = gateway_pb2.RegisterEngineContextRequest(
        engine_id="e", model_name="m", world_size=2, worker_id=1,
        layout=gateway_pb2.EngineContextLayout(block_size=16),
    )  # fmt: skip
    assert wire.engine_spec(kv) == wire.engine_spec(ctx) == EngineSpec("e", "m", 2, 1, 16)


def test_a_kv_cache_registration_needs_a_layout() -> None:
    with pytest.raises(InvalidArgument) as err:
        wire.memory_registration(gateway_pb2.RegisterKVCacheRequest(engine_id="e"))
    assert err.value.field == "layout"
    forward = wire.memory_registration(
        gateway_pb2.RegisterKVCacheRequest(engine_id="e", layout=kv_layout())
    )
    assert (forward.engine_id, forward.layout) == ("e", kv_layout())


def test_the_fingerprint_tells_layouts_apart() -> None:
    first = gateway_pb2.RegisterKVCacheRequest(engine_id="e", layout=kv_layout())
    same = gateway_pb2.RegisterKVCacheRequest(engine_id="other", layout=kv_layout())
    other = gateway_pb2.RegisterKVCacheRequest(engine_id="e", layout=kv_layout(num_layers=3))
    assert wire.layout_fingerprint(first) == wire.layout_fingerprint(same)
    assert wire.layout_fingerprint(first) != wire.layout_fingerprint(other)


def test_chunk_bytes_follow_the_layout_and_are_unknown_without_a_dtype() -> None:
    assert wire.chunk_bytes(kv_layout(), 64) == 2 * 2 * 64 * 2 * 8 * 2
    mla = kv_layout(kind=common_pb2.KV_LAYOUT_KIND_MLA, kv_heads=1)
    assert wire.chunk_bytes(mla, 64) == 1 * 2 * 64 * 1 * 8 * 2
    assert wire.chunk_bytes(kv_layout(dtype=common_pb2.DTYPE_UNSPECIFIED), 64) == 0


def test_an_engine_context_needs_a_dtype() -> None:
    layout = gateway_pb2.EngineContextLayout(dtype=common_pb2.DTYPE_BFLOAT16)
    assert wire.itemsize(layout) == 2
    with pytest.raises(InvalidArgument) as err:
        wire.itemsize(gateway_pb2.EngineContextLayout())
    assert err.value.field == "layout.dtype"


def test_answers_carry_every_field() -> None:
    status = wire.prefetch_status(PrefetchStatus(True, 3, 192, 2, 1))
    assert (status.completed, status.hit_chunks, status.hit_tokens) == (True, 3, 192)
    assert (status.l1_hit_chunks, status.l2_hit_chunks) == (2, 1)
    slot = wire.chunk_slot(Slot(4, "/dev/shm/x", 4096, 512))
    assert slot.chunk_index == 4
    assert (slot.region.path, slot.region.offset_bytes, slot.region.size_bytes) == (
        "/dev/shm/x",
        4096,
        512,
    )
