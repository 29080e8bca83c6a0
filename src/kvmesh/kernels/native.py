"""Loader of the native copy kernel (``kernels/_native/*.c``, one library) through ctypes.

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
library has no Python to call back into; ctypes releases the GIL around every
foreign call, which is what lets :func:`kvmesh.kernels.set_copy_threads`
threads copy in parallel; and the call cost (~1-2 µs) is paid once per
~2 MiB piece.

How it is built: with the package. ``setup.py`` compiles the C file into
``kvmesh/kernels/_ntcopy<suffix>.so`` when kvmesh is installed (a wheel
carries it; ``pip install -e .`` builds it in the source tree). Nothing is
compiled at run time, and no compiler is needed where kvmesh runs. The
library is portable across x86-64 CPUs (no ``-march=native``); it picks SSE2
or AVX2 at run time, and :data:`ENV_SWITCH` can cap that choice.

The first copy (or :func:`load`, which a storage node calls at start-up)
opens the library and self-tests it: a ``dlopen`` and a few small copies,
well under a millisecond. When it is missing (installed where the build had
no C compiler) or fails its self-test, one warning is logged and NumPy copies
for the life of the process, at about half the speed (``kvmesh bench
datapath`` measures both).

Environment:

- ``KVMESH_NATIVE_COPY``: ``0`` / ``off`` / ``false`` / ``no`` disables the
  kernel (read on every copy); ``memcpy``, ``sse2`` or ``avx2`` caps the
  instruction set (read when the library loads); unset or ``1`` / ``auto``:
  the best the CPU has.
- ``KVMESH_NATIVE_LIBRARY``: open this library instead of the one installed
  with the package (a kernel built by hand; it must belong to the current
  user and not be writable by others, since it is loaded into the process).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import stat
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

ENV_SWITCH = "KVMESH_NATIVE_COPY"
ENV_LIBRARY = "KVMESH_NATIVE_LIBRARY"

#: Must match KVMESH_NTCOPY_ABI in ntcopy.c.
ABI_VERSION = 5

ISA_MEMCPY = 0
ISA_SSE2 = 1
ISA_AVX2 = 2
#: Names of the copy paths ``kvmesh_copy_runs`` reports, best last.
ISA_NAMES: dict[int, str] = {ISA_MEMCPY: "memcpy", ISA_SSE2: "sse2", ISA_AVX2: "avx2"}

#: The extension's name inside the package (setup.py builds it).
_MODULE = "_ntcopy"
_OFF = frozenset({"0", "off", "false", "no", "disable", "disabled"})
_AUTO = frozenset({"", "1", "on", "true", "yes", "auto"})

_lock = threading.Lock()
_native: NativeCopy | None = None
_failure: str | None = None


class NativeLoadError(RuntimeError):
    """Why the native kernel could not be loaded (logged, then NumPy copies)."""


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
        batch = lib.kvmesh_tiles_batch
        batch.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int64,
            *[ctypes.c_int64] * 4,
            ctypes.c_int,
        ]
        batch.restype = ctypes.c_int
        self._tiles_batch = batch
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

    def tiles_batch(
        self,
        layout: str,
        items: npt.NDArray[np.int64],
        shape: tuple[int, int, int, int],
        *,
        gather: bool,
    ) -> None:
        """Layers of a vLLM CPU layout to or from chunks' K/V rows, many in one call; unchecked.

        ``layout`` is ``"amx"`` (``VLLM_CPU_AMX``) or ``"vec"`` (``VLLM_CPU``);
        ``shape`` is ``(heads, block_size, head_dim, element_size)``. ``items``
        is a C-contiguous ``[n, 7]`` int64 array, one row per (chunk, layer):
        ``(layer, k_rows, v_rows, blocks_addr, n_blocks, n_tokens,
        skip_blocks)``, the first four addresses. The caller
        (:mod:`kvmesh.kernels.vllm_cpu`) guarantees that every block id and row
        lies inside live memory. The GIL is released once for the whole batch.
        """
        heads, block_size, head_dim, esize = shape
        rc = self._tiles_batch(
            0 if layout == "amx" else 1, items.ctypes.data, items.shape[0],
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
    """The kernel for the copy at hand, or ``None`` to copy with NumPy.

    The first call opens the library (well under a millisecond); later calls
    return what that found.
    """
    if not enabled():
        return None
    lib = _native
    if lib is not None or _failure is not None:
        return lib
    return load()


def load() -> NativeCopy | None:
    """Open and self-test the kernel once; ``None`` if unavailable (logged once)."""
    if not enabled():
        return None
    with _lock:
        if _native is None and _failure is None:
            try:
                _open(_library_path(), _max_isa())
            except NativeLoadError as exc:
                _fail(str(exc))
    return _native


def installed_path() -> Path | None:
    """The library installed with the package, or None when the build made none."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"{_MODULE}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def status() -> str:
    """One line on the kernel's state (for logs and benchmark reports)."""
    if not enabled():
        return f"disabled by {ENV_SWITCH}={os.environ.get(ENV_SWITCH)}"
    lib = _native
    if lib is not None:
        return f"loaded ({lib.isa_name}) from {lib.path}"
    if _failure is not None:
        return f"unavailable: {_failure}"
    return "not loaded yet"


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: a lock held elsewhere is dropped."""
    global _lock  # noqa: PLW0603 - module state
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _reset() -> None:
    """Forget the loaded library and any failure (tests only)."""
    global _native, _failure  # noqa: PLW0603 - module state, tests only
    with _lock:
        _native = None
        _failure = None


def _library_path() -> Path:
    override = os.environ.get(ENV_LIBRARY, "").strip()
    if override:
        path = Path(override)
        if not path.is_file():
            raise NativeLoadError(f"{ENV_LIBRARY}={override}: no such file")
        _check_owned(path, "library")
        return path
    installed = installed_path()
    if installed is None:
        raise NativeLoadError(
            f"kvmesh/kernels/{_MODULE}*.so was not built with this install (no C compiler "
            "when kvmesh was installed?); reinstall kvmesh where gcc or clang is present"
        )
    return installed


def _fail(reason: str) -> None:
    global _failure  # noqa: PLW0603 - remembered for the life of the process
    _failure = reason
    logger.warning("native copy kernel unavailable, CPU copies use NumPy: %s", reason)


def _open(path: Path, max_isa: int) -> None:
    """dlopen ``path``, check it, self-test it and publish it; called with ``_lock`` held."""
    global _native  # noqa: PLW0603 - the process-wide kernel
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
