"""Checkpoint and metadata persistence of the coordinator (docs/coordinator.md, "Persistence").

Two artifacts:

* **checkpoint** — derived state (cursors, directory, capacity, LRU order),
  captured under the QuiesceLock so it never holds half a batch, then encoded
  *outside* it and written atomically. Layout::

      b"KVMCKPT\\0"  u32-LE version (=1)  msgpack map {section_name: capture}

  msgpack is used as a plain-data codec only (never pickle): a section is
  dicts, lists, str, bytes, int, float, bool and None. The payload is
  streamed section by section (containers at depth <= 2 are written item by
  item), so a ten-million-key directory never exists as one giant bytes
  object in memory.

* **metadata** — operator intent (pins, quotas, default quota): a small JSON
  document ``{"version": 1, "saved_at": t, "components": {...}}`` rewritten
  on every change before the call returns.

Writes go to ``<path>.tmp``, are flushed and fsynced, then renamed over
``path`` (parent directories are created). A failed write removes the temp
file and keeps the previous artifact. A missing, truncated or foreign
artifact means a cold start, logged, never a crash; a section that fails to
restore is logged and skipped while the others load.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol, runtime_checkable

import msgpack  # type: ignore[import-untyped]  # ships no type information

from .quiesce import QuiesceLock
from .types import CheckpointResult

logger = logging.getLogger(__name__)

CHECKPOINT_MAGIC = b"KVMCKPT\0"
CHECKPOINT_VERSION = 1
_HEADER = struct.Struct("<8sI")
METADATA_VERSION = 1
_STREAM_DEPTH = 2
_PLAIN_LEAVES = (str, bytes, int, float, bool, type(None))


class PersistenceType(enum.Enum):
    """Which artifact a durable component belongs to."""

    CHECKPOINT = "checkpoint"
    METADATA = "metadata"


@runtime_checkable
class DurableComponent(Protocol):
    """A piece of state saved in a checkpoint or the metadata document.

    ``capture()`` returns plain data only (dict, list, tuple, str, bytes, int,
    float, bool, None) that later changes to the component cannot alter.
    The capture's dicts and lists down to two levels below the section must
    be fresh: the checkpoint writer empties them after writing (see
    ``_dispose``); deeper objects may be shared copy-on-write.
    ``restore(state)`` loads a capture; stateful sections refuse a second
    restore or a restore into a non-empty component (ValueError). A
    component may also offer ``release_capture()``, which the checkpoint
    writer calls once it no longer reads the capture (components that share
    structures copy-on-write use it to stop copying).
    """

    name: str
    persistence_type: PersistenceType

    def capture(self) -> object:
        """Plain-data copy of the state."""

    def restore(self, state: object) -> None:
        """Load a capture produced by :meth:`capture`."""


def find_non_plain(obj: object, path: str = "$") -> str | None:
    """Path of the first value that is not plain data, or None.

    Exact types are checked, so tuple subclasses (``ObjectKey``), enums and
    other domain objects are caught.
    """
    stack: list[tuple[object, str]] = [(obj, path)]
    while stack:
        cur, where = stack.pop()
        t = type(cur)
        if t in _PLAIN_LEAVES:
            continue
        if t is dict:
            assert isinstance(cur, dict)
            for k, v in cur.items():
                if type(k) not in _PLAIN_LEAVES:
                    return f"{where}.<key {k!r}>"
                if type(v) not in _PLAIN_LEAVES:
                    stack.append((v, f"{where}[{k!r}]"))
            continue
        if t is list or t is tuple:
            assert isinstance(cur, list | tuple)
            for i, v in enumerate(cur):
                if type(v) not in _PLAIN_LEAVES:
                    stack.append((v, f"{where}[{i}]"))
            continue
        return f"{where} ({t.__name__})"
    return None


def assert_plain_data(obj: object) -> None:
    """Raise TypeError naming the first non-plain value inside ``obj``."""
    where = find_non_plain(obj)
    if where is not None:
        raise TypeError(f"capture is not plain data at {where}")


class ArtifactNotFoundError(FileNotFoundError):
    """The artifact does not exist (a cold start)."""


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through ``<path>.tmp`` + fsync + rename; on error keep the old file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    # Make the rename itself durable; best effort (not every FS allows it).
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _stream_pack(obj: object, packer: msgpack.Packer, out: IO[bytes], depth: int) -> None:
    """Pack ``obj``; containers shallower than ``_STREAM_DEPTH`` are written item by item."""
    if depth <= _STREAM_DEPTH:
        if type(obj) is dict:
            assert isinstance(obj, dict)
            out.write(packer.pack_map_header(len(obj)))
            for k, v in obj.items():
                out.write(packer.pack(k))
                _stream_pack(v, packer, out, depth + 1)
            return
        if type(obj) is list or type(obj) is tuple:
            assert isinstance(obj, list | tuple)
            out.write(packer.pack_array_header(len(obj)))
            for v in obj:
                _stream_pack(v, packer, out, depth + 1)
            return
    out.write(packer.pack(obj))


def _dispose(obj: object, depth: int = 0) -> None:
    """Drop a capture piece by piece.

    A capture may hold the only references to big shards (copies made when
    writers thawed them). Freeing them in one statement would hold the GIL
    for as long as it takes to release millions of references; popping the
    capture's own containers (depth <= ``_STREAM_DEPTH``, which captures
    create fresh) frees one shard at a time, with bytecode boundaries
    between them. Deeper containers may be live state and are never touched.
    """
    if depth > _STREAM_DEPTH:
        return
    if type(obj) is dict:
        assert isinstance(obj, dict)
        while obj:
            _k, v = obj.popitem()
            _dispose(v, depth + 1)
    elif type(obj) is list:
        assert isinstance(obj, list)
        while obj:
            _dispose(obj.pop(), depth + 1)


def write_checkpoint(path: str | os.PathLike[str], sections: Mapping[str, object]) -> None:
    """Encode ``sections`` and write them atomically to ``path`` (raises on failure)."""

    def _write(fh: IO[bytes]) -> None:
        fh.write(_HEADER.pack(CHECKPOINT_MAGIC, CHECKPOINT_VERSION))
        packer = msgpack.Packer(use_bin_type=True)
        _stream_pack(dict(sections), packer, fh, 0)

    atomic_write(Path(path), _write)


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, object]:
    """Decode a checkpoint; raises ArtifactNotFoundError or ValueError (bad artifact)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError as exc:
        raise ArtifactNotFoundError(str(path)) from exc
    if len(data) < _HEADER.size:
        raise ValueError(f"truncated header ({len(data)} bytes)")
    magic, version = _HEADER.unpack_from(data)
    if magic != CHECKPOINT_MAGIC:
        raise ValueError(f"bad magic {magic!r}")
    if version != CHECKPOINT_VERSION:
        raise ValueError(f"unsupported version {version}")
    payload = memoryview(data)[_HEADER.size :]
    if not payload:
        raise ValueError("missing payload")
    try:
        sections = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:
        raise ValueError(f"malformed payload: {exc}") from exc
    if not isinstance(sections, dict) or not all(isinstance(k, str) for k in sections):
        raise ValueError("payload is not a map of section names")
    return sections


def save_checkpoint(
    path: str | os.PathLike[str],
    quiesce: QuiesceLock,
    components: Sequence[DurableComponent],
    timeout: float = 5.0,
) -> CheckpointResult:
    """Capture every component under the quiesce, then write; failures are logged, not raised."""
    names = [c.name for c in components]
    if len(set(names)) != len(names):
        logger.error("Checkpoint not written: duplicate section names in %s", names)
        return CheckpointResult(False, str(path), error="duplicate section names")
    start = time.perf_counter()
    captured_by: list[DurableComponent] = []
    sections: dict[str, object] = {}
    try:
        with quiesce.quiesced(timeout):
            for c in components:
                sections[c.name] = c.capture()
                captured_by.append(c)
        captured = time.perf_counter()
        write_checkpoint(path, sections)
    except (OSError, TimeoutError, ValueError, TypeError, OverflowError) as exc:
        logger.error("Checkpoint to %s failed: %s", path, exc)
        return CheckpointResult(
            False, str(path), duration_seconds=time.perf_counter() - start, error=str(exc)
        )
    finally:
        _dispose(sections)
        for c in captured_by:
            release = getattr(c, "release_capture", None)
            if release is not None:
                release()
    done = time.perf_counter()
    logger.info(
        "Checkpoint written to %s (capture %.1f ms, write %.1f ms)",
        path,
        (captured - start) * 1e3,
        (done - captured) * 1e3,
    )
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    return CheckpointResult(True, str(path), size, tuple(names), done - start)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a checkpoint load did.

    ``cold`` is True when nothing could be read (missing or bad artifact,
    ``reason`` says which); otherwise ``restored`` lists the sections loaded,
    ``failed`` maps each section that raised to its error, and ``absent``
    lists registered sections the artifact did not contain.
    """

    cold: bool
    reason: str = ""
    restored: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)
    absent: tuple[str, ...] = ()


def load_checkpoint(
    path: str | os.PathLike[str], components: Sequence[DurableComponent]
) -> LoadReport:
    """Restore each component from its section, in the given order, isolating failures."""
    try:
        sections = read_checkpoint(path)
    except ArtifactNotFoundError:
        logger.info("No checkpoint at %s: cold start", path)
        return LoadReport(cold=True, reason="missing")
    except (OSError, ValueError) as exc:
        logger.warning("Ignoring unreadable checkpoint %s (%s): cold start", path, exc)
        return LoadReport(cold=True, reason=str(exc))
    restored: list[str] = []
    failed: dict[str, str] = {}
    absent: list[str] = []
    for comp in components:
        if comp.name not in sections:
            absent.append(comp.name)
            continue
        try:
            comp.restore(sections[comp.name])
        except Exception as exc:
            logger.exception("Checkpoint section %s not restored", comp.name)
            failed[comp.name] = f"{type(exc).__name__}: {exc}"
        else:
            restored.append(comp.name)
    logger.info(
        "Checkpoint %s loaded: restored=%s failed=%s absent=%s", path, restored, failed, absent
    )
    return LoadReport(cold=False, restored=tuple(restored), failed=failed, absent=tuple(absent))


class MetadataStore:
    """The JSON metadata document of operator intent; a no-op when ``path`` is empty."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._path = Path(path) if path else None
        self._components: list[DurableComponent] = []
        self._wall = wall_clock
        self.save_failures = 0

    @property
    def path(self) -> Path | None:
        """Where the document lives (None: persistence disabled)."""
        return self._path

    def register(self, component: DurableComponent) -> None:
        """Add a metadata component; a checkpoint component is refused."""
        if component.persistence_type is not PersistenceType.METADATA:
            raise ValueError(
                f"component {component.name!r} holds checkpoint state; "
                "only metadata components belong in the metadata document"
            )
        if any(c.name == component.name for c in self._components):
            raise ValueError(f"duplicate metadata component {component.name!r}")
        self._components.append(component)

    def document(self) -> dict[str, object]:
        """The document as it would be saved now."""
        return {
            "version": METADATA_VERSION,
            "saved_at": self._wall(),
            "components": {c.name: c.capture() for c in self._components},
        }

    def save(self) -> bool:
        """Write the document now; False (logged, counted) when the write failed."""
        if self._path is None:
            return True
        doc = self.document()
        try:
            payload = json.dumps(doc, indent=2, sort_keys=True).encode()

            def _write(fh: IO[bytes]) -> None:
                fh.write(payload)

            atomic_write(self._path, _write)
        except (OSError, TypeError, ValueError) as exc:
            self.save_failures += 1
            logger.error("Metadata save to %s failed: %s", self._path, exc)
            return False
        return True

    def load(self) -> bool:
        """Restore every registered component from the document; False when ignored."""
        if self._path is None:
            return False
        try:
            doc = json.loads(self._path.read_text())
        except FileNotFoundError:
            logger.info("No metadata document at %s", self._path)
            return False
        except (OSError, ValueError) as exc:
            logger.warning("Ignoring unreadable metadata document %s: %s", self._path, exc)
            return False
        problem = _metadata_problem(doc)
        if problem is not None:
            logger.warning("Ignoring metadata document %s: %s", self._path, problem)
            return False
        sections = doc["components"]
        for comp in self._components:
            if comp.name not in sections:
                continue
            try:
                comp.restore(sections[comp.name])
            except Exception:
                logger.exception("Metadata section %s not restored", comp.name)
        return True


def _metadata_problem(doc: object) -> str | None:
    if not isinstance(doc, dict):
        return "not a JSON object"
    if doc.get("version") != METADATA_VERSION:
        return f"unsupported version {doc.get('version')!r}"
    if not isinstance(doc.get("components"), dict):
        return "no components object"
    saved_at = doc.get("saved_at")
    if isinstance(saved_at, bool) or not isinstance(saved_at, int | float):
        return "saved_at is not a number"
    return None


def checkpoint_components(
    components: Iterable[DurableComponent],
) -> list[DurableComponent]:
    """Keep only checkpoint-type components (order preserved)."""
    return [c for c in components if c.persistence_type is PersistenceType.CHECKPOINT]
