"""Which peer a P2P fetch asks: the longest prefix held, ties by a rendezvous hash.

Concurrent askers of one prefix agree on a peer (the score depends only on
the instance and the prefix's first chunk), and different prefixes spread
over the instances that hold them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvmesh.common.keys import ObjectKey
from kvmesh.storage.core.peer.ports import PeerTarget


def rendezvous(instance_id: str, chunk_hash: bytes) -> int:
    """Rendezvous (highest random weight) score of a peer for a prefix."""
    digest = hashlib.blake2b(instance_id.encode() + b"\0" + chunk_hash, digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick_peer(
    rows: Sequence[Sequence[ObjectKey]],
    holders: Sequence[frozenset[str]],
    peers: dict[str, PeerTarget],
    self_id: str,
) -> tuple[PeerTarget | None, int]:
    """The peer with the longest prefix held in every row (ties: rendezvous hash).

    ``holders`` is row-major (one entry per key of ``rows``). Returns the peer
    and its prefix in columns, or ``(None, 0)``.
    """
    height = len(rows)
    width = len(rows[0]) if rows else 0
    best: tuple[int, int, PeerTarget] | None = None
    candidates = {i for h in holders for i in h if i != self_id and i in peers}
    for instance in sorted(candidates):
        prefix = 0
        for c in range(width):
            if all(instance in holders[r * width + c] for r in range(height)):
                prefix = c + 1
            else:
                break
        if prefix == 0:
            continue
        score = (prefix, rendezvous(instance, rows[0][0].chunk_hash))
        if best is None or score > best[:2]:
            best = (*score, peers[instance])
    return (best[2], best[0]) if best else (None, 0)
