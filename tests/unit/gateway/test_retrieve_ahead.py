"""Loads the scheduler starts ahead (RetrieveAhead) and the worker's Retrieve that joins them.

The rule under test: one copy per load, and never a copy that starts after the
worker asked for the load (it could write blocks the engine already uses).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from kvmesh.common.errors import FailedPrecondition, InvalidArgument
from kvmesh.gateway.core import EngineSpec, Gateway, PromptRangeSpec
from kvmesh.gateway.core.ahead import AheadLoads, load_key
from kvmesh.gateway.core.node_storage import KeyRow
from tests.unit.gateway.test_gateway_core import BLOCK, CHUNK, MODEL, FakeStorage, tokens


class GatedStorage(FakeStorage):
    """Counts retrieve copies; a copy waits for ``gate`` when it is cleared."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: Exception | None = None

    async def retrieve_chunks(
        self,
        engine_id: str,
        row: KeyRow,
        block_ids: Sequence[int],
        chunk_tokens: int,
        skip_first_n_tokens: int,
        lease_id: str,
        producer_event: bytes = b"",
        layers: tuple[int, int] | None = None,
    ) -> int:
        self.copies += 1
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return await super().retrieve_chunks(
            engine_id, row, block_ids, chunk_tokens, skip_first_n_tokens, lease_id,
            producer_event, layers,
        )  # fmt: skip


async def setup(host_memory: bool = True) -> tuple[Gateway, GatedStorage, np.ndarray]:
    storage = GatedStorage()
    gw = Gateway(storage, chunk_size=CHUNK)  # type: ignore[arg-type]
    spec = EngineSpec("e0", MODEL, 1, 0, BLOCK)
    await gw.register_kv_cache(spec, object(), "fp", num_layers=2, host_memory=host_memory)
    toks = tokens(4 * CHUNK)
    await gw.store("e0", PromptRangeSpec("s", MODEL, 1, "", toks, 0, 4 * CHUNK), list(range(16)))
    await gw.lookup("r", MODEL, 1, "", toks, 0, 1, 0)
    return gw, storage, toks


def load(toks: np.ndarray, request_id: str = "r") -> PromptRangeSpec:
    return PromptRangeSpec(request_id, MODEL, 1, "", toks, 0, 4 * CHUNK)


BLOCKS = list(range(100, 116))


def test_the_worker_joins_the_copy_started_ahead() -> None:
    async def main() -> None:
        gw, storage, toks = await setup()
        storage.gate.clear()
        assert await gw.retrieve_ahead("e0", load(toks), BLOCKS, 0) is True
        await asyncio.sleep(0)
        worker = asyncio.ensure_future(gw.retrieve("e0", load(toks), BLOCKS, 0))
        await asyncio.sleep(0.01)
        assert not worker.done()  # it waits for the copy under way
        storage.gate.set()
        assert await worker == 4
        assert storage.copies == 1
        assert storage.held() == 0  # the lookup's locks were used up once
        stats = gw.counters
        assert (stats.retrieves_ahead, stats.retrieves_joined, stats.retrieves) == (1, 1, 1)
        assert stats.retrieved_chunks == 4
        # A repeat after the worker asked starts nothing.
        assert await gw.retrieve_ahead("e0", load(toks), BLOCKS, 0) is False
        assert storage.copies == 1

    asyncio.run(main())


def test_an_ahead_call_after_the_worker_asked_starts_nothing() -> None:
    async def main() -> None:
        gw, storage, toks = await setup()
        assert await gw.retrieve("e0", load(toks), BLOCKS, 0) == 4
        assert await gw.retrieve_ahead("e0", load(toks), BLOCKS, 0) is False
        assert storage.copies == 1
        assert gw.counters.retrieves_ahead_refused == 1

    asyncio.run(main())


@pytest.mark.parametrize("worker_first", [True, False])
def test_whichever_call_plans_first_decides_and_the_load_is_copied_once(
    worker_first: bool,
) -> None:
    """Both wait for the session's lock. The worker's Retrieve first: it tombstones the
    load before the ahead call checks, copies itself, and the ahead call starts nothing.
    The ahead call first: it starts the copy and the worker's Retrieve joins it."""

    async def main() -> None:
        gw, storage, toks = await setup()
        session = gw.sessions.get("r")
        assert session is not None
        await session.lock.acquire()
        calls = {
            "worker": lambda: gw.retrieve("e0", load(toks), BLOCKS, 0),
            "ahead": lambda: gw.retrieve_ahead("e0", load(toks), BLOCKS, 0),
        }
        tasks = {}
        for name in ("worker", "ahead") if worker_first else ("ahead", "worker"):
            tasks[name] = asyncio.ensure_future(calls[name]())
            await asyncio.sleep(0.01)  # queued on the lock in this order
        session.lock.release()
        worker, ahead = tasks["worker"], tasks["ahead"]
        assert await ahead is (not worker_first)
        assert await worker == 4
        assert storage.copies == 1
        assert gw.counters.retrieves_ahead_refused == int(worker_first)
        assert gw.counters.retrieves_joined == int(not worker_first)

    asyncio.run(main())


def test_a_second_ahead_call_for_the_same_load_starts_nothing() -> None:
    async def main() -> None:
        gw, storage, toks = await setup()
        storage.gate.clear()
        assert await gw.retrieve_ahead("e0", load(toks), BLOCKS, 0) is True
        assert await gw.retrieve_ahead("e0", load(toks), BLOCKS, 0) is False
        storage.gate.set()
        assert await gw.retrieve("e0", load(toks), BLOCKS, 0) == 4
        assert storage.copies == 1

    asyncio.run(main())


def test_a_different_load_is_not_joined() -> None:
    """Other block ids (the request was preempted and came back) copy anew."""

    async def main() -> None:
        gw, storage, toks = await setup()
        assert await gw.retrieve_ahead("e0", load(toks), BLOCKS, 0) is True
        await asyncio.sleep(0.01)
        other = [b + 100 for b in BLOCKS]
        await gw.retrieve("e0", load(toks), other, 0)
        assert storage.copies == 2
        assert gw.counters.retrieves_joined == 0

    asyncio.run(main())


def test_a_failed_ahead_copy_fails_the_worker_retrieve_with_its_error() -> None:
    async def main() -> None:
        gw, storage, toks = await setup()
        storage.fail = FailedPrecondition("engine memory went away")
        assert await gw.retrieve_ahead("e0", load(toks), BLOCKS, 0) is True
        with pytest.raises(FailedPrecondition, match="went away"):
            await gw.retrieve("e0", load(toks), BLOCKS, 0)
        assert storage.copies == 1

    asyncio.run(main())


def test_gpu_memory_is_never_written_ahead() -> None:
    async def main() -> None:
        gw, storage, toks = await setup(host_memory=False)
        assert await gw.retrieve_ahead("e0", load(toks), BLOCKS, 0) is False
        assert storage.copies == 0
        assert await gw.retrieve("e0", load(toks), BLOCKS, 0) == 4

    asyncio.run(main())


def test_bad_ahead_calls_fail_as_retrieve_does_and_start_nothing() -> None:
    async def main() -> None:
        gw, storage, toks = await setup()
        with pytest.raises(FailedPrecondition):
            await gw.retrieve_ahead("nobody", load(toks), BLOCKS, 0)
        with pytest.raises(InvalidArgument, match="block ids"):
            await gw.retrieve_ahead("e0", load(toks), BLOCKS[:3], 0)
        with pytest.raises(InvalidArgument, match="skip_first_n_tokens"):
            await gw.retrieve_ahead("e0", load(toks), BLOCKS, 5 * CHUNK)
        assert storage.copies == 0
        assert len(gw.transfers.ahead) == 0
        # The worker's own Retrieve is unaffected.
        assert await gw.retrieve("e0", load(toks), BLOCKS, 0) == 4

    asyncio.run(main())


def test_an_unjoined_ahead_load_is_dropped_with_its_session() -> None:
    async def main() -> None:
        gw, _, toks = await setup()
        assert await gw.retrieve_ahead("e0", load(toks), BLOCKS, 0) is True
        assert len(gw.transfers.ahead) == 1
        await gw.end_session("r")
        assert len(gw.transfers.ahead) == 0

    asyncio.run(main())


def test_a_load_by_layers_waits_for_an_ahead_copy_of_the_same_load() -> None:
    async def main() -> None:
        gw, storage, toks = await setup()
        storage.gate.clear()
        assert await gw.retrieve_ahead("e0", load(toks), BLOCKS, 0) is True
        part = asyncio.ensure_future(gw.retrieve("e0", load(toks), BLOCKS, 0, layers=(0, 1)))
        await asyncio.sleep(0.01)
        assert not part.done()
        assert storage.copies == 1
        storage.gate.set()
        await part
        assert storage.copies == 2  # the part's own copy, after the ahead one ended

    asyncio.run(main())


def test_the_key_names_every_field_that_decides_what_a_load_writes() -> None:
    toks = tokens(4 * CHUNK)
    base = load(toks)
    chain = [bytes([i]) * 16 for i in range(4)]
    key = load_key("e0", base, BLOCKS, 0, chain)
    variants = [
        load_key("e1", base, BLOCKS, 0, chain),
        load_key("e0", load(toks, "r2"), BLOCKS, 0, chain),
        load_key("e0", base, BLOCKS[::-1], 0, chain),
        load_key("e0", base, BLOCKS, BLOCK, chain),
        load_key("e0", base, BLOCKS, 0, [*chain[:3], b"x" * 16]),  # other tokens
        load_key("e0", base, BLOCKS, 0, chain[1:]),
        load_key(
            "e0", PromptRangeSpec("r", MODEL, 1, "salt", toks, 0, 4 * CHUNK), BLOCKS, 0, chain
        ),
        load_key(
            "e0", PromptRangeSpec("r", MODEL, 1, "", toks, CHUNK, 4 * CHUNK), BLOCKS, 0, chain
        ),
    ]
    assert key == load_key("e0", load(toks.copy()), list(BLOCKS), 0, list(chain))
    assert len({key, *variants}) == len(variants) + 1


def test_another_prompt_under_the_same_request_id_is_not_joined() -> None:
    """The chunk hashes stand for the tokens: an ahead load of other tokens is not the
    worker's load (the gateway's session refuses changed tokens for one request anyway)."""

    async def main() -> None:
        gw, storage, toks = await setup()
        assert await gw.retrieve_ahead("e0", load(toks), BLOCKS, 0) is True
        await asyncio.sleep(0.01)
        await gw.end_session("r")
        other = tokens(4 * CHUNK, seed=7)
        await gw.retrieve("e0", load(other), BLOCKS, 0)
        assert gw.counters.retrieves_joined == 0
        assert storage.copies == 2

    asyncio.run(main())


def test_tombstones_outlive_any_ahead_call_and_then_expire() -> None:
    now = [0.0]
    loads = AheadLoads(keep_s=10.0, clock=lambda: now[0])
    assert loads.claim(b"k") is None
    now[0] = 9.0
    assert loads.may_start(b"k") is False
    now[0] = 10.5
    assert loads.may_start(b"k") is True
