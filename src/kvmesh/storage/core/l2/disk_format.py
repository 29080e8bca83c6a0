"""The disk L2's object file: one self-describing file per object.

File layout (little endian)::

    offset 0     header   magic b"KVMSHL2\\0", u16 version, u16 flags, u32 name_len,
                          u64 payload_len, u32 payload_crc32, u32 header_crc32
    offset 32    name     object_name(key), UTF-8 (name_len bytes), then zero padding
    offset 4096  payload  payload_len bytes (page aligned, so O_DIRECT / GDS can target it)
    end - 16     trailer  magic b"KVL2END\\0", u64 payload_len

Why each part exists: the header says what the file is and which key it
holds (a file copied or renamed under another key's name is caught); the
header CRC catches a damaged header; the exact expected file size and the
trailer catch a truncated or half-written file; the payload CRC catches
damaged payload bytes (checked on read unless ``verify_checksum=False``).

Written and read by :class:`kvmesh.storage.core.l2.disk.DiskL2Adapter`.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.keys import ObjectKey, parse_object_name

MAGIC = b"KVMSHL2\x00"
END_MAGIC = b"KVL2END\x00"
FORMAT_VERSION = 1
FLAG_PAYLOAD_CRC = 0x1
#: Payload offset; the header block is zero padded up to here.
PAYLOAD_OFFSET = 4096
OBJECT_SUFFIX = ".kvl2"
TEMP_PREFIX = ".tmp-"
LOCK_FILE = ".lock"

_HEADER = struct.Struct("<8sHHIQII")
_HEADER_NO_CRC = struct.Struct("<8sHHIQI")
_TRAILER = struct.Struct("<8sQ")
# Longest file name (bytes) used as is; longer object names are hashed. Leaves room
# under NAME_MAX (255) for the suffix.
_MAX_PLAIN_NAME = 200


class InvalidObjectFileError(Exception):
    """An object file failed validation (torn, foreign or damaged)."""


def file_name_for(name: str) -> str:
    """The file name of the object called ``name`` (its object_name)."""
    if len(name.encode()) <= _MAX_PLAIN_NAME:
        return name + OBJECT_SUFFIX
    digest = hashlib.blake2b(name.encode(), digest_size=20).hexdigest()
    return f"h-{digest}{OBJECT_SUFFIX}"


def encode_header(name: bytes, payload_len: int, payload_crc: int) -> bytes:
    """The 4 KiB header block of an object file."""
    fixed = _HEADER_NO_CRC.pack(
        MAGIC, FORMAT_VERSION, FLAG_PAYLOAD_CRC, len(name), payload_len, payload_crc
    )
    header_crc = zlib.crc32(name, zlib.crc32(fixed))
    block = _HEADER.pack(
        MAGIC, FORMAT_VERSION, FLAG_PAYLOAD_CRC, len(name), payload_len, payload_crc, header_crc
    )
    block += name
    if len(block) > PAYLOAD_OFFSET:
        raise InvalidArgument("object name too long for the header block", field="key")
    return block + bytes(PAYLOAD_OFFSET - len(block))


def encode_trailer(payload_len: int) -> bytes:
    """The 16-byte trailer that marks a completely written file."""
    return _TRAILER.pack(END_MAGIC, payload_len)


class ObjectHeader:
    """A parsed, validated header (the file size and trailer are checked too)."""

    __slots__ = ("flags", "key", "name", "payload_crc", "payload_len")

    def __init__(
        self, name: str, key: ObjectKey, flags: int, payload_len: int, payload_crc: int
    ) -> None:
        self.name = name
        self.key = key
        self.flags = flags
        self.payload_len = payload_len
        self.payload_crc = payload_crc


def read_header(fd: int) -> ObjectHeader:
    """Validate an open object file's header, size and trailer; raise InvalidObjectFileError."""
    block = os.pread(fd, PAYLOAD_OFFSET, 0)
    if len(block) < _HEADER.size:
        raise InvalidObjectFileError("shorter than a header")
    magic, version, flags, name_len, payload_len, payload_crc, header_crc = _HEADER.unpack_from(
        block
    )
    if magic != MAGIC:
        raise InvalidObjectFileError("bad magic (not a kvmesh object file)")
    if version != FORMAT_VERSION:
        raise InvalidObjectFileError(f"unsupported format version {version}")
    if _HEADER.size + name_len > len(block):
        raise InvalidObjectFileError("name runs past the header block")
    raw_name = block[_HEADER.size : _HEADER.size + name_len]
    fixed = _HEADER_NO_CRC.pack(magic, version, flags, name_len, payload_len, payload_crc)
    if zlib.crc32(raw_name, zlib.crc32(fixed)) != header_crc:
        raise InvalidObjectFileError("header checksum mismatch")
    expected_size = PAYLOAD_OFFSET + payload_len + _TRAILER.size
    actual_size = os.fstat(fd).st_size
    if actual_size != expected_size:
        raise InvalidObjectFileError(f"size {actual_size} != expected {expected_size} (torn file)")
    end_magic, trailer_len = _TRAILER.unpack(
        os.pread(fd, _TRAILER.size, PAYLOAD_OFFSET + payload_len)
    )
    if end_magic != END_MAGIC or trailer_len != payload_len:
        raise InvalidObjectFileError("bad trailer (incompletely written file)")
    try:
        name = raw_name.decode()
        key = parse_object_name(name)
    except (UnicodeDecodeError, InvalidArgument) as exc:
        raise InvalidObjectFileError(f"header holds no valid object name: {exc}") from exc
    return ObjectHeader(name, key, flags, payload_len, payload_crc)
