"""``kvmesh bench blend``: CacheBlend on a real model, for speed and for what it does to the output.

N documents (short English texts about made-up towns, seeded,
kvmesh.bench.blend_corpus) are computed once in the two forms a blend reuses
(kvmesh.engine.documents): after the system prompt, kept with it, and after
the system prompt and a primer document, kept under their tokens alone. M
prompts are the system prompt, k of the documents in a random order and a
question about one of them, in SmolLM2's chat format. Each prompt runs in
every arrangement, interleaved so machine noise hits them alike:

- ``full_prefill``: the whole prompt computed (the reference);
- ``prefix_only``: the system prompt's K/V reused as a prefix (what prefix
  caching gives when the documents come in a new order), the rest computed;
- ``blend_0``, ``blend_0_15``, ``blend_1`` (``--ratios``): the documents' K/V
  reused where they now sit (re-RoPE), with CacheBlend's selective recompute
  of that share of the cached tokens (kvmesh.engine.blend), the rows chosen
  by their deviation weighed by the question's attention;
- ``deviation_0_15`` ... (``--deviation``): the same with CacheBlend's own
  rule, the deviation alone;
- ``oracle_0_15`` ... (``--oracle``): each ratio blended with the rows an
  oracle picks from the full prefill by their deviation
  (kvmesh.bench.blend_oracle); its TTFT leaves out the picking;
- ``reorder_vllm`` (``--no-vllm`` skips it): the reorder plan through real,
  unmodified vLLM (kvmesh.bench.blend_vllm), measured against vLLM's own
  full prefill.

Per arrangement: the mean TTFT (the prefill up to the first token's logits,
finding the stored documents in the prompt and fetching their K/V included),
the share of prompt tokens whose K/V was reused, and against the full prefill
the greedy agreement (position by position over ``--generate`` tokens) and the
KL divergence of the first token's distribution. Position by position, an
answer that says the same in other words agrees on nothing after the first
changed token, so the answer is also read: ``answer_accuracy`` is the share of
prompts whose generated text names the asked town's river first, and
``answer_agreement`` the share that names the same river first as the full
prefill's text. docs/blend.md, "Benchmark" has the figures.

The documents' K/V is kept in a kvmesh node (``--gateway``, or one started
for the run) under keys of their tokens alone
(kvmesh.engine.segment_store) and fetched from it inside each timed prefill.
An arrangement that did not run is named under ``not_run`` with the reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvmesh.bench.blend_corpus import (
    Corpus,
    Tokenizer,
    first_river,
    load_tokenizer,
    make_corpus,
    make_prompts,
)
from kvmesh.bench.blend_oracle import oracle_name, oracle_rows
from kvmesh.bench.blend_vllm import measure_reorder, summary
from kvmesh.bench.common import (
    Progress,
    ServiceProcess,
    bench_main,
    service_deaths_named,
    size_text,
    start_service,
)
from kvmesh.engine.blend import Segment, blend_prefill
from kvmesh.engine.documents import DocumentWriter
from kvmesh.engine.llama import LlamaModel, SequenceKV
from kvmesh.engine.segment_store import SegmentStore

MIB = 1 << 20

REQUIRES = ("torch", "safetensors", "transformers")

#: The recompute ratios blended by default (the arrangements blend_0, blend_0_15, blend_1).
RATIOS = (0.0, 0.15, 1.0)


def arrangement(ratio: float, rule: str = "blend") -> str:
    """The arrangement's name of a recompute ratio: 0.15 -> blend_0_15 (deviation_0_15)."""
    return f"{rule}_" + f"{ratio:g}".replace(".", "_")


def _ratios(text: str) -> list[float]:
    try:
        ratios = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not ratios or not all(0.0 <= r <= 1.0 for r in ratios):
        raise argparse.ArgumentTypeError(f"ratios must be in [0, 1]: {text!r}")
    return sorted(set(ratios))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        metavar="NAME|DIR",
        default="smollm2",
        help="a Llama-architecture Hugging Face folder, or a model kvmesh makes offline "
        "(smollm2, see kvmesh model)",
    )
    parser.add_argument("--documents", type=int, default=8, help="documents stored once (N)")
    parser.add_argument("--docs-per-prompt", type=int, default=3, help="documents per prompt (k)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts (M)")
    parser.add_argument("--sentences", type=int, default=12, help="sentences per document")
    parser.add_argument("--generate", type=int, default=32, help="greedy tokens compared")
    parser.add_argument("--check-layer", type=int, default=1, help="CacheBlend's check layer")
    parser.add_argument("--seed", type=int, default=0, help="seed of the texts and orders")
    parser.add_argument(
        "--gateway",
        metavar="TARGET",
        default=None,
        help="the gateway of the kvmesh node, on this host, that keeps the documents' K/V "
        "(host:port or lane:PATH; default: the running fleet's, else a node started for the "
        "run)",
    )
    parser.add_argument(
        "--vllm",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the reorder_vllm arrangement (real vLLM with kvmesh's connector, ~1 min more)",
    )
    parser.add_argument(
        "--deviation",
        action="store_true",
        help="also blend each ratio with CacheBlend's own rule, the values' deviation alone "
        "(deviation_R; blend_R weighs it by the question's attention, see docs/blend.md)",
    )
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="also blend each ratio with the rows an oracle picks from the full prefill "
        "(oracle_R, by their deviation from it; a measurement, not a way to serve)",
    )
    parser.add_argument(
        "--ratios",
        type=_ratios,
        default=list(RATIOS),
        help="recompute ratios to blend at, comma-separated (each an arrangement blend_R)",
    )


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference || other) of the softmax distributions of two logit vectors."""
    p = torch.log_softmax(reference.double(), -1)
    q = torch.log_softmax(other.double(), -1)
    return float(torch.sum(p.exp() * (p - q)))


def _check_args(args: argparse.Namespace) -> None:
    for name in ("documents", "docs_per_prompt", "prompts", "sentences", "generate"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvmesh bench blend: --{name.replace('_', '-')} must be >= 1")
    if args.docs_per_prompt > args.documents:
        raise SystemExit("kvmesh bench blend: --docs-per-prompt must be <= --documents")


@contextmanager
def _node(args: argparse.Namespace, l1_bytes: int, progress: Progress) -> Iterator[str]:
    """The gateway of the node that keeps the K/V: ``--gateway``, or a node started for this
    run (``kvmesh node``: gateway and storage in one process)."""
    if args.gateway:
        yield args.gateway
        return
    workdir = Path(tempfile.mkdtemp(prefix="kvmesh-bench-blend-"))
    shm = Path("/dev/shm") / f"kvmesh-bench-blend-{uuid.uuid4().hex[:8]}"
    segment = max(4 * MIB, l1_bytes - l1_bytes % (4 * MIB))
    owned: list[ServiceProcess] = []
    try:
        shm.mkdir(parents=True)
        progress.phase(f"starting a kvmesh node (L1 {size_text(segment)})")
        node = start_service(
            owned,
            "node",
            # A unix socket in the run's folder: a local benchmark needs no TCP port.
            ["--unix-socket", str(workdir / "node.sock"), "--metrics-port", "-1",
             "--log-level", "WARNING",
             "--instance-id", f"bench-blend-{uuid.uuid4().hex[:6]}", "--data-dir", str(workdir),
             "--l2", "none", "--l1-size-bytes", str(segment), "--l1-segment-bytes", str(segment),
             "--shm-dir", str(shm)],
            workdir,
            "node",
        )  # fmt: skip
        with service_deaths_named(owned):
            yield str(node.wait_ready()["grpc"])
    finally:
        for proc in owned:
            proc.stop()
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvmesh.common import model_store

    _check_args(args)
    with Progress.for_args("blend", args) as progress:
        progress.phase(f"loading {args.model}")
        folder = model_store.resolve(args.model)
        model = LlamaModel.load(folder)
        if not 0 <= args.check_layer < model.num_layers:
            raise SystemExit(
                f"kvmesh bench blend: --check-layer must be in [0, {model.num_layers})"
            )
        words = load_tokenizer(folder)
        texts = make_corpus(words.encode, args)
        c = model.config
        row_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
        # The system prompt, and each document twice (after it, and after the primer).
        docs = len(texts.documents)
        held = (docs + 1) * len(texts.system) + 2 * sum(map(len, texts.documents))
        questions, answers = make_prompts(texts, words.encode, args)
        with _node(args, 2 * held * row_bytes + 64 * MIB, progress) as target:
            store = SegmentStore(
                target, str(folder), c.rope, num_layers=c.num_layers, kv_heads=c.num_kv_heads
            )
            try:
                figures = _measure(model, store, texts, (questions, answers), words, args, progress)
            finally:
                store.close()
        result = _report(figures, model, folder, texts, args)
        if not args.vllm:
            result["not_run"]["reorder_vllm"] = "--no-vllm"
        elif importlib.util.find_spec("vllm") is None:
            result["not_run"]["reorder_vllm"] = "vLLM is not installed (pip install 'kvmesh[vllm]')"
        else:
            reorder = measure_reorder(
                folder,
                texts.system,
                (questions, answers),
                first_river,
                args,
                progress,
            )
            result["arrangements"]["reorder_vllm"] = summary(reorder)
    return result


def _measure(
    model: LlamaModel,
    store: SegmentStore,
    corpus: Corpus,
    workload: tuple[list[tuple[list[list[int]], list[int]]], list[str]],
    tokenizer: Tokenizer,
    args: argparse.Namespace,
    progress: Progress,
) -> dict[str, dict[str, list[float]]]:
    """Per arrangement, per figure, one value per prompt."""
    prompts, answers = workload
    progress.phase("computing the documents once, into the node", total=len(corpus.documents))
    writer = DocumentWriter(model, store, corpus.system, corpus.primer)
    store.put(corpus.system, writer.system_kv, source_start=0)  # prefix_only's
    start = len(corpus.system)
    for done, doc in enumerate(corpus.documents, 1):
        # After the system prompt (kept with it) and after the primer (kept alone):
        # docs/blend.md, "Computing documents for reuse".
        writer.put(doc)
        progress.count(done)
    model.prefill(corpus.system + corpus.documents[0])  # warm-up: first calls are slow
    # Each blend arrangement's ratio and rule of choosing rows (docs/blend.md).
    blends = {arrangement(r): (r, "attention") for r in args.ratios}
    # The oracle at 0 and 1 would be blend_0 and blend_1 again.
    oracles = {oracle_name(r): r for r in args.ratios if 0 < r < 1} if args.oracle else {}
    if args.deviation:
        between = [r for r in args.ratios if 0 < r < 1]
        blends |= {arrangement(r, "deviation"): (r, "deviation") for r in between}
    names = ("full_prefill", "prefix_only", *blends, *oracles)
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    progress.phase("prompts in every arrangement", total=len(prompts))
    for done, ((docs, question), answer) in enumerate(zip(prompts, answers, strict=True), 1):
        tokens = corpus.system + [t for d in docs for t in d] + question
        reference: tuple[torch.Tensor, list[int], str | None] | None = None
        full_kv: SequenceKV | None = None
        for name in names:
            chosen: list[int] | None = None
            segments: list[Segment] = []
            if name in oracles:  # chosen before the clock starts: it reads the full prefill
                assert full_kv is not None  # full_prefill runs first
                segments = store.segments(tokens)
                chosen = oracle_rows(model, segments, full_kv, oracles[name], args.check_layer)
            began = time.perf_counter()
            if name == "full_prefill":
                logits, kv = model.prefill(tokens)
                full_kv = kv
                reused = 0
            elif chosen is not None:
                result = blend_prefill(
                    model, segments, oracles[name], args.check_layer, recompute_rows=chosen
                )
                logits, kv, reused = result.logits, result.kv, result.reused_tokens
            elif name == "prefix_only":
                prefix = store.get(corpus.system)
                logits, kv = model.prefill(tokens[start:], past=prefix)
                reused = start if prefix is not None else 0
            else:
                # The prompt as the engine gets it, boundaries unknown: the node finds
                # the stored documents in it (LookupSegments), then they are fetched.
                segments = store.segments(tokens)
                ratio, rule = blends[name]
                result = blend_prefill(model, segments, ratio, args.check_layer, selection=rule)
                logits, kv, reused = result.logits, result.kv, result.reused_tokens
            ttft = time.perf_counter() - began
            generated = model.generate(logits, kv, args.generate)
            river = first_river(tokenizer.decode(generated))
            if reference is None:
                reference = (logits, generated, river)
            agree = sum(a == b for a, b in zip(generated, reference[1], strict=True))
            row = {
                "ttft_ms": ttft * 1e3,
                "reused_token_fraction": reused / len(tokens),
                "greedy_agreement": agree / args.generate,
                "answer_accuracy": float(river == answer),
                "answer_agreement": float(river == reference[2]),
                "first_token_kl": _kl(reference[0], logits),
                "prompt_tokens": float(len(tokens)),
            }
            for key, value in row.items():
                figures[name].setdefault(key, []).append(value)
        progress.count(done)
    return figures


def _report(
    figures: dict[str, dict[str, list[float]]],
    model: LlamaModel,
    folder: Path,
    corpus: Corpus,
    args: argparse.Namespace,
) -> dict[str, Any]:
    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    full_ttft = mean(figures["full_prefill"]["ttft_ms"])
    arrangements = {
        name: {
            "ttft_mean_ms": round(mean(rows["ttft_ms"]), 1),
            "ttft_speedup": round(full_ttft / mean(rows["ttft_ms"]), 2),
            "reused_token_fraction": round(mean(rows["reused_token_fraction"]), 4),
            "greedy_agreement": round(mean(rows["greedy_agreement"]), 4),
            "answer_accuracy": round(mean(rows["answer_accuracy"]), 4),
            "answer_agreement": round(mean(rows["answer_agreement"]), 4),
            "first_token_kl": float(f"{mean(rows['first_token_kl']):.3g}"),
        }
        for name, rows in figures.items()
    }
    return {
        "benchmark": "blend",
        "model": str(folder),
        "layers": model.num_layers,
        "documents": args.documents,
        "docs_per_prompt": args.docs_per_prompt,
        "prompts": args.prompts,
        "prompt_tokens_mean": round(mean(figures["full_prefill"]["prompt_tokens"]), 1),
        "document_tokens_mean": round(sum(map(len, corpus.documents)) / len(corpus.documents), 1),
        "generate": args.generate,
        "check_layer": args.check_layer,
        "torch_threads": torch.get_num_threads(),
        "kv_store": "a kvmesh node (PrepareSegmentStore/Retrieve: keys of the tokens alone); "
        "each document after the system prompt (kept with it) and after a primer (alone)",
        "arrangements": arrangements,
        "not_run": {},
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"CacheBlend on {result['model']} ({result['layers']} layers), "
        f"{result['prompts']} prompts of {result['prompt_tokens_mean']:.0f} tokens "
        f"({result['docs_per_prompt']} of {result['documents']} documents, "
        f"{result['document_tokens_mean']:.0f} tokens each), check layer {result['check_layer']}",
        f"{'arrangement':<14}{'TTFT ms':>10}{'speedup':>9}{'reused':>9}"
        f"{'greedy agree':>14}{'first-token KL':>16}{'answer right':>14}{'same answer':>13}",
    ]
    for name, row in result["arrangements"].items():
        kl = row["first_token_kl"]
        lines.append(
            f"{name:<14}{row['ttft_mean_ms']:>10.1f}{row['ttft_speedup']:>8.2f}x"
            f"{row['reused_token_fraction']:>9.1%}{row['greedy_agreement']:>14.1%}"
            + (f"{kl:>16.4g}" if kl is not None else f"{'-':>16}")
            + (
                f"{row['answer_accuracy']:>14.0%}{row['answer_agreement']:>13.0%}"
                if "answer_accuracy" in row
                else ""
            )
        )
    reorder = result["arrangements"].get("reorder_vllm")
    if reorder:
        lines.append(
            f"reorder_vllm: {reorder['doc_token_fraction']:.1%} of the document tokens from "
            f"kvmesh; plan {reorder['plan_ms_mean']:.1f} ms ({reorder['lookups_mean']:.0f} "
            f"lookups); against {reorder['against']}, whose TTFT is "
            f"{reorder['vllm_full_prefill_ttft_mean_ms']:.1f} ms; greedy agreement with the "
            f"reordered prompt computed cold {reorder['greedy_agreement_reordered_cold']:.1%}"
        )
    for name, why in result["not_run"].items():
        lines.append(f"{name}: not run ({why})")
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main(__doc__, add_arguments, run, format_table)
