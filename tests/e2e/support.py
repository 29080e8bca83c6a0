"""Helpers of the end-to-end tests (fixtures are in conftest.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import directory_pb2
from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.cli.fleet import Fleet, FleetOptions
from kvmesh.coordinator.client import DirectoryClient
from kvmesh.engine import Engine, ModelConfig, RequestOutput
from kvmesh.storage.client import StorageClient

#: The demo's model; e2e prompts stay at 1-2 k tokens so the suite is quick.
MODEL = ModelConfig()
MODEL_NAME = MODEL.name
L1_BYTES = 256 * 1024**2
#: Greedy tokens decoded after each prefill (compared too).
DECODE_TOKENS = 3
L1 = common_pb2.TIER_L1
L2 = common_pb2.TIER_L2


def require_fleet_services() -> None:
    """Skip (fail under KVMESH_REQUIRE_SERVICES=1) while a fleet service is not built."""
    missing = [
        m
        for m in ("kvmesh.storage.app", "kvmesh.coordinator.app")
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        reason = f"the fleet cannot start: {', '.join(missing)} not built yet"
        if os.environ.get("KVMESH_REQUIRE_SERVICES") == "1":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


def start_fleet(tmp: Path, **options: object) -> Fleet:
    """Start a fleet under ``tmp`` (skips when the services are not built)."""
    require_fleet_services()
    fleet = Fleet(
        FleetOptions(data_dir=tmp, l1_size_bytes=L1_BYTES, **options)  # type: ignore[arg-type]
    )
    fleet.start()
    return fleet


def tokens(n: int, seed: int) -> list[int]:
    """A deterministic random prompt."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=gen).tolist()


def stored_keys(storage: str, tier: int, cache_salt: str) -> list[common_pb2.ObjectKey]:
    """The keys of ``cache_salt`` a storage node lists in ``tier``."""

    async def collect() -> list[common_pb2.ObjectKey]:
        client = StorageClient(storage)
        try:
            keys: list[common_pb2.ObjectKey] = []
            token = ""
            while True:
                resp = await client.list_objects(
                    storage_pb2.ListObjectsRequest(
                        tier=tier, model_name=MODEL_NAME, page_token=token
                    )  # type: ignore[arg-type]
                )
                keys += [o.key for o in resp.objects if o.key.cache_salt == cache_salt]
                token = resp.next_page_token
                if not token:
                    return keys
        finally:
            await client.close()

    return asyncio.run(collect())


def stored_chunks(storage: str, tier: int, cache_salt: str) -> int:
    """Objects of ``cache_salt`` a storage node lists in ``tier``."""
    return len(stored_keys(storage, tier, cache_salt))


def placed_in_directory(coordinator: str, storage: str, cache_salt: str) -> bool:
    """Whether the coordinator's directory places every L1 key of ``cache_salt`` that
    ``storage`` holds on that node (at least one key)."""
    keys = stored_keys(storage, L1, cache_salt)

    async def instance_id() -> str:
        node = StorageClient(storage)
        try:
            return str((await node.get_status(storage_pb2.GetStatusRequest())).instance_id)
        finally:
            await node.close()

    instance = asyncio.run(instance_id())
    with DirectoryClient(coordinator) as directory:
        found = directory.lookup(directory_pb2.LookupRequest(keys=directory_pb2.KeyList(keys=keys)))
    return bool(keys) and all(
        any(p.instance_id == instance for p in r.placements) for r in found.results
    )


def run_prompt(engine: Engine, prompt: list[int], salt: str) -> RequestOutput:
    """Serve one prompt under ``salt`` (a few greedy tokens included)."""
    return engine.generate(prompt, cache_salt=salt, max_new_tokens=DECODE_TOKENS)


def same_output(a: RequestOutput, b: RequestOutput) -> bool:
    """Bit-identical last-prompt-token logits and identical greedy tokens."""
    return torch.equal(a.logits, b.logits) and a.output_token_ids == b.output_token_ids
