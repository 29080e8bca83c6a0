"""``kvmesh demo``: a small real transformer served through kvmesh, cold vs warm.

Starts a local fleet (coordinator, storage, gateway; or uses ``--gateway``),
then runs the tiny transformer of :mod:`engine` through the vLLM-shaped
connector of :mod:`connector`:

1. a long prompt, cold: every token is prefilled, its chunks are stored;
2. the same prompt again, warm: the prefix comes back from kvmesh and only
   the last block is recomputed;
3. a second prompt sharing a long prefix with the first, compared with a
   run of the same prompt without kvmesh.

It prints time-to-first-token cold vs warm, the speedup, the tokens served
from the cache and whether the logits matched bit for bit (exit status 1 if
they did not). Progress goes to stderr; ``--json`` prints one JSON object.
Each run uses a fresh cache salt, so "cold" is cold even against a gateway
that served an earlier demo.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
import uuid
from dataclasses import asdict
from typing import Any, TextIO

import grpc
import torch

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.cli import fleetfile
from kvmesh.cli.demo_vllm import report as vllm_report
from kvmesh.cli.demo_vllm import run_vllm_demo, wait_events_acked
from kvmesh.cli.fleet import Fleet, FleetOptions
from kvmesh.common.config import ConfigError, parse_size
from kvmesh.engine import Engine, EngineConfig, ModelConfig, RequestOutput, blocks_needed
from kvmesh.gateway.client import GatewayClient

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16
DEFAULT_ENGINE_DIR = "/dev/shm"
DECODE_TOKENS = 4


class Progress:
    """One status line on stderr, redrawn in place on a terminal (a line per phase otherwise)."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.tty = stream.isatty()
        self._phase = ""
        self._last_draw = 0.0

    def phase(self, text: str) -> None:
        """Start a new phase."""
        self._finish_line()
        self._phase = text
        if self.enabled:
            self.stream.write(f"kvmesh demo: {text}" + ("" if self.tty else "\n"))
            self.stream.flush()

    def tokens(self, done: int, total: int) -> None:
        """Prefill progress of the current phase (terminals only; throttled)."""
        if not (self.enabled and self.tty):
            return
        now = time.monotonic()
        if done < total and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        width = 30
        filled = width * done // max(total, 1)
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r\033[Kkvmesh demo: {self._phase} [{bar}] {done}/{total} tokens")
        self.stream.flush()

    def _finish_line(self) -> None:
        if self.enabled and self.tty and self._phase:
            self.stream.write("\n")
            self.stream.flush()

    def done(self) -> None:
        """End the display."""
        self._finish_line()
        self._phase = ""


DESCRIPTION = (
    "Run a small decoder-only transformer (paged KV cache in shared memory) through kvmesh's "
    "vLLM-shaped connector: a long prompt cold and warm, and a second prompt sharing a long "
    "prefix. Prints time-to-first-token, speedup, tokens served from the cache and whether "
    "the logits matched bit for bit. Starts a local fleet unless --gateway is given."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvmesh demo``."""
    defaults = ModelConfig()
    p.add_argument(
        "--gateway",
        metavar="ADDR",
        default=None,
        help="use this running gateway (host:port, unix:path, or lane:path for its local "
        "lane) instead of starting a local fleet (default: the first gateway of the fleet "
        f"of the running kvmesh up, found in {fleetfile.where()}, if any; a fleet whose "
        "gateway does not answer is ignored)",
    )
    p.add_argument(
        "--own-fleet",
        action="store_true",
        help="start a local fleet for the demo even when kvmesh up is running one",
    )
    p.add_argument(
        "--engine",
        choices=("tiny", "vllm"),
        default="tiny",
        help="tiny: kvmesh's own small transformer (no extra needed); vllm: real vLLM "
        "(pip install 'kvmesh[vllm]'), cold and then warm in a fresh vLLM process "
        "(default: tiny)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="nodes of the demo's own fleet; with 2 or more the fleet has no L2 and the warm "
        "run is on the last node, so the prefix travels node to node (P2P) (default: 1)",
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="with --engine vllm: a local Hugging Face model directory (default: a tiny "
        "random-weight Llama made in a temporary directory)",
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=8192, help="length of the prompts (default: 8192)"
    )
    p.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=None,
        help="tokens the second prompt shares with the first (default: 3/4 of the prompt)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for the model (default: 1 — on a small machine shared with the "
        "fleet's processes, more threads spin against each other and prefill gets slower)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of weights and prompts (default: 0)")
    p.add_argument(
        "--engine-dir",
        metavar="DIR",
        default=DEFAULT_ENGINE_DIR,
        help="directory of the engine's KV shared-memory file; it must lie inside the storage "
        "node's --allowed-memory-dir (default: /dev/shm; with a fleet of the demo's own, "
        "that fleet's directory under /dev/shm)",
    )
    model = p.add_argument_group("model (random weights, seeded)")
    model.add_argument(
        "--layers",
        type=int,
        default=defaults.num_layers,
        help="decoder layers (default: %(default)s)",
    )
    model.add_argument(
        "--hidden-size", type=int, default=defaults.hidden_size, help="(default: %(default)s)"
    )
    model.add_argument(
        "--heads",
        type=int,
        default=defaults.num_heads,
        help="attention heads (default: %(default)s)",
    )
    model.add_argument(
        "--kv-heads",
        type=int,
        default=defaults.num_kv_heads,
        help="KV heads (default: %(default)s)",
    )
    model.add_argument(
        "--head-dim", type=int, default=defaults.head_dim, help="(default: %(default)s)"
    )
    model.add_argument(
        "--intermediate-size",
        type=int,
        default=defaults.intermediate_size,
        help="MLP width (default: %(default)s)",
    )
    model.add_argument(
        "--vocab-size", type=int, default=defaults.vocab_size, help="(default: %(default)s)"
    )
    fleet = p.add_argument_group("local fleet (without --gateway)")
    fleet.add_argument("--l1-size", default="1GiB", help="L1 memory of the node (default: 1GiB)")
    fleet.add_argument(
        "--chunk-size", type=int, default=256, help="tokens per chunk (default: 256)"
    )


def _model_config(args: argparse.Namespace) -> ModelConfig:
    config = ModelConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate_size=args.intermediate_size,
        seed=args.seed,
    )
    try:
        config.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return config


def _prompts(args: argparse.Namespace, vocab: int, shared: int) -> tuple[list[int], list[int]]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    first = torch.randint(0, vocab, (args.prompt_tokens,), generator=gen).tolist()
    tail = torch.randint(0, vocab, (args.prompt_tokens - shared,), generator=gen).tolist()
    if tail:
        # The second prompt must really diverge right after the shared prefix.
        tail[0] = (first[shared] + 1) % vocab
    return first, first[:shared] + tail


def _gateway_chunk_size(address: str, timeout: float = 10.0) -> int:
    # No wait_for_ready: an address where nothing listens fails at once, naming it.
    with GatewayClient(address) as client:
        resp = client.get_chunk_size(gateway_pb2.GetChunkSizeRequest(), timeout=timeout)
    return int(resp.chunk_size)


def _running_gateway() -> tuple[str, str] | None:
    """The first gateway of the fleet ``kvmesh up`` is running, and its fleet file.

    A fleet whose gateway does not answer (a file left by a fleet that is
    gone) is ignored with a line on stderr: the demo then starts its own.
    """
    running = fleetfile.find()
    if running is None:
        return None
    note = running.note()
    if note:
        print(note, file=sys.stderr)
    nodes = running.data.get("nodes") or []
    # Same host as the fleet: its local lane when it has one.
    gateway = (nodes[0].get("gateway_lane") or nodes[0].get("gateway")) if nodes else None
    if not gateway:
        return None
    try:
        _gateway_chunk_size(str(gateway), timeout=2.0)
    except grpc.RpcError as exc:
        print(
            f"kvmesh demo: ignoring {running.path}: its gateway {gateway} does not answer "
            f"({exc.code().name}); starting a fleet of its own",
            file=sys.stderr,
        )
        return None
    return str(gateway), str(running.path)


def _figures(out: RequestOutput) -> dict[str, Any]:
    return {
        "ttft_ms": round(out.ttft_s * 1000, 3),
        "tokens_from_cache": out.tokens_from_cache,
        "lookup_hit_tokens": out.lookup_hit_tokens,
        "lookup_l2_hit_chunks": out.lookup_l2_hit_chunks,
        "tokens_computed": out.prompt_tokens - out.tokens_from_cache,
        "lookup_ms": round(out.lookup_s * 1000, 3),
        "load_ms": round(out.load_s * 1000, 3),
        "prefill_ms": round(out.prefill_s * 1000, 3),
        "store_ms": round(out.store_s * 1000, 3),
        "load_failed": out.load_failed,
        "store_failed": out.store_failed,
    }


def _same(a: RequestOutput, b: RequestOutput) -> bool:
    return torch.equal(a.logits, b.logits) and a.output_token_ids == b.output_token_ids


def _run(
    args: argparse.Namespace,
    gateway: str,
    chunk: int,
    progress: Progress,
    fleet: bool,
    warm_on: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """Cold on ``gateway``; warm there too, or on ``warm_on`` (another node's gateway and
    the storage node behind ``gateway``, whose events must reach the coordinator first)."""
    model = _model_config(args)
    n = args.prompt_tokens
    shared = args.shared_prefix_tokens
    salt = f"demo-{uuid.uuid4().hex[:12]}"
    first, second = _prompts(args, model.vocab_size, shared)
    # Twice the blocks one request needs, so the warm run lands in other blocks than
    # the cold one: its KV can only have come from kvmesh.
    num_blocks = 2 * blocks_needed(n + DECODE_TOKENS, BLOCK_SIZE) + 1
    config = EngineConfig(
        model=model,
        num_blocks=num_blocks,
        prefill_chunk_size=chunk,
        gateway=gateway,
        shm_dir=args.engine_dir,
    )

    def run(engine: Engine, label: str, tokens: list[int], use_salt: str) -> RequestOutput:
        progress.phase(label)
        return engine.generate(
            tokens, cache_salt=use_salt, max_new_tokens=DECODE_TOKENS, on_progress=progress.tokens
        )

    progress.phase("loading the model and registering its KV cache")
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(Engine(config))
        cold = run(engine, "cold prefill", first, salt)
        where = ""
        if warm_on is not None:
            warm_gateway, cold_storage = warm_on
            if not wait_events_acked(cold_storage):
                logger.warning("node 0's events were not acked in time: the warm run may miss")
            where = " on the last node, over P2P"
            engine = stack.enter_context(Engine(dataclasses.replace(config, gateway=warm_gateway)))
        warm = run(engine, f"warm prefill (prefix from kvmesh{where})", first, salt)
        with_prefix = run(engine, "second prompt, shared prefix from kvmesh", second, salt)
    with Engine(EngineConfig(model=model, num_blocks=num_blocks, prefill_chunk_size=chunk)) as ref:
        reference = run(ref, "second prompt without kvmesh", second, "")
    progress.done()
    return {
        "prompt_tokens": n,
        "ttft_cold_ms": round(cold.ttft_s * 1000, 3),
        "ttft_warm_ms": round(warm.ttft_s * 1000, 3),
        "speedup": round(cold.ttft_s / warm.ttft_s, 2),
        "tokens_from_cache": warm.tokens_from_cache,
        "logits_match": _same(cold, warm),
        "cold": _figures(cold),
        "warm": _figures(warm),
        "shared_prefix": {
            "prompt_tokens": len(second),
            "shared_prefix_tokens": shared,
            "ttft_without_kvmesh_ms": round(reference.ttft_s * 1000, 3),
            "ttft_ms": round(with_prefix.ttft_s * 1000, 3),
            "speedup": round(reference.ttft_s / with_prefix.ttft_s, 2),
            "tokens_from_cache": with_prefix.tokens_from_cache,
            "logits_match": _same(reference, with_prefix),
            "run": _figures(with_prefix),
        },
        "generated_tokens": warm.output_token_ids,
        "parameters": {
            "model": asdict(model),
            "model_name": model.name,
            "dtype": "float32",
            "block_size": BLOCK_SIZE,
            "chunk_size": chunk,
            "prefill_tile_tokens": chunk,
            "kv_bytes_per_token": model.kv_bytes_per_token,
            "gateway": gateway,
            "local_fleet": fleet,
            "warm_gateway": warm_on[0] if warm_on else gateway,
            "cache_salt": salt,
            "torch_threads": torch.get_num_threads(),
            "decode_tokens": DECODE_TOKENS,
        },
    }


def _report(result: dict[str, Any]) -> str:
    p = result["parameters"]
    m = p["model"]
    sp = result["shared_prefix"]
    yes = {True: "yes", False: "NO"}
    warm = result["warm"]
    return "\n".join(
        [
            f"kvmesh demo: {m['num_layers']}-layer transformer (hidden {m['hidden_size']}, "
            f"{m['num_heads']} query / {m['num_kv_heads']} kv heads of {m['head_dim']}), "
            f"float32 on CPU, {p['torch_threads']} torch thread(s)",
            f"gateway {p['gateway']}{' (local fleet)' if p['local_fleet'] else ''}, "
            f"chunk {p['chunk_size']} tokens, block {p['block_size']}",
            "",
            f"prompt of {result['prompt_tokens']} tokens",
            f"  cold  time to first token {result['ttft_cold_ms']:10.1f} ms   "
            f"({result['cold']['tokens_from_cache']} tokens from kvmesh)",
            *(
                [f"  (warm runs on another node, {p['warm_gateway']}: the prefix came over P2P)"]
                if p["warm_gateway"] != p["gateway"]
                else []
            ),
            f"  warm  time to first token {result['ttft_warm_ms']:10.1f} ms   "
            f"({result['tokens_from_cache']} tokens from kvmesh, "
            f"the last {warm['tokens_computed']} recomputed; load {warm['load_ms']:.1f} ms)",
            f"  speedup {result['speedup']:.1f}x, logits bit-identical: "
            f"{yes[result['logits_match']]}",
            "",
            f"second prompt of {sp['prompt_tokens']} tokens sharing the first "
            f"{sp['shared_prefix_tokens']}",
            f"  without kvmesh  time to first token {sp['ttft_without_kvmesh_ms']:10.1f} ms",
            f"  with kvmesh     time to first token {sp['ttft_ms']:10.1f} ms   "
            f"({sp['tokens_from_cache']} tokens from kvmesh)",
            f"  speedup {sp['speedup']:.1f}x, logits bit-identical: {yes[sp['logits_match']]}",
        ]
    )


def run_demo(args: argparse.Namespace) -> int:
    """``kvmesh demo``: returns 0 when every logit matched, 1 otherwise or on failure."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.prompt_tokens < 2:
        raise ConfigError("--prompt-tokens must be >= 2")
    if args.shared_prefix_tokens is None:
        args.shared_prefix_tokens = args.prompt_tokens * 3 // 4
    if not 0 <= args.shared_prefix_tokens < args.prompt_tokens:
        raise ConfigError("--shared-prefix-tokens must be in [0, --prompt-tokens)")
    if args.threads < 1:
        raise ConfigError("--threads must be >= 1")
    if args.nodes < 1:
        raise ConfigError("--nodes must be >= 1")
    if args.nodes > 1 and (args.gateway is not None or not args.own_fleet):
        if args.gateway is not None:
            raise ConfigError("--nodes needs the demo's own fleet: drop --gateway")
        args.own_fleet = True  # a running `kvmesh up` fleet may share through L2
    if args.model is not None and args.engine != "vllm":
        raise ConfigError("--model is for --engine vllm (the tiny engine has its own model)")
    torch.set_num_threads(args.threads)
    _model_config(args)
    progress = Progress(sys.stderr, enabled=not args.no_progress)
    fleet: Fleet | None = None
    if args.gateway is None and not args.own_fleet:
        running = _running_gateway()
        if running is not None:
            args.gateway = running[0]
            progress.phase(f"using the fleet of {running[1]} (gateway {running[0]})")
    try:
        if args.gateway is None:
            nodes = args.nodes
            progress.phase(
                f"starting a local fleet (coordinator, {nodes} x storage + gateway"
                + (", no L2: nodes share only node to node)" if nodes > 1 else ")")
            )
            l1 = parse_size(args.l1_size)
            fleet = Fleet(
                FleetOptions(
                    l1_size_bytes=l1,
                    chunk_size=args.chunk_size,
                    nodes=nodes,
                    l2=["none"] if nodes > 1 else [],
                )
            )
            fleet.start()
            # The engine runs on the fleet's host: it dials the gateways' local lanes.
            gateways = [fleet.endpoint(f"node-{i}-gateway", "lane") for i in range(nodes)]
            storages = [fleet.endpoint(f"node-{i}-storage") for i in range(nodes)]
            if args.engine_dir == DEFAULT_ENGINE_DIR:
                # Inside the fleet's own directory: removed with the fleet, even when
                # this process is killed (the fleet's reaper removes the directory).
                args.engine_dir = str(fleet.shm_dir)
        else:
            gateways, storages = [args.gateway], []
        if args.engine == "vllm":
            result = run_vllm_demo(args, gateways, storages, progress)
        else:
            chunk = _gateway_chunk_size(gateways[0])
            warm_on = (gateways[-1], storages[0]) if len(gateways) > 1 else None
            result = _run(args, gateways[0], chunk, progress, fleet is not None, warm_on)
    except (RuntimeError, grpc.RpcError) as exc:
        progress.done()
        # A client error names the hop it could not reach (kvmesh.rpc.client.located).
        call = isinstance(exc, grpc.Call)
        detail = f"{exc.code().name}: {exc.details()}" if call else str(exc)  # type: ignore[union-attr]
        print(f"kvmesh demo: error: {detail}", file=sys.stderr)
        return 1
    finally:
        if fleet is not None:
            progress.phase("stopping the local fleet")
            fleet.stop()
            progress.done()
    if args.json:
        print(json.dumps(result))
    elif args.engine == "vllm":
        print(vllm_report(result))
    else:
        print(_report(result))
    if args.engine == "vllm":
        return 0 if result["outputs_match"] else 1
    ok = result["logits_match"] and result["shared_prefix"]["logits_match"]
    return 0 if ok else 1
