"""Protobuf messages as plain JSON for ``--json`` outputs that people and scripts read.

Protobuf's JSON mapping prints 64-bit integers as strings (JavaScript cannot
hold them exactly); a shell script piping ``kvmesh status --json`` into ``jq``
expects numbers. Counters and byte sizes here stay far below 2**53, so they
are printed as JSON numbers. Field names are snake_case, as the ``.proto``
files spell them, and fields at their default value are printed.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

_INT64 = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def plain(message: Message) -> dict[str, Any]:
    """``message`` as a dict: snake_case keys, every field, 64-bit integers as ints."""
    data = json_format.MessageToDict(
        message, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
    )
    _numbers(message.DESCRIPTOR, data)
    return data


def _numbers(descriptor: Any, data: dict[str, Any]) -> None:  # a (upb) Descriptor
    for field in descriptor.fields:
        if field.name not in data:
            continue
        value = data[field.name]
        inner = field.message_type
        if inner is None:
            if field.type in _INT64:
                data[field.name] = [int(v) for v in value] if field.is_repeated else int(value)
            continue
        if inner.full_name.startswith("google.protobuf."):
            continue  # well-known types have JSON forms of their own (a timestamp string)
        if inner.GetOptions().map_entry:
            key_field = inner.fields_by_name["key"]
            value_field = inner.fields_by_name["value"]
            items = {}
            for key, item in value.items():
                key_out = int(key) if key_field.type in _INT64 else key
                if value_field.message_type is not None:
                    if not value_field.message_type.full_name.startswith("google.protobuf."):
                        _numbers(value_field.message_type, item)
                    items[key_out] = item
                else:
                    items[key_out] = int(item) if value_field.type in _INT64 else item
            data[field.name] = items
        elif field.is_repeated:
            for item in value:
                _numbers(inner, item)
        else:
            _numbers(inner, value)
