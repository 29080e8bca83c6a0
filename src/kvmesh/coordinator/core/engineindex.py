"""Which kvmesh chunks each engine's own KV cache holds, from its vLLM KV events.

An engine reports blocks of ``block_size`` tokens, chained by parent hash,
with their token ids (docs/routing.md). The index keeps each stream's block
tree and turns it into kvmesh keys: a chunk of ``chunk_size`` tokens is
hashed with kvmesh's chained blake3 (the same as the gateway's) from the
tokens of the blocks that cover it, so an engine's blocks and kvmesh's
chunks of one prefix get the same key, whatever hash seed the engine uses.

A chunk is *held* while every block covering it is present. Blocks remember
the chunk hashes ending inside them even after an ancestor goes (a fact about
the tokens), so a re-stored ancestor does not need its descendants re-sent.

Streams are keyed by ``(engine_id, data_parallel_rank)``. Sequence handling
(incarnations, gaps, replays) belongs to the caller; the index only offers
:meth:`EngineIndex.reset_stream` for it. Thread safety: one lock around
every method; scoring reads take it too.

Every record is a tuple of atomic values (ints, bytes, str, None) and every
table a dict of them, so CPython's cyclic GC untracks them all: sixteen
engines' worth of blocks add nothing to a full collection (as mutable
per-block objects they made one take over 100 ms).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import blake3

from kvmesh.common.hashing import NONE_HASH, tokens_to_be_u32
from kvmesh.common.keys import salt_with_lora

from .engineevents import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EngineEvent
from .engineevents import chain_salt as event_chain_salt

#: The medium a BlockStored/BlockRemoved without one is filed under.
DEFAULT_MEDIUM = "GPU"

#: A held chunk inside one stream: (cache salt with LoRA, kvmesh chunk hash).
ChunkKey = tuple[str, bytes]


class _Block(NamedTuple):
    parent: BlockHash | None
    #: Token position just past this block.
    end: int
    #: This block's tokens as big-endian uint32 (the bytes kvmesh hashes).
    raw: bytes
    #: The chain's salt (with LoRA); None when the chain cannot be matched.
    salt: str | None
    #: The media holding it, one bit each (EngineIndex._medium_bit).
    media: int
    #: (boundary, chunk hash) of every chunk ending inside this block.
    chunks: tuple[tuple[int, bytes], ...] = ()
    #: Bit i set: ``chunks[i]`` is held now.
    held: int = 0


@dataclass(frozen=True, slots=True)
class StreamCounts:
    """What one stream holds now."""

    blocks: int
    chunks: int


class _Stream:
    __slots__ = ("blocks", "children", "chunks")

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, _Block] = {}
        self.children: dict[BlockHash, tuple[BlockHash, ...]] = {}
        self.chunks: dict[ChunkKey, int] = {}


class EngineIndex:
    """Per engine stream: its block tree and the kvmesh chunks it holds."""

    def __init__(self, chunk_size: int) -> None:
        if chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        self.chunk_size = chunk_size
        self._lock = threading.Lock()
        self._streams: dict[tuple[str, int], _Stream] = {}
        #: Events skipped because the index cannot use them (kept for status).
        self.skipped_events = 0
        self._media: dict[str, int] = {}

    def _medium_bit(self, medium: str | None) -> int:
        name = medium or DEFAULT_MEDIUM
        bit = self._media.get(name)
        if bit is None:
            if len(self._media) >= 62:
                name = "(other)"  # an engine naming more media than that: lumped together
                bit = self._media.setdefault(name, 1 << len(self._media))
            else:
                bit = self._media[name] = 1 << len(self._media)
        return bit

    # -- streams -----------------------------------------------------------

    def reset_stream(self, engine_id: str, rank: int) -> None:
        """Forget everything a stream reported (a restart, a clear, an unrepaired gap)."""
        with self._lock:
            self._streams[(engine_id, rank)] = _Stream()

    def drop_engine(self, engine_id: str) -> None:
        """Forget every stream of an engine."""
        with self._lock:
            for sid in [s for s in self._streams if s[0] == engine_id]:
                del self._streams[sid]

    def counts(self, engine_id: str, rank: int) -> StreamCounts:
        """Blocks and held chunks of one stream (zeros when unknown)."""
        with self._lock:
            stream = self._streams.get((engine_id, rank))
            if stream is None:
                return StreamCounts(0, 0)
            return StreamCounts(len(stream.blocks), len(stream.chunks))

    # -- events ------------------------------------------------------------

    def apply(self, engine_id: str, rank: int, events: Iterable[EngineEvent]) -> None:
        """Apply one batch's events to a stream, in order."""
        with self._lock:
            stream = self._streams.setdefault((engine_id, rank), _Stream())
            for event in events:
                if isinstance(event, BlockStored):
                    self._stored(stream, event)
                elif isinstance(event, BlockRemoved):
                    self._removed(stream, event)
                elif isinstance(event, AllBlocksCleared):
                    stream = self._streams[(engine_id, rank)] = _Stream()

    def _stored(self, stream: _Stream, event: BlockStored) -> None:
        bs = event.block_size
        if event.group_idx not in (None, 0) or len(event.token_ids) != bs * len(event.block_hashes):
            # Another KV cache group (hybrid models), or tokens that do not cover the blocks.
            self.skipped_events += 1
            return
        medium = self._medium_bit(event.medium)
        parent = event.parent
        salt: str | None
        if parent is None:
            end = 0
            salt = event_chain_salt(event, 0)
            if salt is not None:
                salt = salt_with_lora(salt, event.lora_name, event.lora_id)
        else:
            above = stream.blocks.get(parent)
            if above is None:
                # The parent was never seen (or is gone): this block's position is unknown.
                self.skipped_events += 1
                return
            end, salt = above.end, above.salt
        raw = tokens_to_be_u32(event.token_ids)
        step = bs * 4
        for i, block_hash in enumerate(event.block_hashes):
            end += bs
            if (i > 0 or event.parent is not None) and not _plain_extra(event, i):
                salt = None  # multimodal or embedded input: tokens alone do not name it
            block = stream.blocks.get(block_hash)
            if block is None:
                block = _Block(parent, end, raw[i * step : (i + 1) * step], salt, medium)
                stream.blocks[block_hash] = block
                if parent is not None:
                    stream.children[parent] = (*stream.children.get(parent, ()), block_hash)
                if salt is not None:
                    self._complete_chunks(stream, block_hash)
                    self._rehold_below(stream, block_hash, block)
            else:
                stream.blocks[block_hash] = block._replace(media=block.media | medium)
            parent = block_hash

    def _complete_chunks(self, stream: _Stream, block_hash: BlockHash) -> None:
        """Hash (once) and hold every chunk that ends inside a block and is covered."""
        block = stream.blocks[block_hash]
        c = self.chunk_size
        if not block.chunks:
            first = (_start(block) // c + 1) * c
            for boundary in range(first, block.end + 1, c):
                # The next chunk's hash chains from this one: keep the block current.
                chunk_hash = self._chunk_hash(stream, block, boundary)
                if chunk_hash is None:
                    break
                block = block._replace(chunks=(*block.chunks, (boundary, chunk_hash)))
            if not block.chunks:
                return
        held = block.held
        for i, (boundary, chunk_hash) in enumerate(block.chunks):
            if not held & (1 << i) and self._covered(stream, block, boundary):
                held |= 1 << i
                key = (block.salt or "", chunk_hash)
                stream.chunks[key] = stream.chunks.get(key, 0) + 1
        stream.blocks[block_hash] = block._replace(held=held)

    def _rehold_below(self, stream: _Stream, block_hash: BlockHash, block: _Block) -> None:
        """A block came (back): descendants whose chunks needed it may be whole again."""
        reach = block.end + self.chunk_size
        frontier = list(stream.children.get(block_hash, ()))
        while frontier:
            child_hash = frontier.pop()
            child = stream.blocks.get(child_hash)
            if child is None or _start(child) >= reach:
                continue
            if child.salt is not None:
                self._complete_chunks(stream, child_hash)
            frontier.extend(stream.children.get(child_hash, ()))

    def _chunk_hash(self, stream: _Stream, block: _Block, boundary: int) -> bytes | None:
        """kvmesh's hash of the chunk ending at ``boundary``, from the chain above ``block``.

        None when a block on the way, or the previous chunk's hash, is unknown.
        """
        lo = boundary - self.chunk_size
        pieces: list[bytes] = []
        node = block
        while True:
            start = _start(node)
            a, b = max(lo, start) - start, min(boundary, node.end) - start
            if b > a:
                pieces.append(node.raw[a * 4 : b * 4])
            if start <= lo:
                break
            above = stream.blocks.get(node.parent) if node.parent is not None else None
            if above is None:
                return None
            node = above
        # ``node`` covers position ``lo``: the previous chunk ends inside it, or
        # exactly at its start (then inside its parent).
        if lo == 0:
            prev: bytes | None = NONE_HASH
        else:
            holder: _Block | None = node
            if _start(node) == lo:
                holder = stream.blocks.get(node.parent) if node.parent is not None else None
            prev = (
                None if holder is None else next((h for at, h in holder.chunks if at == lo), None)
            )
        if prev is None:
            return None
        return blake3.blake3(prev + b"".join(reversed(pieces))).digest()

    def _covered(self, stream: _Stream, block: _Block, boundary: int) -> bool:
        """Whether every block covering the chunk that ends at ``boundary`` is present."""
        lo = boundary - self.chunk_size
        node = block
        while _start(node) > lo:
            above = stream.blocks.get(node.parent) if node.parent is not None else None
            if above is None:
                return False
            node = above
        return True

    def _removed(self, stream: _Stream, event: BlockRemoved) -> None:
        if event.group_idx not in (None, 0):
            return
        medium = self._medium_bit(event.medium)
        for block_hash in event.block_hashes:
            block = stream.blocks.get(block_hash)
            if block is None:
                continue
            if block.media & ~medium:
                stream.blocks[block_hash] = block._replace(media=block.media & ~medium)
                continue
            self._release(stream, block_hash, block)

    def _release(self, stream: _Stream, block_hash: BlockHash, block: _Block) -> None:
        """Drop a block: un-hold every chunk that needed it, here and below."""
        c = self.chunk_size
        self._unhold(stream, block_hash, lambda boundary: True)
        # Descendants whose chunks reach back into this block.
        frontier = list(stream.children.get(block_hash, ()))
        while frontier:
            child_hash = frontier.pop()
            child = stream.blocks.get(child_hash)
            if child is None or _start(child) >= block.end + c:
                continue
            self._unhold(stream, child_hash, lambda boundary: boundary - c < block.end)
            frontier.extend(stream.children.get(child_hash, ()))
        del stream.blocks[block_hash]
        if block.parent is not None:
            siblings = tuple(h for h in stream.children.get(block.parent, ()) if h != block_hash)
            if siblings:
                stream.children[block.parent] = siblings
            else:
                stream.children.pop(block.parent, None)

    @staticmethod
    def _unhold(stream: _Stream, block_hash: BlockHash, which: Callable[[int], bool]) -> None:
        block = stream.blocks[block_hash]
        held = block.held
        for i, (boundary, chunk_hash) in enumerate(block.chunks):
            if held & (1 << i) and which(boundary):
                held &= ~(1 << i)
                key = (block.salt or "", chunk_hash)
                left = stream.chunks.get(key, 0) - 1
                if left > 0:
                    stream.chunks[key] = left
                else:
                    stream.chunks.pop(key, None)
        if held != block.held:
            stream.blocks[block_hash] = block._replace(held=held)

    # -- reads -------------------------------------------------------------

    def leading_held(
        self, engine_id: str, ranks: Iterable[int], salt: str, chunk_hashes: Sequence[bytes]
    ) -> int:
        """How many leading chunks of a prompt any of the engine's streams holds.

        Only a leading run counts: vLLM's prefix cache stops at its first miss.
        """
        with self._lock:
            held = [s.chunks for r in ranks if (s := self._streams.get((engine_id, r))) is not None]
            count = 0
            if len(held) == 1:
                chunks = held[0]
                for h in chunk_hashes:
                    if (salt, h) not in chunks:
                        break
                    count += 1
                return count
            for h in chunk_hashes:
                key = (salt, h)
                if not any(key in chunks for chunks in held):
                    break
                count += 1
            return count


def _plain_extra(event: BlockStored, index: int) -> bool:
    """Whether block ``index``'s extra keys are only its LoRA name and salt (no multimodal)."""
    if event.extra_keys is None or index >= len(event.extra_keys):
        return True
    keys = event.extra_keys[index]
    return keys is None or all(isinstance(k, str) for k in keys)


def _start(block: _Block) -> int:
    """Token position of a block's first token."""
    return block.end - len(block.raw) // 4
