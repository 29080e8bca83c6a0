"""Score engines for a prompt: how much of its prefix each could use, and from where.

Per engine, the prompt's complete chunks are walked in order; each chunk
counts once, in the best tier it is in for that engine:

1. ``engine`` — the engine's own KV cache (from its vLLM KV events);
2. ``local_l1`` — L1 of the kvmesh node the engine's connector uses;
3. ``peer_l1`` — L1 of another node (a P2P fetch);
4. ``l2`` — an L2 tier.

The walk stops at the first chunk held nowhere (a prefix cache can only use
a prefix). The score is the sum of matched tokens times the tier's weight.
A kvmesh chunk counts only when every kv rank of ``world_size`` is held. See
docs/routing.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.events import Tier
from kvmesh.common.hashing import TokenHasher
from kvmesh.common.keys import ObjectKey, validate_cache_salt, validate_model_name, worker_kv_rank

from .directory import KeyDirectory
from .engines import Engines, EngineSpec
from .tokens import MAX_TOKEN_IDS, validate_world_size

MAX_CHUNK_HASHES = 100_000
MAX_ENGINES = 1024
HASH_BYTES = 32


@dataclass(frozen=True, slots=True)
class TierWeights:
    """Weight of a matched token, per tier (defaults favour the cheapest to use)."""

    engine: float = 1.0
    local_l1: float = 0.8
    peer_l1: float = 0.6
    l2: float = 0.4

    def __post_init__(self) -> None:
        for name in ("engine", "local_l1", "peer_l1", "l2"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise InvalidArgument(f"weight {name} must be a finite number >= 0", field=name)


@dataclass(frozen=True, slots=True)
class EngineScore:
    """One engine's matched prefix by tier, and its score."""

    engine_id: str
    engine_tokens: int = 0
    local_l1_tokens: int = 0
    peer_l1_tokens: int = 0
    l2_tokens: int = 0
    score: float = 0.0
    known: bool = True
    synced: bool = True

    @property
    def prefix_tokens(self) -> int:
        return self.engine_tokens + self.local_l1_tokens + self.peer_l1_tokens + self.l2_tokens


@dataclass(frozen=True, slots=True)
class ScoreResult:
    chunks: int
    chunk_size: int
    scores: tuple[EngineScore, ...]


#: Chunks looked up in the directory at a time (the walk usually stops early).
_LOOKUP_SLICE = 8


def prompt_hashes(
    hasher: TokenHasher,
    token_ids: Sequence[int] | np.ndarray,
    chunk_hashes: Sequence[bytes],
) -> list[bytes]:
    """The prompt's chunk hashes, from exactly one of tokens or hashes."""
    if len(token_ids) and len(chunk_hashes):
        raise InvalidArgument("give token_ids or chunk_hashes, not both", field="token_ids")
    if len(chunk_hashes):
        if len(chunk_hashes) > MAX_CHUNK_HASHES:
            raise InvalidArgument(
                f"at most {MAX_CHUNK_HASHES} chunk hashes, got {len(chunk_hashes)}",
                field="chunk_hashes",
            )
        for i, h in enumerate(chunk_hashes):
            if len(h) != HASH_BYTES:
                raise InvalidArgument(
                    f"chunk_hashes[{i}] has {len(h)} bytes, expected {HASH_BYTES}",
                    field="chunk_hashes",
                )
        return list(chunk_hashes)
    if not len(token_ids):
        raise InvalidArgument("give token_ids or chunk_hashes", field="token_ids")
    if len(token_ids) > MAX_TOKEN_IDS:
        raise InvalidArgument(
            f"at most {MAX_TOKEN_IDS} token ids per request, got {len(token_ids)}",
            field="token_ids",
        )
    return hasher.hash_chunks(token_ids)


def score_engines(
    engines: Engines,
    directory: KeyDirectory,
    hashes: list[bytes],
    *,
    chunk_size: int,
    model_name: str,
    cache_salt: str,
    world_size: int,
    engine_ids: Sequence[str],
    weights: TierWeights,
) -> ScoreResult:
    """Score ``engine_ids`` (every followed engine when empty), best first."""
    validate_model_name(model_name)
    validate_cache_salt(cache_salt)
    validate_world_size(world_size)
    if len(engine_ids) > MAX_ENGINES:
        raise InvalidArgument(f"at most {MAX_ENGINES} engines", field="engine_ids")
    if any(not e for e in engine_ids):
        raise InvalidArgument("an engine id is empty", field="engine_ids")
    names = list(dict.fromkeys(engine_ids)) or [s.engine_id for s in engines.specs()]
    specs = {name: engines.spec(name) for name in names}
    leads = {
        name: engines.index.leading_held(name, range(spec.data_parallel_size), cache_salt, hashes)
        if spec is not None and spec.model_name == model_name
        else 0
        for name, spec in specs.items()
    }
    holders = _KvmeshHolders(directory, hashes, model_name, cache_salt, world_size)
    scores = [
        _score_one(engines, specs[name], name, leads[name], holders, chunk_size, weights)
        for name in names
    ]
    scores.sort(key=lambda s: (-s.score, -s.prefix_tokens, s.engine_id))
    return ScoreResult(len(hashes), chunk_size, tuple(scores))


class _KvmeshHolders:
    """Where kvmesh holds each chunk of the prompt, looked up a slice at a time on demand.

    Per chunk: the nodes holding it in L1 for every kv rank (any object
    group), and whether L2 holds every rank. Engines walk from the end of
    their own prefix, so only the slices some walk reaches are looked up.
    """

    def __init__(
        self, directory: KeyDirectory, hashes: list[bytes], model: str, salt: str, world_size: int
    ) -> None:
        self.directory = directory
        self.hashes = hashes
        self.model = model
        self.salt = salt
        self.ranks = [worker_kv_rank(world_size, r) for r in range(world_size)]
        self._l1: dict[int, frozenset[str]] = {}
        self._l2: dict[int, bool] = {}

    def tier(self, chunk: int, instance_id: str) -> int:
        """1 local L1, 2 peer L1, 3 L2, 0 none (also past the prompt's end)."""
        if chunk >= len(self.hashes):
            return 0
        if chunk not in self._l1:
            self._look_up(chunk - chunk % _LOOKUP_SLICE)
        nodes = self._l1[chunk]
        if instance_id and instance_id in nodes:
            return 1
        if nodes:
            return 2
        return 3 if self._l2[chunk] else 0

    def _look_up(self, first: int) -> None:
        part = self.hashes[first : first + _LOOKUP_SLICE]
        ranks = self.ranks
        keys = [ObjectKey(h, self.model, rank, 0, self.salt) for h in part for rank in ranks]
        groups = self.directory.get_keys_across_object_groups(keys)
        infos = self.directory.lookup([k for ks in groups for k in ks], with_tokens=False)
        pos = 0
        for i in range(len(part)):
            nodes: set[str] | None = None
            in_l2 = True
            for key_groups in groups[i * len(ranks) : (i + 1) * len(ranks)]:
                placements = [
                    p for info in infos[pos : pos + len(key_groups)] for p in info.placements
                ]
                pos += len(key_groups)
                rank_nodes = {p.instance_id for p in placements if p.tier == Tier.L1}
                nodes = rank_nodes if nodes is None else nodes & rank_nodes
                in_l2 = in_l2 and any(p.tier == Tier.L2 for p in placements)
            self._l1[first + i] = frozenset(nodes or ())
            self._l2[first + i] = in_l2


def _score_one(
    engines: Engines,
    spec: EngineSpec | None,
    engine_id: str,
    lead: int,
    holders: _KvmeshHolders,
    chunk_size: int,
    weights: TierWeights,
) -> EngineScore:
    if spec is None:
        return EngineScore(engine_id, known=False, synced=False)
    tokens = [lead * chunk_size, 0, 0, 0]
    chunk = lead
    while tier := holders.tier(chunk, spec.instance_id):
        tokens[tier] += chunk_size
        chunk += 1
    score = (
        tokens[0] * weights.engine
        + tokens[1] * weights.local_l1
        + tokens[2] * weights.peer_l1
        + tokens[3] * weights.l2
    )
    return EngineScore(
        engine_id,
        engine_tokens=tokens[0],
        local_l1_tokens=tokens[1],
        peer_l1_tokens=tokens[2],
        l2_tokens=tokens[3],
        score=score,
        synced=engines.synced(engine_id),
    )
