"""The routing benchmark's prompts: groups of requests sharing a long prefix.

Each group has a prefix of ``prefix_tokens`` random token ids and
``requests_per_group`` requests, each the prefix and a suffix of its own.
Requests are sent first-of-each-group first (in a shuffled group order),
then every other request in a shuffled order. The order comes from the seed
alone, so every router sees the same pattern; the tokens come from the seed
and the router's name, so no router finds another's prefixes in a cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

#: Token ids are drawn from [MARGIN, vocab_size - MARGIN): no special tokens.
MARGIN = 100


@dataclass(frozen=True)
class Shape:
    """Sizes of the workload."""

    groups: int
    prefix_tokens: int
    requests_per_group: int
    suffix_tokens: int
    vocab_size: int
    seed: int

    @property
    def requests(self) -> int:
        return self.groups * self.requests_per_group

    @property
    def prompt_tokens(self) -> int:
        """Tokens of one prompt."""
        return self.prefix_tokens + self.suffix_tokens

    def reusable_tokens(self, chunk_size: int) -> int:
        """Prefix tokens, in whole chunks, of every request after its group's first.

        What a router could find cached at best, and what the oracle aims at.
        """
        whole = self.prefix_tokens // chunk_size * chunk_size
        return self.groups * (self.requests_per_group - 1) * whole


@dataclass(frozen=True)
class Request:
    """One request: its group and its prompt's token ids."""

    group: int
    prompt: list[int]


def _tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(MARGIN, vocab_size - MARGIN) for _ in range(count)]


def requests(shape: Shape, router: str) -> list[Request]:
    """The requests of one router's run, in the order they are sent."""
    order_rng = random.Random(shape.seed)
    firsts = list(range(shape.groups))
    order_rng.shuffle(firsts)
    rest = [(g, r) for g in range(shape.groups) for r in range(1, shape.requests_per_group)]
    order_rng.shuffle(rest)
    token_rng = random.Random(f"kvmesh-bench-route:{shape.seed}:{router}")
    prefixes = [_tokens(token_rng, shape.prefix_tokens, shape.vocab_size) for _ in firsts]
    suffixes = {
        (g, r): _tokens(token_rng, shape.suffix_tokens, shape.vocab_size)
        for g in range(shape.groups)
        for r in range(shape.requests_per_group)
    }
    order = [(g, 0) for g in firsts] + rest
    return [Request(g, prefixes[g] + suffixes[(g, r)]) for g, r in order]


def warmup_prompt(shape: Shape, engine: int) -> list[int]:
    """A prompt of an engine's first request, which shares nothing with any router's."""
    rng = random.Random(f"kvmesh-bench-route:{shape.seed}:warm-up:{engine}")
    return _tokens(rng, shape.prompt_tokens, shape.vocab_size)
