"""The reorder plan: put a prompt's documents in the order kvmesh holds them as a prefix.

vLLM's connector API reuses only a contiguous prefix, so a RAG prompt whose
documents come in a new order reuses nothing past the first one that moved.
When the order of the documents does not matter to the application, sending
them in an order kvmesh already holds as a prefix turns them into a prefix
hit, through unmodified vLLM (docs/blend.md, "Reordering for vLLM").

:func:`plan_order` asks the gateway. For a few documents (k! orders up to
``max_exhaustive``) it looks up every order and takes the longest cached
prefix: a greedy choice can be misled when a document also starts another
stored prompt and the chunk at each document's end ties the candidates. For
more it grows the prefix one document at a time, each time choosing the
document whose placement next gives the longest cached prefix (the rest
following in their given order), and stops when none lengthens it: at most
k + (k-1) + ... + 1 lookups. Every probe is a ``Lookup`` under its own
request id whose session is ended at once, so a plan holds no locks.
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.gateway.client import GatewayClient


@dataclass(frozen=True)
class ReorderPlan:
    """The documents' order (indices into the given list) and what it finds cached."""

    order: list[int]
    #: Tokens of system + documents (in ``order``) that kvmesh holds as a prefix.
    cached_tokens: int
    #: Lookups the plan made.
    lookups: int


def plan_order(
    client: GatewayClient,
    *,
    model_name: str,
    system: Sequence[int],
    documents: Sequence[Sequence[int]],
    world_size: int = 1,
    cache_salt: str = "",
    timeout_s: float = 2.0,
    max_exhaustive: int = 24,
) -> ReorderPlan:
    """The order of ``documents`` after ``system`` with the longest prefix kvmesh holds.

    ``model_name``, ``world_size`` and ``cache_salt`` must be the connector's
    (its ``model_name`` is vLLM's ``model`` unless set). Up to
    ``max_exhaustive`` orders (4 documents: 24) every order is looked up; beyond,
    the greedy search. Raises ``ValueError`` for an empty document and
    ``grpc.RpcError`` when the gateway fails.
    """
    for i, doc in enumerate(documents):
        if not doc:
            raise ValueError(f"document {i} has no tokens")
    lookups = 0

    def cached(tokens: list[int]) -> int:
        nonlocal lookups
        lookups += 1
        request_id = f"kvmesh-reorder-{uuid.uuid4().hex}"
        resp = client.lookup(
            gateway_pb2.LookupRequest(
                request_id=request_id,
                model_name=model_name,
                world_size=world_size,
                cache_salt=cache_salt,
                token_ids=tokens,
                # L1 hits answer at once; an L2 hit is loaded meanwhile (the prompt
                # that follows wants it anyway).
                wait_timeout_ms=int(timeout_s * 500),
            ),
            timeout=timeout_s,
        )
        client.end_session(gateway_pb2.EndSessionRequest(request_id=request_id), timeout=timeout_s)
        return int(resp.status.hit_tokens)

    def joined(order: Sequence[int]) -> list[int]:
        return [*system, *(t for i in order for t in documents[i])]

    if math.factorial(len(documents)) <= max_exhaustive:
        # Every order (the given one first, so ties keep it): the longest prefix there is.
        best, order = -1, list(range(len(documents)))
        for candidate in itertools.permutations(range(len(documents))):
            hit = cached(joined(candidate))
            if hit > best:
                best, order = hit, list(candidate)
        return ReorderPlan(order=order, cached_tokens=max(best, 0), lookups=lookups)
    chosen: list[int] = []
    remaining = list(range(len(documents)))
    best = 0
    while len(remaining) > 1:
        scores = [
            (cached(joined([*chosen, d, *(r for r in remaining if r != d)])), d) for d in remaining
        ]
        top, pick = max(scores, key=lambda s: (s[0], -remaining.index(s[1])))
        if top <= best:
            break
        best = top
        chosen.append(pick)
        remaining.remove(pick)
    order = chosen + remaining
    if len(remaining) == 1 and not chosen and documents:
        best = cached(joined(order))
    return ReorderPlan(order=order, cached_tokens=best, lookups=lookups)
