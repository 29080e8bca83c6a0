"""The texts of ``kvmesh bench blend``: made-up towns on rivers, and questions about them.

N short English documents (seeded), each naming its town's river in its first
sentence; M prompts of the system prompt, k of the documents in a random order
and a question about one of them, in SmolLM2's chat format; and a primer, one
more document about a town that no prompt asks for (its river is none of the
corpus's), which the benchmark computes each document after.
"""

from __future__ import annotations

import argparse
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_TOWNS = [
    "Arvel", "Brisk", "Calder", "Dunmore", "Elsby", "Fenwick",
    "Garrow", "Holm", "Ivesly", "Jarrow", "Kelby", "Lorne",
]  # fmt: skip
_RIVERS = ["Tam", "Oise", "Lune", "Ribble", "Wear", "Tees", "Nidd", "Aire", "Esk", "Ure", "Swale"]
_BUILT = ["school", "bridge", "market", "church", "library", "station", "mill", "theatre"]
_NEAR = ["square", "harbour", "river", "hill", "park", "station"]
_TRADES = ["weavers", "millers", "smiths", "fishers", "masons", "brewers"]


@dataclass
class Corpus:
    """The benchmark's texts, tokenized."""

    system: list[int]
    documents: list[list[int]]
    #: A document about a town no prompt asks for, that each document's K/V is computed
    #: after (docs/blend.md, "Computing documents for reuse").
    primer: list[int]
    towns: list[str]
    rivers: list[str]


@dataclass
class Tokenizer:
    """The model's tokenizer, as two functions (no special tokens added)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


def document_text(rng: random.Random, town: str, river: str, sentences: int) -> str:
    text = [
        f"{town} is a town on the river {river}, with {rng.randrange(1000, 90000)} people.",
        f"It was founded in {rng.randrange(900, 1800)} by a family of {rng.choice(_TRADES)}.",
    ]
    for _ in range(max(0, sentences - 2)):
        text.append(
            f"In {rng.randrange(1800, 2020)} {town} built a new {rng.choice(_BUILT)} "
            f"near the {rng.choice(_NEAR)}."
        )
    return f"Document: {town}.\n" + " ".join(text) + "\n\n"


def load_tokenizer(folder: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return Tokenizer(
        encode=lambda text: list(tokenizer.encode(text, add_special_tokens=False)),
        decode=lambda tokens: str(tokenizer.decode(tokens)),
    )


def first_river(text: str) -> str | None:
    """The river of ``_RIVERS`` that ``text`` names first (a whole word), or None."""
    found = re.search(r"\b(" + "|".join(_RIVERS) + r")\b", text)
    return found.group(1) if found else None


def make_corpus(encode: Callable[[str], list[int]], args: argparse.Namespace) -> Corpus:
    rng = random.Random(args.seed)
    towns = [
        _TOWNS[i % len(_TOWNS)] + (str(i) if i >= len(_TOWNS) else "")
        for i in range(args.documents)
    ]
    rivers = [rng.choice(_RIVERS) for _ in towns]
    system = encode(
        "<|im_start|>system\nYou are a helpful assistant. Answer the question from the "
        "documents.<|im_end|>\n<|im_start|>user\n"
    )
    texts = [
        document_text(rng, town, river, args.sentences)
        for town, river in zip(towns, rivers, strict=True)
    ]
    # Its own generator, so the corpus and the prompts stay those of earlier runs.
    primer = document_text(random.Random(args.seed + 2), "Marlow", "Humber", args.sentences)
    return Corpus(system, [encode(text) for text in texts], encode(primer), towns, rivers)


def make_prompts(
    corpus: Corpus, encode: Callable[[str], list[int]], args: argparse.Namespace
) -> tuple[list[tuple[list[list[int]], list[int]]], list[str]]:
    """(documents in the prompt's order, question tokens) of each prompt, and the
    river each question asks for."""
    rng = random.Random(args.seed + 1)
    prompts, answers = [], []
    for _ in range(args.prompts):
        order = rng.sample(range(args.documents), args.docs_per_prompt)
        asked = rng.choice(order)
        question = encode(
            f"Question: on which river is {corpus.towns[asked]}?<|im_end|>\n<|im_start|>assistant\n"
        )
        prompts.append(([corpus.documents[i] for i in order], question))
        answers.append(corpus.rivers[asked])
    return prompts, answers
