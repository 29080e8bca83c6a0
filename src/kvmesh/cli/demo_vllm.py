"""``kvmesh demo --engine vllm``: real vLLM through kvmesh, cold on one node, warm in a fresh one.

Needs ``pip install 'kvmesh[vllm]'``. Two fresh vLLM processes (vLLM's own
prefix caching off, so a cached token can only have come from kvmesh) run the
same prompt with kvmesh's connector (:mod:`kvmesh.connector.vllm`):

1. on node 0: cold, every token prefilled, the prompt's chunks stored;
2. on the last node: warm, the prompt comes back from kvmesh. With
   ``--nodes 2`` that is another node of a fleet without L2, so the chunks
   travel node to node (P2P), found through the coordinator's directory.

Each vLLM process starts in about 20-40 s on these machines; the figures are
the time of ``generate`` with one output token (time to first token).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from kvmesh.api.storage.v1 import storage_pb2
from kvmesh.storage.client import StorageClient

logger = logging.getLogger(__name__)


def wait_events_acked(storage: str, timeout_s: float = 30.0) -> bool:
    """Until the storage node's coordinator acked every event batch it sent (or the timeout).

    Another node finds a chunk through the coordinator's directory only after
    the coordinator ingested the event that placed it there.
    """

    async def acked() -> bool:
        client = StorageClient(storage)
        try:
            # The emitter batches a node's events for up to 50 ms before it sends them.
            await asyncio.sleep(0.2)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                emitter = (
                    await client.get_status(storage_pb2.GetStatusRequest(), timeout=5.0)
                ).emitter
                if emitter.connected and emitter.unacked_batches == 0:
                    return emitter.last_acked_seq == emitter.last_seq
                await asyncio.sleep(0.05)
            return False
        finally:
            await client.close()

    return asyncio.run(acked())


def run_vllm_demo(
    args: argparse.Namespace, gateways: list[str], storages: list[str], progress: Any
) -> dict[str, Any]:
    """Cold on ``gateways[0]``, warm in a fresh vLLM process on ``gateways[-1]``."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("--engine vllm needs vLLM: pip install 'kvmesh[vllm]'")
    from kvmesh.engine.vllm.model import make_tiny_model
    from kvmesh.engine.vllm.runner import (
        kill,
        results_and_log,
        resume,
        run_engine,
        start_engine,
    )

    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kvmesh-demo-vllm-") as tmp:
        if args.model:
            model = Path(args.model)
        else:
            progress.phase("making a tiny random-weight Llama (no download)")
            model = make_tiny_model(Path(tmp) / "model", seed=args.seed)
        prompt = [rng.randrange(3, 32000) for _ in range(args.prompt_tokens)]
        # A model name of this run's own: "cold" is cold even on a gateway that served
        # an earlier demo.
        base = {
            "model": str(model),
            "max_tokens": 1,
            "logprobs": 5,
            # vLLM's engine core and worker in the engine's own process: a start costs a
            # third of the CPU (vLLM's OpenAI server runs them apart; kvmesh bench vllm too).
            "one_process": True,
            "connector": {"model_name": f"demo-vllm-{uuid.uuid4().hex[:8]}"},
        }
        # The warm engine starts beside the cold one (vLLM takes 20-40 s to start here)
        # and waits before its prompt until node 0 holds the cold run's chunks.
        pause = Path(tmp) / "warm-engine"
        warm_engine = start_engine(
            {**base, "gateway": gateways[-1], "prompts": [prompt],
             "pause_before": {"index": 0, "path": str(pause)}}
        )  # fmt: skip
        try:
            progress.phase(f"vLLM on node 0: cold prefill of {len(prompt)} tokens (starting vLLM)")
            (cold,) = run_engine({**base, "gateway": gateways[0], "prompts": [prompt]})
            if len(gateways) > 1 and not wait_events_acked(storages[0]):
                logger.warning("node 0's events were not acked in time: node 1 may miss")
            node = len(gateways) - 1
            progress.phase(f"a fresh vLLM process on node {node}: the prompt from kvmesh")
            resume(pause)
            (warm,), warm_log = results_and_log(warm_engine)
            if not warm["cached_tokens"]:
                # What the engine's connector said about kvmesh, for the operator.
                said = [line for line in warm_log.splitlines() if "kvmesh" in line.lower()]
                logger.warning(
                    "the warm run got no token from kvmesh; its engine logged:\n%s",
                    "\n".join(said[-20:]) or "(nothing about kvmesh)",
                )
        finally:
            kill(warm_engine)
    progress.done()
    same = warm["token_ids"] == cold["token_ids"] and set(warm["logprobs"][0]) == set(
        cold["logprobs"][0]
    )
    return {
        "engine": "vllm",
        "prompt_tokens": len(prompt),
        "ttft_cold_ms": round(cold["ttft_s"] * 1e3, 2),
        "ttft_warm_ms": round(warm["ttft_s"] * 1e3, 2),
        "speedup": round(cold["ttft_s"] / warm["ttft_s"], 2),
        "tokens_from_cache": warm["cached_tokens"],
        "outputs_match": same,
        "parameters": {
            "model": str(args.model or "tiny random-weight Llama"),
            "cold_gateway": gateways[0],
            "warm_gateway": gateways[-1],
            "nodes": len(gateways),
            "via_p2p": len(gateways) > 1,
        },
    }


def report(result: dict[str, Any]) -> str:
    """The vLLM demo's figures as text."""
    p = result["parameters"]
    where = f"node {p['nodes'] - 1} (P2P from node 0)" if p["via_p2p"] else "node 0"
    return "\n".join(
        [
            f"kvmesh demo: real vLLM ({p['model']}), prompt of {result['prompt_tokens']} tokens",
            f"  cold  on node 0, time to first token {result['ttft_cold_ms']:10.1f} ms",
            f"  warm  a fresh vLLM process on {where}, time to first token "
            f"{result['ttft_warm_ms']:10.1f} ms ({result['tokens_from_cache']} tokens from kvmesh)",
            f"  speedup {result['speedup']:.1f}x, same first token and top-5: "
            f"{'yes' if result['outputs_match'] else 'NO'}",
        ]
    )
