"""One vLLM process: ``python -m kvmesh.engine.vllm.worker SPEC.json``.

Runs each prompt of the spec in turn through a fresh offline ``vllm.LLM`` and
prints one JSON line per prompt (``{"ttft_s", "token_ids", "logprobs",
"cached_tokens"}``), then ``{"done": true}``. With one output token, the time of
``generate`` is the time to first token. Benchmarks and tests run it in a
subprocess: every run is a fresh engine (nothing cached in vLLM itself unless
``prefix_caching`` is on), and vLLM's own child processes go away with it.

Spec keys: ``model`` (folder), ``prompts`` (lists of token ids), ``max_tokens``
(default 1), ``logprobs`` (top-k per token, default 0), ``prefix_caching``
(default false), ``gateway`` (kvmesh gateway target; absent: no connector),
``connector`` (extra ``kv_connector_extra_config`` keys), ``kv_cache_gib``,
``max_num_batched_tokens``, ``repeat`` (run each prompt this many times),
``one_process`` (default false: vLLM's engine core and worker run in this
process, as ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with the ``uni`` executor;
a start then costs about a third of the CPU: 15 s instead of 34 s here),
``kv_transfer_params`` (one entry per prompt, null for none: the request's
``kv_transfer_params``, such as kvmesh's per-request switches),
``gap_s`` (seconds to sleep after each run: the connector's background stores
then finish before the next prompt's prefill instead of competing with it),
``pause_before`` (``{"index": i, "path": P}``, or a list of them: before
prompt ``i``, create ``P.ready`` and wait for ``P.go``; tests change the world
in between; the log then gets a line ``KVMESH-RESUMED before prompt i``),
``reset_before`` (prompt indices: before each, ``LLM.reset_prefix_cache(
reset_connector=True)``, as vLLM does around a weight update; its answer is
printed as ``{"reset": true|false}``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

#: Prefix of the result lines on stdout (vLLM logs there too).
MARK = "KVMESH-RESULT "
#: Written to stderr (the log) when a pause ends, followed by the prompt's index: what
#: the log says after it happened after the test changed the world.
RESUMED = "KVMESH-RESUMED before prompt"


def engine_env(kv_cache_gib: int) -> dict[str, str]:
    """Environment of a comparable vLLM CPU run: KV size, threads bound to every core."""
    cores = os.cpu_count() or 1
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        # vLLM binds its worker to one core unless a connector is set: bind all, always.
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
    }


def transfer_config(gateway: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """``--kv-transfer-config`` for kvmesh's connector."""
    return {
        "kv_connector": "KVMeshConnector",
        "kv_connector_module_path": "kvmesh.connector.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"gateway": gateway, **(extra or {})},
    }


def run(spec: dict[str, Any]) -> None:
    if spec.get("one_process"):
        # vLLM's engine core and its worker in this process: one import of torch and
        # vLLM instead of three (a start costs ~1/3 of the CPU); the connector's
        # scheduler and worker halves still run as separate instances.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "enforce_eager": True,
        "enable_prefix_caching": bool(spec.get("prefix_caching", False)),
        "max_model_len": int(spec.get("max_model_len") or _context_length(spec["model"])),
        "max_num_batched_tokens": int(spec.get("max_num_batched_tokens", 4096)),
        "seed": 0,
    }
    if spec.get("one_process"):
        kwargs["distributed_executor_backend"] = "uni"
    if spec.get("gateway"):
        kwargs["kv_transfer_config"] = KVTransferConfig(
            **transfer_config(spec["gateway"], spec.get("connector"))
        )
    llm = LLM(**kwargs)
    sampling = {
        "max_tokens": int(spec.get("max_tokens", 1)),
        "temperature": 0.0,
        "logprobs": int(spec.get("logprobs", 0)) or None,
    }
    transfer = spec.get("kv_transfer_params") or [None] * len(spec["prompts"])
    if len(transfer) != len(spec["prompts"]):
        raise ValueError("kv_transfer_params needs one entry per prompt")
    pauses = spec.get("pause_before") or []
    if isinstance(pauses, dict):
        pauses = [pauses]
    paths = {int(p["index"]): str(p["path"]) for p in pauses}
    resets = {int(i) for i in spec.get("reset_before") or ()}
    for index, prompt in enumerate(spec["prompts"]):
        extra = {"kv_transfer_params": transfer[index]} if transfer[index] is not None else None
        params = SamplingParams(**sampling, extra_args=extra)
        if index in paths:
            _pause(paths[index])
            print(f"{RESUMED} {index}", file=sys.stderr, flush=True)
        if index in resets:
            reset = llm.reset_prefix_cache(reset_connector=True)
            print(MARK + json.dumps({"reset": bool(reset)}), flush=True)
        for _ in range(int(spec.get("repeat", 1))):
            start = time.perf_counter()
            out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
            elapsed = time.perf_counter() - start
            completion = out.outputs[0]
            logprobs = [
                {str(k): round(v.logprob, 6) for k, v in step.items()}
                for step in (completion.logprobs or [])
            ]
            line = {
                "ttft_s": elapsed,
                "token_ids": list(completion.token_ids),
                "logprobs": logprobs,
                "cached_tokens": out.num_cached_tokens or 0,
            }
            print(MARK + json.dumps(line), flush=True)
            time.sleep(float(spec.get("gap_s", 0.0)))
    print(MARK + json.dumps({"done": True}), flush=True)


def _context_length(model: str, cap: int = 16384) -> int:
    """The model's own context (its config's max_position_embeddings), at most ``cap``."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        return min(cap, int(config.get("max_position_embeddings") or cap))
    except (OSError, ValueError, TypeError):
        return cap


def _pause(path: str, timeout_s: float = 300.0) -> None:
    # The other side: kvmesh.engine.vllm.runner.is_paused and resume.
    with open(path + ".ready", "w"):
        pass
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path + ".go"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody created {path}.go within {timeout_s:.0f} s")
        time.sleep(0.05)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    run(spec)


if __name__ == "__main__":
    main()
