"""The serving benchmark's client: streamed completions, each request's time to first token.

One thread per request in flight (``concurrency``), each sending its next
prompt as soon as its last one answered; a request's TTFT is the time from
sending it to the first streamed token (the first ``data:`` event carrying
text or a token). Plain ``http.client``: nothing beyond the standard library,
and no event loop of its own to compete with the servers for the CPU.
"""

from __future__ import annotations

import http.client
import json
import queue
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.bench.common import percentile


@dataclass
class Answer:
    """One request's figures."""

    index: int  # its place in the round
    ttft_s: float
    total_s: float
    cached_tokens: int  # prompt tokens vLLM did not compute (its own cache or the connector)


def stream_completion(
    host: str, port: int, model: str, prompt: Sequence[int], max_tokens: int, timeout: float
) -> tuple[float, float, int]:
    """Send one streamed completion; (TTFT, total time, cached prompt tokens)."""
    body = json.dumps(
        {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    start = time.perf_counter()
    first: float | None = None
    cached = 0
    try:
        connection.request(
            "POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event: dict[str, Any] = json.loads(data)
            if first is None and event.get("choices"):
                first = time.perf_counter()
            usage = event.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            cached = int(details.get("cached_tokens") or cached)
    finally:
        connection.close()
    end = time.perf_counter()
    return (first or end) - start, end - start, cached


def run_round(
    send: Callable[[int], tuple[float, float, int]],
    count: int,
    concurrency: int,
    on_answer: Callable[[Answer], None] | None = None,
) -> tuple[list[Answer], float]:
    """Send requests ``0..count-1`` with ``concurrency`` in flight; answers in order, round time."""
    todo: queue.Queue[int] = queue.Queue()
    for index in range(count):
        todo.put(index)
    answers: list[Answer] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            try:
                ttft, total, cached = send(index)
            except BaseException as exc:  # reported after the round
                with lock:
                    errors.append(exc)
                return
            answer = Answer(index, ttft, total, cached)
            with lock:
                answers.append(answer)
            if on_answer is not None:
                on_answer(answer)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed; first: {errors[0]!r}")
    return sorted(answers, key=lambda a: a.index), elapsed


def ttft_summary(answers: Sequence[Answer], round_s: float) -> dict[str, float]:
    """A round's TTFT mean, p50, p90 and max (ms), its seconds and the tokens cached."""
    ttfts = sorted(1e3 * a.ttft_s for a in answers)
    return {
        "ttft_mean_ms": round(statistics.fmean(ttfts), 1),
        "ttft_p50_ms": round(percentile(ttfts, 0.5), 1),
        "ttft_p90_ms": round(percentile(ttfts, 0.9), 1),
        "ttft_max_ms": round(ttfts[-1], 1),
        "round_s": round(round_s, 2),
        "cached_tokens": sum(a.cached_tokens for a in answers),
    }
