"""Request sessions: each request's tokens, chunk hashes and current lookup.

A session is opened by the first call that names a request id and lives
until EndSession or until it has been idle for ``ttl_s`` (every use refreshes
it; LMCache counts from creation). Calls of one request serialise on the
session's lock. This module holds no storage: releasing what a session's
lookup holds is ``lookups``' job.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvmesh.common.errors import InvalidArgument, NotFound
from kvmesh.common.hashing import NONE_HASH, TokenHasher
from kvmesh.common.keys import worker_kv_rank


def check_token_count(count: int, max_tokens: int) -> None:
    """InvalidArgument when a prompt or segment of ``count`` tokens is over the limit."""
    if count > max_tokens:
        raise InvalidArgument(
            f"{count} tokens exceed the gateway's limit of {max_tokens}", field="token_ids"
        )


@dataclass(slots=True)
class LookupState:
    """A request's lookup: what it asked for, and the id of the lease storage holds.

    The read locks themselves are storage's alone (its lookup lease, under
    ``prefetch_id``): the gateway counts none of them.
    """

    model_name: str
    world_size: int
    cache_salt: str
    readers: int
    requested_chunks: int
    chunk_hashes: list[bytes]
    prefetch_id: str
    owner: str = ""
    completed: bool = False
    hit_chunks: int = 0
    l1_hit_chunks: int = 0
    l2_hit_chunks: int = 0
    lease_ttl_ms: int = 0
    #: The lease was ended (EndSession, a new lookup, expiry): nothing to use any more.
    ended: bool = False

    @property
    def lease_id(self) -> str:
        """The storage lease holding this lookup's locks ("" when there is none)."""
        return self.prefetch_id if self.completed and self.hit_chunks and not self.ended else ""

    def kv_ranks(self) -> list[int]:
        return [worker_kv_rank(self.world_size, r) for r in range(self.world_size)]

    def matches(self, model_name: str, world_size: int, cache_salt: str) -> bool:
        return (self.model_name, self.world_size, self.cache_salt) == (
            model_name,
            world_size,
            cache_salt,
        )


@dataclass(slots=True)
class Session:
    """One request's state between its engine calls."""

    request_id: str
    last_used: float
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint32))
    hashes: list[bytes] = field(default_factory=list)
    lookup: LookupState | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Engine-driven retrieves in flight: transaction id -> (worker id, first chunk, chunks).
    retrieves: dict[str, tuple[int, int, int]] = field(default_factory=dict)


class SessionTable:
    """Open sessions by request id, with the token and hash bookkeeping they share."""

    def __init__(
        self,
        hasher: TokenHasher,
        *,
        chunk_size: int,
        max_tokens: int,
        ttl_s: float,
        clock: Callable[[], float],
    ) -> None:
        self.hasher = hasher
        self.chunk_size = chunk_size
        self.max_tokens = max_tokens
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    # ------------------------------------------------------------------ lookup

    def open(self, request_id: str) -> Session:
        """The request's session, created if it has none (refreshes its idleness)."""
        session = self._sessions.get(request_id)
        if session is None:
            session = Session(request_id, self._clock())
            self._sessions[request_id] = session
        session.last_used = self._clock()
        return session

    def throwaway(self) -> Session:
        """A session for a call that names no request: used once, never kept."""
        return Session(f"anon-{uuid.uuid4().hex}", self._clock())

    def existing(self, request_id: str) -> Session:
        """The request's session (refreshed); NOT_FOUND when it has none."""
        session = self._sessions.get(request_id)
        if session is None:
            raise NotFound(
                f"no session for request {request_id!r} (never looked up, ended or expired)",
                reason="UNKNOWN_REQUEST",
                metadata={"request_id": request_id},
            )
        session.last_used = self._clock()
        return session

    def get(self, request_id: str) -> Session | None:
        """The request's session, if any, without refreshing it."""
        return self._sessions.get(request_id)

    def is_current(self, session: Session) -> bool:
        """Whether ``session`` is still the one open for its request."""
        return self._sessions.get(session.request_id) is session

    # ---------------------------------------------------------------- closing

    def pop(self, request_id: str) -> Session | None:
        """Remove the request's session (its locks are the caller's to release)."""
        return self._sessions.pop(request_id, None)

    def keep(self, session: Session) -> None:
        """Put back a removed session whose release failed, unless the request came back."""
        self._sessions.setdefault(session.request_id, session)

    def owned_by(self, owner: str) -> list[Session]:
        """Sessions whose lookup was made by ``owner``."""
        if not owner:
            return []
        return [s for s in self._sessions.values() if s.lookup and s.lookup.owner == owner]

    def idle(self, now: float) -> list[Session]:
        """Sessions idle for longer than the TTL at ``now``."""
        return [s for s in self._sessions.values() if now - s.last_used > self.ttl_s]

    # ---------------------------------------------------------- tokens, hashes

    def take_tokens(self, session: Session, tokens: np.ndarray) -> None:
        """Adopt the request's tokens; keep hashes when the old tokens are a prefix."""
        if tokens.size == 0:
            return
        check_token_count(tokens.size, self.max_tokens)
        old = session.tokens
        if old.size and tokens.size >= old.size and np.array_equal(tokens[: old.size], old):
            session.tokens = tokens
            return
        if old.size and tokens.size < old.size and np.array_equal(old[: tokens.size], tokens):
            return  # a shorter view of the same request (e.g. the prompt only)
        session.tokens = tokens
        session.hashes = []

    def hashes(self, session: Session, n_chunks: int) -> list[bytes]:
        """First ``n_chunks`` chunk hashes of the session's tokens (extended incrementally)."""
        have = len(session.hashes)
        if have < n_chunks:
            start = have * self.chunk_size
            prefix = session.hashes[-1] if session.hashes else NONE_HASH
            session.hashes.extend(
                self.hasher.hash_chunks(
                    session.tokens[start : n_chunks * self.chunk_size], prefix_hash=prefix
                )
            )
        return session.hashes[:n_chunks]

    def chunk_range(self, start: int, end: int, n_tokens: int | None) -> tuple[int, int]:
        """Chunks [first, last) of the token range [start, end) of a ``n_tokens`` prompt."""
        c = self.chunk_size
        if start % c or end % c:
            raise InvalidArgument(
                f"token range [{start}, {end}) is not aligned to the chunk size {c}",
                field="start_token" if start % c else "end_token",
            )
        if end < start:
            raise InvalidArgument(f"end_token {end} < start_token {start}", field="end_token")
        if n_tokens is not None and end > n_tokens:
            raise InvalidArgument(
                f"end_token {end} is beyond the request's {n_tokens} tokens", field="end_token"
            )
        return start // c, end // c
