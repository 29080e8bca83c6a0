"""Build an L2 adapter from a config mapping or a JSON string.

``{"type": "disk", "base_path": "/var/cache/kvmesh"}`` → :class:`DiskL2Adapter`;
the other keys are the adapter constructor's keyword arguments, checked
here (unknown key, wrong type, out of range) so a typo in a config file is
an :class:`InvalidArgument` naming the field, not a silently ignored
setting. The adapter modules are imported only for the type asked for, so
a node without redis-py, boto3 or nixl can still build the others.

Types and keys (defaults in brackets):

- ``memory``: capacity_bytes [0], latency_s [0], bandwidth_bytes_per_s [0], shared [false]
- ``disk``: base_path (required), capacity_bytes [0], fsync [true],
  verify_checksum [true], shared [false]
- ``redis``: url, or host ["127.0.0.1"] / port [6379] / db [0]; username, password,
  key_prefix [""], connect_timeout_s [2], op_timeout_s [5], max_connections [16],
  retries [1], capacity_bytes [0], ttl_s, shared [false]
- ``s3``: bucket (required), endpoint_url, region ["us-east-1"], access_key_id,
  secret_access_key, session_token, prefix [""], connect_timeout_s [2],
  read_timeout_s [10], max_attempts [2], max_pool_connections [16], io_threads [8],
  addressing_style, capacity_bytes [0], create_bucket [false], shared [false]
- ``nixl``: base_path (required), backend ["POSIX"], backend_params [{}],
  capacity_bytes [0], fsync [true], verify_checksum [true], op_timeout_s [30],
  agent_name, shared [false]
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.common.errors import InvalidArgument
from kvmesh.storage.core.l2.base import L2Adapter

logger = logging.getLogger(__name__)

# Fields whose values never appear in error messages.
_SECRET_FIELDS = frozenset({"password", "secret_access_key", "session_token", "url"})


@dataclass(frozen=True, slots=True)
class _Field:
    kind: str  # "str", "int", "float", "bool", "str_map"
    required: bool = False
    minimum: float | None = None
    exclusive_minimum: bool = False
    maximum: float | None = None


_NON_NEGATIVE_INT = _Field("int", minimum=0)
_POSITIVE_INT = _Field("int", minimum=1)
_POSITIVE_FLOAT = _Field("float", minimum=0, exclusive_minimum=True)
_NON_NEGATIVE_FLOAT = _Field("float", minimum=0)
_STR = _Field("str")
_BOOL = _Field("bool")

_SCHEMAS: dict[str, dict[str, _Field]] = {
    "memory": {
        "capacity_bytes": _NON_NEGATIVE_INT,
        "latency_s": _NON_NEGATIVE_FLOAT,
        "bandwidth_bytes_per_s": _NON_NEGATIVE_FLOAT,
        "shared": _BOOL,
    },
    "disk": {
        "base_path": _Field("str", required=True),
        "capacity_bytes": _NON_NEGATIVE_INT,
        "fsync": _BOOL,
        "verify_checksum": _BOOL,
        "shared": _BOOL,
    },
    "redis": {
        "url": _STR,
        "host": _STR,
        "port": _Field("int", minimum=1, maximum=65535),
        "db": _NON_NEGATIVE_INT,
        "username": _STR,
        "password": _STR,
        "key_prefix": _STR,
        "connect_timeout_s": _POSITIVE_FLOAT,
        "op_timeout_s": _POSITIVE_FLOAT,
        "max_connections": _POSITIVE_INT,
        "retries": _NON_NEGATIVE_INT,
        "capacity_bytes": _NON_NEGATIVE_INT,
        "ttl_s": _POSITIVE_FLOAT,
        "shared": _BOOL,
    },
    "s3": {
        "bucket": _Field("str", required=True),
        "endpoint_url": _STR,
        "region": _STR,
        "access_key_id": _STR,
        "secret_access_key": _STR,
        "session_token": _STR,
        "prefix": _STR,
        "connect_timeout_s": _POSITIVE_FLOAT,
        "read_timeout_s": _POSITIVE_FLOAT,
        "max_attempts": _POSITIVE_INT,
        "max_pool_connections": _POSITIVE_INT,
        "io_threads": _POSITIVE_INT,
        "addressing_style": _STR,
        "capacity_bytes": _NON_NEGATIVE_INT,
        "create_bucket": _BOOL,
        "shared": _BOOL,
    },
    "nixl": {
        "base_path": _Field("str", required=True),
        "backend": _STR,
        "backend_params": _Field("str_map"),
        "capacity_bytes": _NON_NEGATIVE_INT,
        "fsync": _BOOL,
        "verify_checksum": _BOOL,
        "op_timeout_s": _POSITIVE_FLOAT,
        "agent_name": _STR,
        "shared": _BOOL,
    },
}

#: The adapter types this factory builds.
ADAPTER_TYPES = tuple(sorted(_SCHEMAS))


def _check_value(name: str, spec: _Field, value: Any, path: str) -> Any:
    field = f"{path}.{name}" if path else name
    shown = "<hidden>" if name in _SECRET_FIELDS else repr(value)
    if spec.kind == "str":
        if not isinstance(value, str):
            raise InvalidArgument(f"{field} must be a string, got {shown}", field=field)
        return value
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise InvalidArgument(f"{field} must be true or false, got {shown}", field=field)
        return value
    if spec.kind == "str_map":
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise InvalidArgument(f"{field} must map strings to strings", field=field)
        return dict(value)
    # Numbers. bool is an int subclass in Python; true is never a valid port or size.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{field} must be a number, got {shown}", field=field)
    if spec.kind == "int":
        if isinstance(value, float):
            if not value.is_integer():
                raise InvalidArgument(f"{field} must be an integer, got {shown}", field=field)
            value = int(value)
    else:
        if not math.isfinite(value):
            raise InvalidArgument(f"{field} must be finite, got {shown}", field=field)
        value = float(value)
    if spec.minimum is not None and (
        value < spec.minimum or (spec.exclusive_minimum and value == spec.minimum)
    ):
        op = ">" if spec.exclusive_minimum else ">="
        raise InvalidArgument(f"{field} must be {op} {spec.minimum:g}, got {shown}", field=field)
    if spec.maximum is not None and value > spec.maximum:
        raise InvalidArgument(f"{field} must be <= {spec.maximum:g}, got {shown}", field=field)
    return value


def parse_l2_config(
    config: Mapping[str, Any] | str, *, path: str = "l2"
) -> tuple[str, dict[str, Any]]:
    """Validate a config; returns ``(type, constructor kwargs)``.

    ``path`` prefixes field names in errors (``l2.base_path``), so a caller
    holding several adapters can pass ``l2_adapters[1]``.
    """
    if isinstance(config, str):
        try:
            loaded = json.loads(config)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{path} is not valid JSON: {exc}", field=path) from exc
        config = loaded
    if not isinstance(config, Mapping):
        raise InvalidArgument(f"{path} must be a JSON object", field=path)
    type_field = f"{path}.type" if path else "type"
    kind = config.get("type")
    if kind is None:
        raise InvalidArgument(
            f"{type_field} is required (one of {', '.join(ADAPTER_TYPES)})", field=type_field
        )
    if not isinstance(kind, str) or kind not in _SCHEMAS:
        raise InvalidArgument(
            f"{type_field}: unknown L2 adapter type {kind!r} (one of {', '.join(ADAPTER_TYPES)})",
            field=type_field,
        )
    schema = _SCHEMAS[kind]
    kwargs: dict[str, Any] = {}
    for name, value in config.items():
        if name == "type":
            continue
        spec = schema.get(name)
        if spec is None:
            field = f"{path}.{name}" if path else str(name)
            raise InvalidArgument(
                f"{field}: unknown field for a {kind} adapter (known: {', '.join(sorted(schema))})",
                field=field,
            )
        if value is None and not spec.required:
            continue  # JSON null = use the default
        kwargs[name] = _check_value(name, spec, value, path)
    for name, spec in schema.items():
        if spec.required and name not in kwargs:
            field = f"{path}.{name}" if path else name
            raise InvalidArgument(f"{field} is required for a {kind} adapter", field=field)
    if kind == "redis" and "url" in kwargs and {"host", "port", "db"} & kwargs.keys():
        field = f"{path}.url" if path else "url"
        raise InvalidArgument(f"{field}: give either url or host/port/db, not both", field=field)
    return kind, kwargs


# Each builder imports its adapter module only when that type is asked for, so
# a node without redis-py, boto3 or nixl can still build the others.


def _build_memory(kwargs: dict[str, Any]) -> L2Adapter:
    from kvmesh.storage.core.l2.memory import MemoryL2Adapter

    return MemoryL2Adapter(**kwargs)


def _build_disk(kwargs: dict[str, Any]) -> L2Adapter:
    from kvmesh.storage.core.l2.disk import DiskL2Adapter

    return DiskL2Adapter(**kwargs)


def _build_redis(kwargs: dict[str, Any]) -> L2Adapter:
    from kvmesh.storage.core.l2.redis import RedisL2Adapter

    return RedisL2Adapter(**kwargs)


def _build_s3(kwargs: dict[str, Any]) -> L2Adapter:
    from kvmesh.storage.core.l2.s3 import S3L2Adapter

    bucket = kwargs.pop("bucket")
    return S3L2Adapter(bucket, **kwargs)


def _build_nixl(kwargs: dict[str, Any]) -> L2Adapter:
    from kvmesh.storage.core.l2.nixl import NixlL2Adapter

    return NixlL2Adapter(**kwargs)


_BUILDERS: dict[str, Callable[[dict[str, Any]], L2Adapter]] = {
    "memory": _build_memory,
    "disk": _build_disk,
    "redis": _build_redis,
    "s3": _build_s3,
    "nixl": _build_nixl,
}


def build_l2_adapter(config: Mapping[str, Any] | str, *, path: str = "l2") -> L2Adapter:
    """Build the adapter a config describes; InvalidArgument names any bad field.

    Backend errors at construction (a locked directory, an unreachable
    bucket with ``create_bucket``) surface as L2Unavailable.
    """
    kind, kwargs = parse_l2_config(config, path=path)
    try:
        adapter = _BUILDERS[kind](kwargs)
    except InvalidArgument as exc:
        # The constructors name their own argument; put it under the config path.
        if not path or exc.field is None:
            raise
        field = f"{path}.{exc.field}"
        raise InvalidArgument(f"{field}: {exc.message}", field=field) from exc
    logger.info("built %s L2 adapter", kind)
    return adapter
