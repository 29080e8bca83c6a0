"""Real vLLM under an operator's life: the node restarted under it, then the engine killed.

One ``vllm serve`` (the OpenAI server, one worker) with kvmesh's connector and
one ``kvmesh node``:

(reached over gRPC, and over the node's local lane):

1. a prompt is stored and hits; the node is killed (SIGKILL, an upgrade gone
   wrong) and a new one starts on the same address. Requests never fail
   meanwhile; the connector's heartbeat registers again on its own, and a
   prompt stored after the restart hits again. Nothing of the old
   incarnation is served (its prompt is a miss on the new node).
2. vLLM is killed with SIGKILL. The node reaps the silent engine
   (``--engine-reap-seconds``) and unmaps its KV memory: the node's RSS drops
   by the KV size, it maps no engine file any more, and nothing is left in
   ``/dev/shm`` (the KV file never had a name).

The figures (restart to first hit, kill to memory back) are printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.engine.vllm.worker import engine_env, transfer_config
from kvmesh.storage.client import StorageClient
from tests.e2e.with_vllm.support import assert_same_completion, complete, healthy
from tests.support.harness import REPO_ROOT
from tests.support.ports import free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 3000
CACHED = PROMPT_TOKENS // 256 * 256
REAP_S = 4
KV_GIB = 1
#: The engine's KV file as the node maps it: nameless, in /dev/shm.
ENGINE_FILE = re.compile(r"/dev/shm/#\d+ \(deleted\)$")


def _start_node(port: int, tmp: Path, name: str) -> subprocess.Popen[bytes]:
    ready = tmp / f"{name}.ready"
    command = [
        sys.executable, "-m", "kvmesh.cli", "node", "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", "-1", "--l1-size-bytes", "256MiB", "--l2", "none",
        "--engine-reap-seconds", str(REAP_S), "--shm-dir", str(tmp / "l1"),
        "--data-dir", str(tmp / name), "--ready-file", str(ready),
        "--lane-socket", str(tmp / "node.lane"),
    ]  # fmt: skip
    (tmp / "l1").mkdir(exist_ok=True)
    with (tmp / f"{name}.log").open("w") as out:
        node = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    wait_until(lambda: ready.exists() or node.poll() is not None, 60)
    assert node.poll() is None, (tmp / f"{name}.log").read_text()[-3000:]
    return node


def _status(port: int) -> storage_pb2.GetStatusResponse:
    async def ask() -> storage_pb2.GetStatusResponse:
        client = StorageClient(f"127.0.0.1:{port}")
        try:
            return await client.get_status(storage_pb2.GetStatusRequest(), timeout=5.0)
        finally:
            await client.close()

    return asyncio.run(ask())


def _cached(answer: dict[str, Any]) -> int:
    return int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _engine_file(pid: int) -> tuple[str, int]:
    """The engine KV file a process maps, and the bytes of it resident there ("", 0: none)."""
    name, rss, inside = "", 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            found = ENGINE_FILE.search(line)
            inside = found is not None
            if found:
                name = found.group(0)
        elif inside and first == "Rss:":
            rss += int(line.split()[1]) * 1024
    return name, rss


def _holders(name: str) -> list[str]:
    """Processes that still map or hold open the file ``name`` (as /proc shows it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if name in (proc / "maps").read_text():
                found.append(f"{proc.name} maps it")
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) == name:
                    found.append(f"{proc.name} holds it open")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _shmem() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def _stored_then_hit(base: str, model: str, prompt: list[int], port: int) -> dict[str, Any]:
    # Chunks of earlier prompts may be resident already: wait for this prompt's own.
    before = _status(port).l1.resident_objects
    cold = complete(base, model, prompt)
    wait_until(lambda: _status(port).l1.resident_objects >= before + CACHED // 256, 60)
    warm = complete(base, model, prompt)
    assert _cached(warm) == CACHED, warm["usage"]
    assert_same_completion(cold, warm)
    return warm


@pytest.mark.parametrize("target", ["grpc", "lane"])
def test_a_node_restarted_under_vllm_is_found_again_and_a_killed_vllm_gives_its_memory_back(
    tiny_model: Path, tmp_path: Path, target: str
) -> None:
    port = free_port()
    node = _start_node(port, tmp_path, "node-a")
    http = free_port()
    model = str(tiny_model)
    gateway = f"127.0.0.1:{port}" if target == "grpc" else f"lane:{tmp_path / 'node.lane'}"
    config = transfer_config(gateway, {"heartbeat_s": 1.0})
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--port", str(http), "--host", "127.0.0.1", "--enforce-eager",
        "--no-enable-prefix-caching", "--max-model-len", "8192",
        "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(config),
    ]  # fmt: skip
    log = tmp_path / "vllm.log"
    with log.open("w") as out:
        vllm = subprocess.Popen(
            command,
            env={**os.environ, **engine_env(KV_GIB)},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    shm_before = {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("kvmesh-vllm")}
    base = f"http://127.0.0.1:{http}"
    try:
        wait_until(lambda: healthy(base) or vllm.poll() is not None, 300)
        assert vllm.poll() is None, log.read_text()[-3000:]
        rng = random.Random(23)
        first = [rng.randrange(3, 32000) for _ in range(PROMPT_TOKENS)]
        second = [rng.randrange(3, 32000) for _ in range(PROMPT_TOKENS)]
        _stored_then_hit(base, model, first, port)

        # 1. The node dies and a new one takes its address.
        node.kill()
        node.wait(30)
        restarted = time.monotonic()
        assert _cached(complete(base, model, second)) == 0  # no node: computed, not failed
        node = _start_node(port, tmp_path, "node-b")
        # Requests during and after the restart never fail; the first prompt was held
        # by the old incarnation only, so it is computed again.
        assert _cached(complete(base, model, first)) == 0
        wait_until(lambda: list(_status(port).engine_ids), 60)
        _stored_then_hit(base, model, second, port)
        print(f"\n{target}: node restart to a hit again: {time.monotonic() - restarted:.1f} s")
        text = log.read_text()
        assert "registered again with gateway" in text, text[-3000:]

        # 2. vLLM is killed; the node reaps it and unmaps its KV memory. Once no
        # process maps or holds the nameless file, the kernel has freed it.
        wait_until(lambda: _engine_file(node.pid)[1] > KV_GIB * 2**30 * 0.9, 60)  # prefaulted
        name, _ = _engine_file(node.pid)
        shmem = _shmem()
        os.killpg(vllm.pid, signal.SIGKILL)
        vllm.wait(30)
        killed = time.monotonic()
        wait_until(lambda: not _holders(name), REAP_S + 30)
        # The kernel frees the pages just after the last holder goes; other tests may
        # allocate shared memory meanwhile, hence half the KV size as the bar.
        wait_until(lambda: _shmem() < shmem - KV_GIB * 2**30 // 2, 30)
        print(
            f"vLLM SIGKILL to its KV memory freed: {time.monotonic() - killed:.1f} s (the node "
            f"reaps after {REAP_S} s of silence); /dev/shm use {shmem >> 20} -> "
            f"{_shmem() >> 20} MiB"
        )
        assert list(_status(port).engine_ids) == []
        after = {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith("kvmesh-vllm")}
        assert after <= shm_before  # no KV file left behind
    finally:
        if vllm.poll() is None:
            os.killpg(vllm.pid, signal.SIGKILL)
            vllm.wait(30)
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(60)
        except subprocess.TimeoutExpired:
            node.kill()
