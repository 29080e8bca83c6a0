"""Loader of the native copy kernel: ``kernels/_native/ntcopy.c`` through ctypes.

:mod:`kvmesh.kernels.ops` copies CPU chunks with this kernel when it is available
and with NumPy otherwise; both produce the same bytes. Why a C kernel at all:
a copy made of 32 KiB runs (one block of one K/V plane of one layer) through
NumPy or torch uses glibc's ``memcpy`` per run, which writes through the
cache (a read for ownership of every destination line), and one thread stops
at about half of a large ``memcpy``. The kernel writes with non-temporal
stores, several runs side by side, and reaches 0.9–1.0 of the large
``memcpy`` on one thread (``python -m kvmesh.bench.kernels``; the reasons are in
the C file).

Why ctypes and a plain shared library rather than a CPython extension: the
library has no Python headers to match, so one build serves every
interpreter; ctypes releases the GIL around every foreign call, which is what
lets :func:`kvmesh.kernels.set_copy_threads` threads copy in parallel; and the call
cost (~1-2 µs) is paid once per ~2 MiB piece.

How it is built: nothing happens at import (the CLI imports :mod:`kernels` on
every start). The first copy, or :func:`load`, looks for the library in a
per-user cache directory under a name keyed by the hash of the source, the
compiler's ``--version`` and the flags; when it is missing, it compiles it
with ``cc -O3 -shared -fPIC`` into a temporary file there and renames it into
place (atomic, so two processes compiling at once both end up with a whole
file). The library is portable across x86-64 CPUs (no ``-march=native``: the
cache may sit in a home directory shared between machines); it picks SSE2 or
AVX2 at run time.

When a copy finds the library missing it starts the compile on a background
thread and copies with NumPy meanwhile, so no request waits for a compiler.
:func:`load` waits (tests, benchmarks, or a service warming up at start-up).
Any failure (no compiler, unwritable cache, a failed self-test) logs one
warning and leaves NumPy in charge for the life of the process.

Environment:

- ``KVMESH_NATIVE_COPY``: ``0`` / ``off`` / ``false`` / ``no`` disables the
  kernel (read on every copy); ``memcpy``, ``sse2`` or ``avx2`` caps the
  instruction set (read when the library loads); unset or ``1`` / ``auto``:
  the best the CPU has.
- ``KVMESH_NATIVE_CACHE``: the cache directory (default
  ``$XDG_CACHE_HOME/kvmesh/native``, else ``~/.cache/kvmesh/native``, else
  ``<tmp>/kvmesh-native-<uid>``). It must belong to the current user and not
  be writable by others: a shared library found there is loaded into the
  process.
- ``CC``: the compiler (default: the first of ``cc``, ``gcc``, ``clang`` on
  ``PATH``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

ENV_SWITCH = "KVMESH_NATIVE_COPY"
ENV_CACHE = "KVMESH_NATIVE_CACHE"

#: Must match KVMESH_NTCOPY_ABI in ntcopy.c; part of the cache key too.
ABI_VERSION = 3

ISA_MEMCPY = 0
ISA_SSE2 = 1
ISA_AVX2 = 2
#: Names of the copy paths ``kvmesh_copy_runs`` reports, best last.
ISA_NAMES: dict[int, str] = {ISA_MEMCPY: "memcpy", ISA_SSE2: "sse2", ISA_AVX2: "avx2"}

_SOURCE = "ntcopy.c"
#: No -march=native: the library must run on any CPU of the architecture that
#: shares the cache directory; the instruction set is chosen at run time.
_CFLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11", "-fvisibility=hidden")
_COMPILE_TIMEOUT_S = 120.0
_VERSION_TIMEOUT_S = 15.0
_OFF = frozenset({"0", "off", "false", "no", "disable", "disabled"})
_AUTO = frozenset({"", "1", "on", "true", "yes", "auto"})

_lock = threading.Lock()
_native: NativeCopy | None = None
_failure: str | None = None
_compile_thread: threading.Thread | None = None


class NativeLoadError(RuntimeError):
    """Why the native kernel could not be built or loaded (logged, then NumPy copies)."""


class NativeCopy:
    """The loaded library: copies of equal-length runs with non-temporal stores.

    Thread-safe: each call works on the runs it is given and releases the GIL
    while copying.
    """

    def __init__(self, lib: ctypes.CDLL, path: Path, max_isa: int) -> None:
        abi = lib.kvmesh_ntcopy_abi
        abi.argtypes = []
        abi.restype = ctypes.c_int
        if abi() != ABI_VERSION:
            raise NativeLoadError(f"{path} has ABI {abi()}, expected {ABI_VERSION}")
        best = lib.kvmesh_ntcopy_best_isa
        best.argtypes = []
        best.restype = ctypes.c_int
        fn = lib.kvmesh_copy_runs
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int,
        ]
        fn.restype = ctypes.c_int
        #: One layer of a vLLM CPU layout to or from chunk rows, by layout ("amx", "vec").
        self._tiles: dict[str, Any] = {}
        for name in ("amx", "vec"):
            tiles = getattr(lib, f"kvmesh_{name}_tiles")
            tiles.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_void_p,
                *[ctypes.c_int64] * 7,
                ctypes.c_int,
            ]
            tiles.restype = ctypes.c_int
            self._tiles[name] = tiles
        self._lib = lib  # keeps the library mapped as long as this object lives
        self._fn = fn
        self.path = path
        #: The copy path used by default: the CPU's best, capped by KVMESH_NATIVE_COPY.
        self.isa = min(int(best()), max_isa)

    @property
    def isa_name(self) -> str:
        """Name of the default copy path (``avx2``, ``sse2`` or ``memcpy``)."""
        return ISA_NAMES.get(self.isa, str(self.isa))

    def copy_runs_at(
        self,
        src_base: int,
        dst_base: int,
        src_offsets_addr: int,
        dst_offsets_addr: int,
        n_runs: int,
        run_bytes: int,
        isa: int | None = None,
    ) -> int:
        """Copy ``n_runs`` runs given the addresses of two int64 offset arrays; unchecked.

        Run ``i`` goes from ``src_base + src_offsets[i]`` to ``dst_base +
        dst_offsets[i]``. The caller guarantees that every run lies inside
        live memory and that no destination overlaps a source or another
        destination. Returns the copy path used.
        """
        used = int(
            self._fn(
                src_base,
                dst_base,
                src_offsets_addr,
                dst_offsets_addr,
                n_runs,
                run_bytes,
                self.isa if isa is None else isa,
            )
        )
        if used < 0:
            raise ValueError(f"bad run count {n_runs} or run length {run_bytes}")
        return used

    def tiles_at(
        self,
        layout: str,
        layer: int,
        k_rows: int,
        v_rows: int,
        blocks_addr: int,
        n_blocks: int,
        n_tokens: int,
        skip_blocks: int,
        shape: tuple[int, int, int, int],
        *,
        gather: bool,
    ) -> None:
        """One layer of a vLLM CPU layout to or from a chunk's K/V rows; unchecked.

        ``layout`` is ``"amx"`` (``VLLM_CPU_AMX``) or ``"vec"`` (``VLLM_CPU``).
        ``shape`` is ``(heads, block_size, head_dim, element_size)``; the caller
        (:mod:`kvmesh.kernels.vllm_cpu`) guarantees that every block id and row
        lies inside live memory.
        """
        heads, block_size, head_dim, esize = shape
        rc = self._tiles[layout](
            layer, k_rows, v_rows, blocks_addr, n_blocks, n_tokens, skip_blocks,
            heads, block_size, head_dim, esize, int(gather),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"the tile copy does not move {esize}-byte elements")

    def copy_runs(
        self,
        src: npt.NDArray[np.uint8],
        dst: npt.NDArray[np.uint8],
        src_offsets: npt.NDArray[np.int64],
        dst_offsets: npt.NDArray[np.int64],
        run_bytes: int,
        isa: int | None = None,
    ) -> int:
        """Bounds-checked form over two byte arrays (tests and the load self-test).

        Returns the copy path used. Raises :class:`ValueError` when a run
        falls outside its array or the offsets do not pair up.
        """
        for arr, name in ((src, "src"), (dst, "dst")):
            if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous:
                raise ValueError(f"{name} must be a contiguous 1-D uint8 array")
        if not dst.flags.writeable:
            raise ValueError("dst is read-only")
        src_off = np.ascontiguousarray(src_offsets, dtype=np.int64)
        dst_off = np.ascontiguousarray(dst_offsets, dtype=np.int64)
        if src_off.shape != dst_off.shape or src_off.ndim != 1:
            raise ValueError("src_offsets and dst_offsets must be 1-D and of one length")
        if run_bytes < 0:
            raise ValueError(f"run_bytes must be >= 0, got {run_bytes}")
        for off, arr, name in ((src_off, src, "src"), (dst_off, dst, "dst")):
            if off.size and (int(off.min()) < 0 or int(off.max()) + run_bytes > arr.size):
                raise ValueError(f"a run falls outside {name}")
        return self.copy_runs_at(
            src.ctypes.data,
            dst.ctypes.data,
            src_off.ctypes.data,
            dst_off.ctypes.data,
            src_off.size,
            run_bytes,
            isa,
        )


def _switch() -> str:
    return os.environ.get(ENV_SWITCH, "").strip().lower()


def enabled() -> bool:
    """False when ``KVMESH_NATIVE_COPY`` turns the kernel off."""
    return _switch() not in _OFF


def library() -> NativeCopy | None:
    """The kernel for the copy at hand, or ``None`` to copy with NumPy; never waits long.

    The first call loads the library when it is already built (a few
    milliseconds: the compiler's ``--version`` and a ``dlopen``), or starts
    building it on a background thread and returns ``None`` until that is
    done. While another thread is loading, it returns ``None`` at once.
    """
    if not enabled():
        return None
    lib = _native
    if lib is not None or _failure is not None:
        return lib
    if not _lock.acquire(blocking=False):
        return None
    try:
        if _native is None and _failure is None and _compile_thread is None:
            _load_locked(compile_in_background=True)
        return _native
    finally:
        _lock.release()


def load(timeout: float | None = None) -> NativeCopy | None:
    """Load the kernel, compiling it if needed, and wait for it; ``None`` if unavailable.

    For start-up and tests. ``timeout`` bounds the wait for a compile already
    running on the background thread.
    """
    if not enabled():
        return None
    with _lock:
        if _native is None and _failure is None and _compile_thread is None:
            _load_locked(compile_in_background=False)
        thread = _compile_thread
    if thread is not None:
        thread.join(timeout)
    return _native


def status() -> str:
    """One line on the kernel's state (for logs and benchmark reports)."""
    if not enabled():
        return f"disabled by {ENV_SWITCH}={os.environ.get(ENV_SWITCH)}"
    lib = _native
    if lib is not None:
        return f"loaded ({lib.isa_name}) from {lib.path}"
    if _failure is not None:
        return f"unavailable: {_failure}"
    if _compile_thread is not None:
        return "compiling"
    return "not loaded yet"


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: drop a lock or a build it cannot finish."""
    global _lock, _compile_thread  # noqa: PLW0603 - module state
    _lock = threading.Lock()
    _compile_thread = None  # the child builds again if it needs to (the parent's .so is mapped)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _reset() -> None:
    """Forget the loaded library and any failure (tests only; a running compile finishes)."""
    global _native, _failure, _compile_thread  # noqa: PLW0603 - module state, tests only
    with _lock:
        _native = None
        _failure = None
        _compile_thread = None


def _load_locked(*, compile_in_background: bool) -> None:
    """Load the cached library or build it; called with ``_lock`` held."""
    global _compile_thread  # noqa: PLW0603 - one build per process
    try:
        source = _read_source()
        compiler = _compiler()
        version = _compiler_version(compiler)
        max_isa = _max_isa()
        cache = _cache_dir()
        key = hashlib.sha256(
            b"\0".join(
                [
                    source,
                    version.encode(),
                    " ".join(_CFLAGS).encode(),
                    platform.machine().encode(),
                    str(ABI_VERSION).encode(),
                ]
            )
        ).hexdigest()[:20]
        target = cache / f"ntcopy-{key}.so"
        if target.exists():
            _open(target, max_isa)
            return
    except NativeLoadError as exc:
        _fail(str(exc))
        return
    if compile_in_background:
        _compile_thread = threading.Thread(
            target=_compile_and_open,
            args=(compiler, source, cache, target, max_isa),
            name="kvmesh-native-build",
            daemon=True,
        )
        _compile_thread.start()
    else:
        try:
            _compile(compiler, source, cache, target)
            _open(target, max_isa)
        except NativeLoadError as exc:
            _fail(str(exc))


def _compile_and_open(
    compiler: list[str], source: bytes, cache: Path, target: Path, max_isa: int
) -> None:
    """The background build: compile, load, then publish the outcome under the lock."""
    global _compile_thread  # noqa: PLW0603 - one build per process
    try:
        _compile(compiler, source, cache, target)
        with _lock:
            _open(target, max_isa)
    except NativeLoadError as exc:
        with _lock:
            _fail(str(exc))
    except Exception as exc:  # a bug here must not kill the thread silently
        logger.exception("native copy kernel build crashed")
        with _lock:
            _fail(f"build crashed: {exc!r}")
    finally:
        with _lock:
            if _compile_thread is threading.current_thread():
                _compile_thread = None


def _fail(reason: str) -> None:
    global _failure  # noqa: PLW0603 - remembered for the life of the process
    _failure = reason
    logger.warning("native copy kernel unavailable, CPU copies use NumPy: %s", reason)


def _open(path: Path, max_isa: int) -> None:
    """dlopen ``path``, check it, self-test it and publish it; called with ``_lock`` held."""
    global _native  # noqa: PLW0603 - the process-wide kernel
    _check_owned(path, "library")
    try:
        lib = ctypes.CDLL(str(path))
        native = NativeCopy(lib, path, max_isa)
    except (OSError, AttributeError) as exc:
        raise NativeLoadError(f"cannot load {path}: {exc}") from exc
    _self_test(native)
    _native = native
    logger.info("native copy kernel loaded (%s) from %s", native.isa_name, path)


def _self_test(native: NativeCopy) -> None:
    """Copy odd-sized runs at odd offsets with every available path; refuse a wrong result."""
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 8192, dtype=np.uint8)
    for run_bytes in (3, 255, 1000, 1031):
        src_off = np.array([5, 2000, 4097], dtype=np.int64)
        dst_off = np.array([1, 2 * run_bytes + 70, run_bytes + 33], dtype=np.int64)
        want = np.zeros(4 * run_bytes + 200, dtype=np.uint8)
        for s, d in zip(src_off.tolist(), dst_off.tolist(), strict=True):
            want[d : d + run_bytes] = src[s : s + run_bytes]
        for isa in range(native.isa + 1):
            got = np.zeros_like(want)
            native.copy_runs(src, got, src_off, dst_off, run_bytes, isa)
            if not np.array_equal(got, want):
                raise NativeLoadError(
                    f"self-test failed ({ISA_NAMES[isa]}, {run_bytes}-byte runs) for {native.path}"
                )


def _read_source() -> bytes:
    try:
        return (Path(__file__).parent / "_native" / _SOURCE).read_bytes()
    except OSError as exc:
        raise NativeLoadError(f"source kernels/_native/{_SOURCE} not found: {exc}") from exc


def _compiler() -> list[str]:
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise NativeLoadError("no C compiler found (cc, gcc, clang; or set CC)")


def _compiler_version(compiler: list[str]) -> str:
    try:
        done = subprocess.run(
            [*compiler, "--version"],
            capture_output=True,
            text=True,
            timeout=_VERSION_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeLoadError(f"cannot run {compiler[0]} --version: {exc}") from exc
    if done.returncode != 0:
        raise NativeLoadError(f"{compiler[0]} --version exited with {done.returncode}")
    return f"{' '.join(compiler)}\n{done.stdout}"


def _max_isa() -> int:
    value = _switch()
    if value in _AUTO:
        return max(ISA_NAMES)
    for isa, name in ISA_NAMES.items():
        if value == name:
            return isa
    raise NativeLoadError(
        f"{ENV_SWITCH}={os.environ.get(ENV_SWITCH)!r} is not one of 0, 1, auto, "
        f"{', '.join(ISA_NAMES.values())}"
    )


def _cache_dir() -> Path:
    """The first usable cache directory (created 0700); see the module docstring."""
    override = os.environ.get(ENV_CACHE, "").strip()
    if override:
        candidates = [Path(override)]
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
        base = Path(xdg) if xdg else Path.home() / ".cache"
        candidates = [
            base / "kvmesh" / "native",
            Path(tempfile.gettempdir()) / f"kvmesh-native-{os.getuid()}",
        ]
    reasons = []
    for path in candidates:
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            _check_owned(path, "cache directory")
        except (OSError, NativeLoadError) as exc:
            reasons.append(str(exc))
            continue
        return path
    raise NativeLoadError("no usable cache directory: " + "; ".join(reasons))


def _check_owned(path: Path, what: str) -> None:
    """Refuse a path another user could have written: it would run code in this process."""
    try:
        st = path.stat()
    except OSError as exc:
        raise NativeLoadError(f"cannot stat {what} {path}: {exc}") from exc
    if st.st_uid != os.getuid():
        raise NativeLoadError(f"{what} {path} belongs to uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise NativeLoadError(f"{what} {path} is writable by group or others")


def _compile(compiler: list[str], source: bytes, cache: Path, target: Path) -> None:
    """Compile ``source`` into ``target``: temporary files in ``cache``, then an atomic rename."""
    tmp_paths: list[str] = []
    try:
        fd, src_path = tempfile.mkstemp(prefix=".ntcopy-", suffix=".c", dir=cache)
        tmp_paths.append(src_path)
        with os.fdopen(fd, "wb") as f:
            f.write(source)  # compile exactly the bytes that were hashed
        fd, so_path = tempfile.mkstemp(prefix=".ntcopy-", suffix=".so.tmp", dir=cache)
        os.close(fd)
        tmp_paths.append(so_path)
        cmd = [*compiler, *_CFLAGS, "-o", so_path, src_path]
        logger.info("compiling the native copy kernel: %s", " ".join(cmd))
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=_COMPILE_TIMEOUT_S,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise NativeLoadError(f"cannot run {compiler[0]}: {exc}") from exc
        if done.returncode != 0:
            first = next((ln for ln in done.stderr.splitlines() if "error" in ln), "")
            first = first or (done.stderr.strip().splitlines() or ["no output"])[0]
            raise NativeLoadError(f"{compiler[0]} exited with {done.returncode}: {first}")
        os.chmod(so_path, 0o755)
        os.replace(so_path, target)  # atomic: a concurrent build replaces it with equal bytes
        tmp_paths.remove(so_path)
    except OSError as exc:
        raise NativeLoadError(f"cannot build in {cache}: {exc}") from exc
    finally:
        for p in tmp_paths:
            try:
                os.unlink(p)
            except OSError:
                logger.debug("could not remove %s", p)
