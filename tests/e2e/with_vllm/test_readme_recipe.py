"""The README's production recipe, run as written: ``kvmesh node`` beside two vLLM servers.

The commands are read from README.md (tests/support/readme.py), not copied
here. Only what a 2-core CI machine and the tiny model need is replaced, and
each replacement must match exactly what the README says, so a change to the
recipe fails this test until it is looked at:

- sizes (L1, vLLM's KV cache), ports and paths (free ones, this test's own);
- the model (the tiny random-weight Llama) and, for it, ``--enforce-eager``,
  ``--max-model-len`` and the prompt token details the check reads.

Two vLLM servers run the same vLLM command beside one node, as the README's
"several vLLM instances on one host" says: a prompt one of them stored is
served to the other from kvmesh (the second has never seen it: vLLM's own
prefix cache stays on, as the recipe leaves it).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.e2e.with_vllm.support import (
    assert_same_completion,
    complete,
    healthy,
    resident_chunks,
    stop_group,
)
from tests.support.ports import free_port
from tests.support.readme import Command, blocks, commands
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 3000
CACHED = PROMPT_TOKENS // 256 * 256


def _recipe() -> tuple[Command, Command]:
    """The README block with ``kvmesh node`` and the vLLM server: (node, vllm)."""
    for index, _ in enumerate(blocks()):
        cmds = [c for c in commands() if c.block == index]
        node = [c for c in cmds if c.argv[:2] == ["kvmesh", "node"]]
        served = [c for c in cmds if "vllm.entrypoints.openai.api_server" in c.argv]
        if node and served:
            return node[0], served[0]
    raise AssertionError("README: no block runs kvmesh node beside vllm's OpenAI server")


def _replace(text: str, old: str, new: str) -> str:
    assert text.count(old) >= 1, f"the README recipe no longer says {old!r}: update this test"
    return text.replace(old, new)


def _start(line: str, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("w") as out:
        return subprocess.Popen(
            ["bash", "-c", line],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def test_the_readme_recipe_serves_one_vllms_prompt_to_another(
    tiny_model: Path, tmp_path: Path
) -> None:
    node_cmd, vllm_cmd = _recipe()
    lane = f"/dev/shm/kvmesh-test-readme-{uuid.uuid4().hex[:10]}.lane"
    node_port = free_port()
    node_line = node_cmd.text.removesuffix("&").strip()
    node_line = _replace(node_line, "kvmesh node ", f"kvmesh node --port {node_port} ")
    node_line = _replace(node_line, "--l1-size-bytes 16GiB", "--l1-size-bytes 256MiB")
    node_line = _replace(node_line, "/dev/shm/kvmesh-node.lane", lane)
    node_line = _replace(node_line, "/var/lib/kvmesh", str(tmp_path / "node"))
    node_line = _replace(node_line, "--metrics-port 9302", f"--metrics-port {free_port()}")
    ports = [free_port(), free_port()]
    vllm_lines = []
    for port in ports:
        line = _replace(vllm_cmd.text, "VLLM_CPU_KVCACHE_SPACE=8", "VLLM_CPU_KVCACHE_SPACE=1")
        line = _replace(line, "/dev/shm/kvmesh-node.lane", lane)
        line = _replace(line, "python -m vllm", f"{sys.executable} -m vllm")
        line = _replace(line, "Qwen/Qwen2.5-1.5B-Instruct", str(tiny_model))
        line = _replace(
            line,
            "--port 8000",
            f"--port {port} --host 127.0.0.1 --enforce-eager --max-model-len 16384 "
            "--enable-prompt-tokens-details",
        )
        vllm_lines.append(line)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "TOKENIZERS_PARALLELISM": "false",
    }
    node = _start(node_line, tmp_path / "node.log", env)
    servers: list[subprocess.Popen[bytes]] = []
    try:
        wait_until(lambda: Path(lane).exists() or node.poll() is not None, 60)
        assert node.poll() is None, (tmp_path / "node.log").read_text()[-3000:]
        for i, line in enumerate(vllm_lines):
            servers.append(_start(line, tmp_path / f"vllm-{i}.log", env))
        bases = [f"http://127.0.0.1:{port}" for port in ports]
        for i, (base, server) in enumerate(zip(bases, servers, strict=True)):
            wait_until(lambda b=base, s=server: healthy(b) or s.poll() is not None, 400)
            assert server.poll() is None, (tmp_path / f"vllm-{i}.log").read_text()[-3000:]
        rng = random.Random(9)
        prompt = [rng.randrange(3, 32000) for _ in range(PROMPT_TOKENS)]
        first = complete(bases[0], str(tiny_model), prompt, max_tokens=1)
        # Stores finish in the background, after vLLM has answered.
        wait_until(lambda: resident_chunks(f"127.0.0.1:{node_port}") >= CACHED // 256, 60)
        second = complete(bases[1], str(tiny_model), prompt, max_tokens=1)
    finally:
        for server in servers:
            stop_group(server)
        stop_group(node)
    assert_same_completion(first, second)
    # The second vLLM never saw the prompt: its cached tokens came from kvmesh.
    details = second["usage"].get("prompt_tokens_details") or {}
    assert details.get("cached_tokens") == CACHED, second["usage"]
    assert not Path(lane).exists(), "the node left its lane socket behind"
