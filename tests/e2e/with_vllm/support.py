"""Helpers of the real-vLLM tests."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.storage.client import StorageClient


def resident_chunks(storage: str) -> int:
    """Chunks a storage node holds in L1."""

    async def ask() -> int:
        client = StorageClient(storage)
        try:
            status = await client.get_status(storage_pb2.GetStatusRequest(), timeout=5.0)
            return int(status.l1.resident_objects)
        finally:
            await client.close()

    return asyncio.run(ask())


def healthy(base: str) -> bool:
    """Whether vLLM's OpenAI server at ``base`` answers its health check."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False
