"""vLLM KV event batches: decoding untrusted payloads, and encoding what we re-publish."""

from __future__ import annotations

import msgpack
import pytest

from kvmesh.coordinator.core.engineevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventFormatError,
    chain_salt,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)


def test_a_batch_as_vllm_sends_it_decodes() -> None:
    # The layout vLLM 0.32's msgspec encoder writes (array batch, tagged map events).
    payload = msgpack.packb(
        [
            12.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [7, b"\x01\x02"],
                    "parent_block_hash": None,
                    "token_ids": [1, 2, 3, 4],
                    "block_size": 2,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [["salt-1"], None],
                    "group_idx": 0,
                    "session_id": "ignored",
                },
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            1,
        ],
        use_bin_type=True,
    )
    batch = decode_batch(payload)
    assert batch.ts == 12.5
    assert batch.data_parallel_rank == 1
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == (7, b"\x01\x02")
    assert stored.token_ids == (1, 2, 3, 4)
    assert stored.extra_keys == (("salt-1",), None)
    assert chain_salt(stored) == "salt-1"
    assert removed == BlockRemoved((7,), "GPU")
    assert cleared == AllBlocksCleared()


def test_encode_then_decode_is_the_identity() -> None:
    batch = EventBatch(
        3.0,
        (
            BlockStored((1, 2), 9, (5, 6, 7, 8), 2, medium="kvmesh-l1", extra_keys=(None, None)),
            BlockRemoved((1,), "kvmesh-l2"),
            AllBlocksCleared(),
        ),
        0,
    )
    assert decode_batch(encode_batch(batch)) == batch


def _stored_payload(**fields: object) -> bytes:
    event = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1}
    return bytes(msgpack.packb([1.0, [{**event, **fields}]]))


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0]),
        msgpack.packb(["x", []]),
        msgpack.packb([1.0, {}]),
        msgpack.packb([1.0, [], "rank"]),
        msgpack.packb([1.0, [["BlockStored"]]]),
        msgpack.packb([1.0, [{"type": "Nope"}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": []}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 3}]]),
        _stored_payload(token_ids=[-1]),
        _stored_payload(block_size=0),
        _stored_payload(token_ids="ab"),
    ],
)
def test_malformed_payloads_raise_one_error_type(payload: bytes) -> None:
    with pytest.raises(EventFormatError):
        decode_batch(payload)


def test_seq_frames() -> None:
    assert decode_seq(encode_seq(5)) == 5
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == -1
    assert decode_seq((2**63 - 1).to_bytes(8, "big")) == 2**63 - 1
    with pytest.raises(EventFormatError):
        decode_seq(b"\x00")


def test_chain_salt_reads_lora_then_salt_and_refuses_multimodal() -> None:
    def stored(extra: tuple[object, ...] | None, lora: str | None = None) -> BlockStored:
        return BlockStored((1,), None, (1,), 1, lora_name=lora, extra_keys=(extra,))

    assert chain_salt(stored(None)) == ""
    assert chain_salt(stored(("ad", "s"), lora="ad")) == "s"
    assert chain_salt(stored(("ad",), lora="ad")) == ""
    assert chain_salt(stored((("img", 0), "s"))) is None
    assert chain_salt(stored((b"digest",))) is None
