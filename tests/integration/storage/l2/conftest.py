"""The ``l2_case`` fixture: one adapter kind against its real backend.

Every conformance test runs once per kind. Each test gets its own namespace
(a temp directory, a Redis key prefix, an S3 prefix), so tests share the
session's servers without seeing each other's objects, and ``case.open()``
builds another adapter on the same namespace (for close-and-reopen).
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvmesh.storage.core.l2.base import L2Adapter

ADAPTER_KINDS = ["memory", "disk", "redis", "s3", "nixl"]
S3_BUCKET = "kvmesh-l2-tests"


def nixl_available() -> bool:
    """True when nixl-cu12 is importable."""
    return importlib.util.find_spec("nixl_cu12") is not None


def require_nixl() -> None:
    """Skip (or fail under KVMESH_REQUIRE_SERVICES=1) without nixl-cu12."""
    if nixl_available():
        return
    if os.environ.get("KVMESH_REQUIRE_SERVICES") == "1":
        pytest.fail("nixl-cu12 is not installed (KVMESH_REQUIRE_SERVICES=1)", pytrace=False)
    pytest.skip("nixl-cu12 is not installed")


@dataclass
class AdapterCase:
    """How to open adapters of one kind on one test's namespace."""

    kind: str
    build: Callable[[], L2Adapter]
    #: True when objects outlive the adapter (close, then a new adapter sees them).
    persistent: bool
    opened: list[L2Adapter] = field(default_factory=list)

    def open(self) -> L2Adapter:
        """A new adapter on this case's namespace; closed at teardown."""
        adapter = self.build()
        self.opened.append(adapter)
        return adapter


@pytest.fixture(params=ADAPTER_KINDS)
def l2_case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AdapterCase]:
    """One adapter kind, against its real backend, in a namespace of its own."""
    kind: str = request.param
    namespace = f"t{uuid.uuid4().hex[:12]}"
    if kind == "memory":
        from kvmesh.storage.core.l2.memory import MemoryL2Adapter

        case = AdapterCase(kind, lambda: MemoryL2Adapter(capacity_bytes=1 << 40), persistent=False)
    elif kind == "disk":
        from kvmesh.storage.core.l2.disk import DiskL2Adapter

        path = tmp_path / "disk"
        case = AdapterCase(kind, lambda: DiskL2Adapter(path, capacity_bytes=1 << 40), True)
    elif kind == "nixl":
        require_nixl()
        from kvmesh.storage.core.l2.nixl import NixlL2Adapter

        path = tmp_path / "nixl"
        case = AdapterCase(kind, lambda: NixlL2Adapter(path, capacity_bytes=1 << 40), True)
    elif kind == "redis":
        from kvmesh.storage.core.l2.redis import RedisL2Adapter

        server = request.getfixturevalue("redis_server")
        case = AdapterCase(
            kind,
            lambda: RedisL2Adapter(
                host=server.host,
                port=server.port,
                key_prefix=namespace,
                capacity_bytes=1 << 40,
            ),
            True,
        )
    elif kind == "s3":
        from kvmesh.storage.core.l2.s3 import S3L2Adapter

        server = request.getfixturevalue("s3_server")
        case = AdapterCase(
            kind,
            lambda: S3L2Adapter(
                S3_BUCKET,
                endpoint_url=server.url,
                access_key_id="testing",
                secret_access_key="testing",
                prefix=f"{namespace}/",
                capacity_bytes=1 << 40,
                create_bucket=True,
                # Under concurrent requests on a loaded 2-core machine, moto's server
                # (the stand-in for S3) sometimes answers 500. A real S3 client retries a
                # 500 with backoff (AWS SDKs' standard mode: 3 attempts), and so do these
                # tests, rather than fail on a fault of the stand-in. The adapter's default
                # (2) stays: it bounds how long a real outage takes to surface.
                max_attempts=4,
            ),
            True,
        )
    else:  # pragma: no cover - the params above are the whole list
        raise AssertionError(kind)
    try:
        yield case
    finally:
        for adapter in case.opened:
            adapter.close()
        if kind in ("redis", "s3"):
            # Leave the shared server as we found it.
            cleaner = case.build()
            try:
                cleaner.delete_many([e.key for e in cleaner.iter_entries()])
            except Exception:  # the test may have left the server down on purpose
                pass
            finally:
                cleaner.close()


@pytest.fixture
def l2(l2_case: AdapterCase) -> L2Adapter:
    """An open adapter of the current kind."""
    return l2_case.open()
