"""The reorder plan's choices against a gateway that holds some prompts' prefixes.

The gateway here is a stand-in that answers ``Lookup`` with the longest
whole-chunk prefix of the prompt that some stored prompt shares (what the
real gateway answers for L1 hits); the plan through real vLLM and a real
node is tests/e2e/with_vllm/test_vllm_reorder.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import pytest

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.connector.reorder import plan_order
from kvmesh.gateway.client import GatewayClient

CHUNK = 4
SYSTEM = [1, 2, 3]
DOCS = [[10 + i] * 5 for i in range(4)]  # 5 tokens each: chunks straddle documents


class HoldingGateway:
    def __init__(self, stored: Sequence[Sequence[int]]) -> None:
        self.stored = [list(s) for s in stored]
        self.open: set[str] = set()
        self.lookups: list[gateway_pb2.LookupRequest] = []

    def lookup(self, request: gateway_pb2.LookupRequest, **_: Any) -> gateway_pb2.LookupResponse:
        self.lookups.append(request)
        self.open.add(request.request_id)
        tokens = list(request.token_ids)
        best = 0
        for prompt in self.stored:
            n = 0
            while n + CHUNK <= min(len(tokens), len(prompt)) and (
                tokens[n : n + CHUNK] == prompt[n : n + CHUNK]
            ):
                n += CHUNK
            best = max(best, n)
        status = gateway_pb2.PrefetchStatus(completed=True, hit_tokens=best)
        return gateway_pb2.LookupResponse(status=status)

    def end_session(
        self, request: gateway_pb2.EndSessionRequest, **_: Any
    ) -> gateway_pb2.EndSessionResponse:
        self.open.discard(request.request_id)
        return gateway_pb2.EndSessionResponse(existed=True)


def _plan(gateway: HoldingGateway, docs: Sequence[Sequence[int]], **options: Any) -> Any:
    client = cast(GatewayClient, gateway)
    return plan_order(
        client, model_name="m", system=SYSTEM, documents=docs, cache_salt="s", **options
    )


GREEDY = {"max_exhaustive": 1}


def _prompt(*order: int) -> list[int]:
    return SYSTEM + [t for i in order for t in DOCS[i]]


@pytest.mark.parametrize(("options", "most"), [({}, 24), (GREEDY, 4 + 3 + 2)])
def test_documents_go_back_in_the_stored_order_and_no_session_stays_open(
    options: dict[str, int], most: int
) -> None:
    gateway = HoldingGateway([[*_prompt(0, 1, 2, 3), 99]])
    given = [DOCS[2], DOCS[0], DOCS[3], DOCS[1]]
    plan = _plan(gateway, given, **options)
    assert [given[i] for i in plan.order] == [DOCS[0], DOCS[1], DOCS[2], DOCS[3]]
    assert plan.cached_tokens == len(_prompt(0, 1, 2, 3)) // CHUNK * CHUNK
    assert plan.lookups == len(gateway.lookups) <= most
    assert gateway.open == set()
    assert {(r.model_name, r.cache_salt, r.world_size) for r in gateway.lookups} == {("m", "s", 1)}


@pytest.mark.parametrize("options", [{}, GREEDY])
def test_a_partly_stored_order_is_followed_as_far_as_it_goes(options: dict[str, int]) -> None:
    gateway = HoldingGateway([[*_prompt(3, 1), 99]])
    plan = _plan(gateway, DOCS, **options)
    assert plan.order[:2] == [3, 1]
    assert sorted(plan.order) == [0, 1, 2, 3]
    assert plan.order[2:] == [0, 2]  # the rest keep their given order


def test_nothing_stored_keeps_the_given_order() -> None:
    gateway = HoldingGateway([])
    plan = _plan(gateway, DOCS)
    assert (plan.order, plan.cached_tokens, plan.lookups) == ([0, 1, 2, 3], 0, 24)
    greedy = _plan(gateway, DOCS, **GREEDY)
    assert (greedy.order, greedy.lookups) == ([0, 1, 2, 3], 4)  # one round, then it stops


def test_every_order_is_tried_where_a_greedy_choice_is_misled() -> None:
    """Documents 0 and 1 both start a stored prompt; only 1, 2, 0 is stored whole."""
    gateway = HoldingGateway([[*_prompt(0, 3), 99], [*_prompt(1, 2, 0), 99]])
    docs = DOCS[:3]
    plan = _plan(gateway, docs)
    assert plan.order == [1, 2, 0]
    assert plan.cached_tokens == len(_prompt(1, 2, 0)) // CHUNK * CHUNK
    greedy = _plan(gateway, docs, **GREEDY)  # a tie at the first document: the given order
    assert greedy.order[0] == 0
    assert greedy.cached_tokens < plan.cached_tokens


def test_one_document_and_none() -> None:
    gateway = HoldingGateway([_prompt(0)])
    assert _plan(gateway, [DOCS[0]]).order == [0]
    assert _plan(gateway, [DOCS[0]]).cached_tokens == len(_prompt(0)) // CHUNK * CHUNK
    assert _plan(gateway, []).order == []


def test_an_empty_document_is_refused() -> None:
    with pytest.raises(ValueError, match="document 1 has no tokens"):
        _plan(HoldingGateway([]), [DOCS[0], []])
