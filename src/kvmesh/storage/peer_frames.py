"""The wire bytes of ``kvmesh.storage.v1.ChunkFrame``, written and read without copies.

A P2P frame is megabytes of KV bytes behind a few bytes of header. Building a
``ChunkFrame`` message and serializing it copies the payload twice more on the
sender, and parsing it copies it again on the receiver, so the stream's
sender writes the message's exact protobuf encoding itself (fields 1, 2, 3 in
order: ``chunk_index`` varint, ``offset`` varint, ``data`` length-delimited)
around a view of L1 memory, and the receiver reads the header and hands out
a view of the payload. The bytes on the wire are an ordinary ChunkFrame (any
protobuf client, grpcurl included, decodes them); a frame encoded otherwise
(fields in another order, zero values omitted) is decoded with protobuf.
"""

from __future__ import annotations

from kvmesh.api.storage.v1 import peer_pb2

_TAG_INDEX = 0x08  # field 1, varint
_TAG_OFFSET = 0x10  # field 2, varint
_TAG_DATA = 0x1A  # field 3, length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def encode_frame(chunk_index: int, offset: int, data: memoryview | bytes) -> bytes:
    """The protobuf encoding of ``ChunkFrame{chunk_index, offset, data}`` (one copy of data)."""
    header = (
        bytes((_TAG_INDEX,))
        + _varint(chunk_index)
        + bytes((_TAG_OFFSET,))
        + _varint(offset)
        + bytes((_TAG_DATA,))
        + _varint(len(data))
    )
    return b"".join((header, data))


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def decode_frame(raw: bytes) -> tuple[int, int, memoryview]:
    """``(chunk_index, offset, data)`` of an encoded ChunkFrame; data is a view of ``raw``."""
    try:
        if raw[:1] == bytes((_TAG_INDEX,)):
            index, pos = _read_varint(raw, 1)
            if raw[pos : pos + 1] == bytes((_TAG_OFFSET,)):
                offset, pos = _read_varint(raw, pos + 1)
                if raw[pos : pos + 1] == bytes((_TAG_DATA,)):
                    size, pos = _read_varint(raw, pos + 1)
                    if pos + size == len(raw):
                        return index, offset, memoryview(raw)[pos:]
    except ValueError:
        pass
    frame = peer_pb2.ChunkFrame.FromString(raw)
    return frame.chunk_index, frame.offset, memoryview(frame.data)
