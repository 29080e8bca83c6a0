"""Building adapters from config: every type, and errors that name the bad field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvmesh.common.errors import InvalidArgument
from kvmesh.storage.core.l2.base import L2Adapter
from kvmesh.storage.core.l2.factory import ADAPTER_TYPES, build_l2_adapter, parse_l2_config
from tests.integration.storage.l2.conftest import require_nixl

REPO_ROOT = Path(__file__).resolve().parents[4]


def test_factory_knows_the_five_adapter_types() -> None:
    assert set(ADAPTER_TYPES) == {"memory", "disk", "redis", "s3", "nixl"}


@pytest.mark.parametrize("as_json", [False, True])
def test_builds_a_disk_adapter_from_a_dict_or_json(tmp_path: Path, as_json: bool) -> None:
    config: dict[str, Any] = {"type": "disk", "base_path": str(tmp_path), "fsync": False}
    adapter = build_l2_adapter(json.dumps(config) if as_json else config)
    try:
        assert isinstance(adapter, L2Adapter)
        assert adapter.backend == "disk"
    finally:
        adapter.close()


def test_builds_memory_redis_and_s3_adapters_without_contacting_a_server() -> None:
    configs: list[dict[str, Any]] = [
        {"type": "memory", "capacity_bytes": 1024, "latency_s": 0, "shared": True},
        {"type": "redis", "host": "127.0.0.1", "port": 1, "key_prefix": "k", "ttl_s": 5},
        {"type": "redis", "url": "redis://127.0.0.1:1/0", "op_timeout_s": 0.5},
        {"type": "s3", "bucket": "b", "endpoint_url": "http://127.0.0.1:1", "prefix": "p/"},
    ]
    for config in configs:
        adapter = build_l2_adapter(config)
        try:
            assert adapter.backend == config["type"]
        finally:
            adapter.close()


def test_builds_a_nixl_adapter(tmp_path: Path) -> None:
    require_nixl()
    adapter = build_l2_adapter({"type": "nixl", "base_path": str(tmp_path), "backend": "POSIX"})
    try:
        assert adapter.backend == "nixl"
    finally:
        adapter.close()


@pytest.mark.parametrize(
    ("config", "field", "words"),
    [
        ({}, "l2.type", "required"),
        ({"type": "tape"}, "l2.type", "unknown L2 adapter type 'tape'"),
        ({"type": 3}, "l2.type", "unknown L2 adapter type"),
        ({"type": "disk"}, "l2.base_path", "required"),
        ({"type": "disk", "base_path": "/x", "fsynk": True}, "l2.fsynk", "unknown field"),
        ({"type": "disk", "base_path": 5}, "l2.base_path", "must be a string"),
        ({"type": "disk", "base_path": "/x", "fsync": "yes"}, "l2.fsync", "true or false"),
        ({"type": "memory", "capacity_bytes": -1}, "l2.capacity_bytes", ">= 0"),
        ({"type": "memory", "capacity_bytes": 1.5}, "l2.capacity_bytes", "integer"),
        ({"type": "memory", "capacity_bytes": True}, "l2.capacity_bytes", "number"),
        ({"type": "memory", "latency_s": float("inf")}, "l2.latency_s", "finite"),
        ({"type": "redis", "port": 70000}, "l2.port", "<= 65535"),
        ({"type": "redis", "op_timeout_s": 0}, "l2.op_timeout_s", "> 0"),
        ({"type": "redis", "url": "redis://h", "port": 1}, "l2.url", "not both"),
        ({"type": "redis", "key_prefix": "a@b"}, "l2.key_prefix", "'@'"),
        ({"type": "s3", "bucket": "b", "addressing_style": "dns"}, "l2.addressing_style", "path"),
        ({"type": "nixl", "base_path": "/x", "backend_params": {"a": 1}}, "l2.backend_params", ""),
    ],
)
def test_bad_config_raises_invalid_argument_naming_the_field(
    config: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(InvalidArgument) as err:
        build_l2_adapter(config)
    assert err.value.field == field
    assert field in err.value.message
    assert words in err.value.message


def test_bad_json_and_non_objects_are_invalid_arguments() -> None:
    with pytest.raises(InvalidArgument, match="not valid JSON") as err:
        build_l2_adapter("{type: disk}")
    assert err.value.field == "l2"
    with pytest.raises(InvalidArgument, match="JSON object"):
        build_l2_adapter("[1, 2]")


def test_field_path_prefix_is_configurable() -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_l2_config({"type": "disk"}, path="storage.l2_adapters[1]")
    assert err.value.field == "storage.l2_adapters[1].base_path"


def test_secret_values_never_appear_in_errors() -> None:
    with pytest.raises(InvalidArgument) as err:
        build_l2_adapter({"type": "s3", "bucket": "b", "secret_access_key": 12345678})
    assert "12345678" not in err.value.message
    assert err.value.field == "l2.secret_access_key"


def test_null_means_default() -> None:
    kind, kwargs = parse_l2_config({"type": "redis", "password": None, "port": 7000})
    assert (kind, kwargs) == ("redis", {"port": 7000})


def test_importing_the_factory_loads_no_optional_backend() -> None:
    code = (
        "import sys; import kvmesh.storage.core.l2.factory, kvmesh.storage.core.l2.disk;"
        "print(sorted(m for m in ('nixl_cu12', 'redis', 'boto3') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
