"""What the scheduler half of the connector keeps about one request between its hooks.

See docs/connector.md, "Scheduler flow".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.connector.metadata import Request


@dataclass
class RequestState:
    """Scheduler-side bookkeeping of one request."""

    request: Request
    lookup_deadline: float
    lookup_sent: bool = False
    #: Chunk-aligned tokens kvmesh holds (None until the lookup finished).
    hit_tokens: int | None = None
    l1_hit_chunks: int = 0
    l2_hit_chunks: int = 0
    #: The engine's own prefix-cache hit when matched (vLLM: num_computed_tokens).
    local_hit_tokens: int = 0
    num_external_tokens: int = 0
    load_pending: bool = False
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    stored_tokens: int = 0
    stores_emitted: bool = False
    #: Complete chunks the engine's own prefix cache held when kvmesh was not asked
    #: (every complete chunk of the prompt was in it): they are not stored again.
    own_chunk_tokens: int = 0
    #: The step (the scheduler's count of planned steps) of the request's last allocation.
    allocated_in_step: int = -1
    #: Its load could not be planned: the blocks it was to fill are recomputed, and
    #: this step's tokens, computed over them, are not stored.
    load_dropped: bool = False
    #: Its blocks hold KV from before a cache reset: nothing is stored until the engine
    #: allocates it anew (resumes it).
    stale: bool = False

    def forget_lookup(self, deadline: float) -> None:
        """After a cache reset: look the request up again (by ``deadline``), and store
        nothing of it until the engine allocates it anew."""
        self.lookup_sent = False
        self.hit_tokens = None
        self.lookup_deadline = deadline
        self.l1_hit_chunks = self.l2_hit_chunks = 0
        self.own_chunk_tokens = 0
        self.load_pending = False
        self.stale = True
