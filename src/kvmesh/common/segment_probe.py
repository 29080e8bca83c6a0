"""Finding CacheBlend segments inside a prompt by their first tokens (docs/blend.md).

A segment is stored under a key of its tokens alone, so a prompt that
contains it does not name it. Both the storage node's catalog and the
coordinator's fleet index find segments the same way, which lives here:
the prompt is probed at every ``stride``-th position; at each, the raw bytes
of the next :data:`SEGMENT_FINGERPRINT_TOKENS` tokens name the candidate
lengths (longest first), and the caller says which candidate is really there
and usable. Matches never overlap: after one, probing resumes at the next
position on the stride past its end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from kvmesh.common.errors import InvalidArgument
from kvmesh.common.hashing import tokens_to_be_u32

#: Tokens at a segment's start that index it; shorter segments are not found.
SEGMENT_FINGERPRINT_TOKENS = 16
#: Longest prompt one probe walks.
MAX_PROMPT_TOKENS = 1 << 20


def fingerprint(tokens: np.ndarray) -> bytes:
    """The index key of a segment starting with ``tokens`` (at least 16 uint32s)."""
    return tokens_to_be_u32(tokens[:SEGMENT_FINGERPRINT_TOKENS])


def probe(
    prompt: np.ndarray,
    stride: int,
    lengths_at: Callable[[bytes], Iterable[int]],
    accept: Callable[[int, int], bool],
) -> tuple[list[tuple[int, int]], int]:
    """Non-overlapping segments in ``prompt``: ``([(start, length)], positions probed)``.

    ``lengths_at(fingerprint)`` gives the candidate lengths at a position
    (longest first); ``accept(start, length)`` says whether that segment is the
    one there (its key checked) and usable. ``stride`` 0 is read as 1.
    """
    if prompt.size > MAX_PROMPT_TOKENS:
        raise InvalidArgument(
            f"at most {MAX_PROMPT_TOKENS} tokens per probe, got {prompt.size}", field="token_ids"
        )
    step = max(1, stride)
    raw = tokens_to_be_u32(prompt)
    width = 4 * SEGMENT_FINGERPRINT_TOKENS
    matches: list[tuple[int, int]] = []
    probed = at = 0
    while at + SEGMENT_FINGERPRINT_TOKENS <= prompt.size:
        probed += 1
        found = 0
        for length in lengths_at(raw[4 * at : 4 * at + width]):
            if at + length <= prompt.size and accept(at, length):
                found = length
                break
        if found:
            matches.append((at, found))
            at += found
            at += -at % step  # the next probe position on the stride
        else:
            at += step
    return matches, probed
