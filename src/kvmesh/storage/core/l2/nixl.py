"""L2 on files whose payload bytes are moved by a NIXL agent (POSIX, GDS, ...).

The file format, the atomic temp-file-then-rename write, the start-up scan
that deletes temp files and invalid objects, the index and the capacity
bound are the disk adapter's (:mod:`kvmesh.storage.core.l2.disk`): only the
payload transfer differs. For each object the adapter registers the host
buffer (DRAM) and the file range (FILE, by descriptor) with the agent, posts
one WRITE or READ transfer and polls it to completion under
``op_timeout_s``; the header and trailer are small and written with
``pwrite``. So a NIXL store is readable by a disk adapter and vice versa.

``nixl_cu12`` is imported when an adapter is built, never at module import,
so the rest of kvmesh runs without it.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import uuid
from typing import Any

import numpy as np

from kvmesh.common.errors import InvalidArgument
from kvmesh.storage.core.l2.base import L2Unavailable
from kvmesh.storage.core.l2.disk import DiskL2Adapter

logger = logging.getLogger(__name__)

# Poll backoff while a transfer is in progress: spin briefly, then sleep up to 1 ms
# so a slow device does not burn a core.
_POLL_MAX_SLEEP_S = 0.001


def _load_nixl() -> Any:
    try:
        from nixl_cu12 import _api
    except ImportError as exc:
        raise L2Unavailable(
            "the nixl L2 adapter needs the nixl-cu12 package (pip install 'kvmesh[nixl]')",
            reason="L2_BACKEND_MISSING",
        ) from exc
    return _api


class NixlL2Adapter(DiskL2Adapter):
    """Disk-format L2 objects under ``base_path`` whose payloads move through NIXL.

    ``backend`` names the NIXL plugin (POSIX works on any host; GDS / GDS_MT
    need a GPU and a supporting filesystem) and ``backend_params`` its
    string options.
    """

    backend = "nixl"

    def __init__(
        self,
        base_path: str | os.PathLike[str],
        backend: str = "POSIX",
        *,
        backend_params: dict[str, str] | None = None,
        capacity_bytes: int = 0,
        fsync: bool = True,
        verify_checksum: bool = True,
        op_timeout_s: float = 30.0,
        agent_name: str | None = None,
        shared: bool = False,
    ) -> None:
        if op_timeout_s <= 0:
            raise InvalidArgument("op_timeout_s must be > 0", field="op_timeout_s")
        api = _load_nixl()
        self.nixl_backend = backend
        self._op_timeout_s = op_timeout_s
        name = agent_name or f"kvmesh-l2-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            # Store and prefetch controller threads share the agent.
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        try:
            agent = api.nixl_agent(name, config)
            if backend not in agent.get_plugin_list():
                raise InvalidArgument(
                    f"NIXL plugin {backend!r} is not available; have {agent.get_plugin_list()}",
                    field="backend",
                )
            agent.create_backend(backend, dict(backend_params or {}))
        except InvalidArgument:
            raise
        except Exception as exc:  # the bindings raise their own exception types
            raise L2Unavailable(f"cannot start NIXL backend {backend}: {exc}") from exc
        mem_types = agent.get_backend_mem_types(backend)
        if "FILE_SEG" not in mem_types or "DRAM_SEG" not in mem_types:
            raise InvalidArgument(
                f"NIXL backend {backend!r} cannot move DRAM to files (supports {mem_types})",
                field="backend",
            )
        self._agent: Any = agent
        super().__init__(
            base_path,
            capacity_bytes,
            fsync,
            verify_checksum=verify_checksum,
            shared=shared,
        )

    def _write_payload(self, fd: int, offset: int, payload: memoryview) -> None:
        self._transfer("WRITE", fd, offset, payload)

    def _read_payload(self, fd: int, offset: int, out: memoryview) -> None:
        self._transfer("READ", fd, offset, out)

    def _transfer(self, op: str, fd: int, offset: int, buf: memoryview) -> None:
        """Move ``buf`` to (WRITE) or from (READ) ``fd`` at ``offset`` through the agent."""
        size = buf.nbytes
        if size == 0:
            return
        agent = self._agent
        nixl_backends = [self.nixl_backend]
        # Registration needs an address; numpy gives one for read-only buffers too.
        addr = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
        try:
            dram = agent.register_memory([(addr, size, 0, "")], "DRAM", backends=nixl_backends)
        except Exception as exc:
            raise OSError(errno.EIO, f"NIXL register DRAM failed: {exc}") from exc
        try:
            file_reg = agent.register_memory(
                [(offset, size, fd, "")], "FILE", backends=nixl_backends
            )
            try:
                handle = agent.initialize_xfer(
                    op,
                    agent.get_xfer_descs([(addr, size, 0)], "DRAM"),
                    agent.get_xfer_descs([(offset, size, fd)], "FILE"),
                    agent.name,
                    backends=nixl_backends,
                )
                try:
                    self._wait(handle, agent.transfer(handle), op)
                finally:
                    _release(handle)
            finally:
                agent.deregister_memory(file_reg, backends=nixl_backends)
        except (OSError, L2Unavailable):
            raise
        except Exception as exc:
            raise OSError(errno.EIO, f"NIXL {op} failed: {exc}") from exc
        finally:
            agent.deregister_memory(dram, backends=nixl_backends)

    def _wait(self, handle: Any, state: str, op: str) -> None:
        deadline = time.monotonic() + self._op_timeout_s
        pause = 0.0
        while state == "PROC":
            if time.monotonic() > deadline:
                raise L2Unavailable(
                    f"NIXL {op} did not finish within {self._op_timeout_s} s",
                    reason="L2_TIMEOUT",
                )
            time.sleep(pause)
            pause = min(_POLL_MAX_SLEEP_S, pause * 2 + 1e-5)
            state = self._agent.check_xfer_state(handle)
        if state != "DONE":
            raise OSError(errno.EIO, f"NIXL {op} ended in state {state}")

    def close(self) -> None:
        """Release the directory lock and drop the agent; the files stay."""
        super().close()
        self._agent = None


def _release(handle: Any) -> None:
    """Release a transfer handle; releasing one still in flight aborts it and may raise."""
    try:
        handle.release()
    except Exception:
        logger.warning("NIXL transfer handle release failed", exc_info=True)
