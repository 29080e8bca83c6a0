"""The native non-temporal copy kernel: same bytes as the reference, and a safe fallback.

Three groups:

- the ops on the native path (and on the NumPy path it falls back to) against
  the reference over the grids of ``test_kernels_ops``, plus block-sized rows
  on several threads with each instruction set;
- the C function itself on odd sizes, unaligned offsets, runs shorter than a
  vector and run counts that are not a multiple of the streams it interleaves;
- the loader: the kernel was built with the package and opens without a
  compiler, nothing is loaded at import, and the fallbacks (switched off, an
  install without the kernel, a foreign or unsafe library).

An installed kvmesh must load the kernel: a missing one fails, never skips.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import kvmesh.kernels.ops
from kvmesh.kernels import (
    KVLayoutKind,
    gather_chunks,
    native,
    ref_gather_chunks,
    ref_scatter_chunks,
    scatter_chunks,
    set_copy_threads,
)
from tests.unit.kernels.test_kernels_ops import (
    BLOCK_SIZES,
    CHUNK_CASES,
    DTYPES,
    LAYOUTS,
    SKIPS,
    STORAGE,
    batch,
    make_cache,
    random_chunks,
    restore,
    skip_tokens,
    snapshot,
)

REPO_ROOT = Path(__file__).resolve().parents[3]

#: The layouts the native kernel copies (VLLM_CPU's transposed K is copied by torch views).
ROW_LAYOUTS = [kind for kind in LAYOUTS if kind is not KVLayoutKind.VLLM_CPU]
GRID = list(itertools.product(ROW_LAYOUTS, DTYPES, BLOCK_SIZES, CHUNK_CASES))
#: "native": the C kernel at the CPU's best instruction set; "numpy": the fallback.
BACKENDS = ["native", "numpy"]
#: Run lengths around the vector widths (16, 32), a line (64), the kernel's
#: memcpy cut-off (256) and a page; and a 32 KiB block plus a tail.
RUN_LENGTHS = [1, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 255, 256, 257, 1000, 4097, 32768 + 5]
RUN_COUNTS = [0, 1, 3, 4, 5, 9]


class CountingKernel:
    """Delegates to the real kernel, forcing one instruction set and counting calls."""

    def __init__(self, kernel: native.NativeCopy, isa: int | None = None) -> None:
        self.kernel = kernel
        self.isa = kernel.isa if isa is None else isa
        self.calls = 0

    def copy_runs_at(self, *args: int, isa: int | None = None) -> int:
        self.calls += 1
        return self.kernel.copy_runs_at(*args, isa=self.isa)


@pytest.fixture(scope="module")
def kernel() -> native.NativeCopy:
    """The loaded kernel (built with the package)."""
    if not native.enabled():
        pytest.skip(f"{native.ENV_SWITCH} disables the native kernel")
    loaded = native.load()
    if loaded is None:
        pytest.fail(f"native kernel did not load: {native.status()}")
    return loaded


def isas(kernel: native.NativeCopy) -> list[int]:
    """Every copy path this CPU can run, memcpy included."""
    return list(range(kernel.isa + 1))


@pytest.fixture
def use_backend(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> CountingKernel | None:
    """Route the ops to one backend; the native one through a counting wrapper."""
    backend = request.param
    if backend == "numpy":
        monkeypatch.setattr(kvmesh.kernels.ops, "_CPU_BACKEND", "numpy")
        return None
    counting = CountingKernel(request.getfixturevalue("kernel"))
    monkeypatch.setattr(kvmesh.kernels.ops, "_CPU_BACKEND", "native")
    monkeypatch.setattr(native, "library", lambda: counting)
    return counting


def assert_used(counting: CountingKernel | None) -> None:
    if counting is not None:
        assert counting.calls > 0, "the copy did not go through the native kernel"


# ---- the ops over the grids -----------------------------------------------------------------


@pytest.mark.parametrize("use_backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize(("kind", "dtype", "block_size", "chunk_case"), GRID)
def test_gather_matches_reference(
    kind: KVLayoutKind,
    dtype: torch.dtype,
    block_size: int,
    chunk_case: tuple[int, int],
    storage: str,
    use_backend: CountingKernel | None,
) -> None:
    kv = make_cache(kind, dtype, block_size, "cpu", storage)
    ids, tokens = batch(kv, *chunk_case)
    before = snapshot(kv)
    outs = [torch.full(kv.chunk_shape(n), 7.0, dtype=dtype) for n in tokens]
    expected = [torch.zeros_like(o) for o in outs]

    gather_chunks(kv, ids, outs)
    ref_gather_chunks(kv, ids, expected)

    assert all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(kv.layers, before, strict=True))
    assert_used(use_backend)


@pytest.mark.parametrize("use_backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("skip", SKIPS)
@pytest.mark.parametrize(("kind", "dtype", "block_size", "chunk_case"), GRID)
def test_scatter_matches_reference(
    kind: KVLayoutKind,
    dtype: torch.dtype,
    block_size: int,
    chunk_case: tuple[int, int],
    skip: str,
    storage: str,
    use_backend: CountingKernel | None,
) -> None:
    kv = make_cache(kind, dtype, block_size, "cpu", storage)
    ids, tokens = batch(kv, *chunk_case)
    srcs = random_chunks(kv, tokens, "cpu")
    src_copies = [s.clone() for s in srcs]
    n_skip = skip_tokens(skip, kv, tokens)
    before = snapshot(kv)

    ref_scatter_chunks(kv, ids, srcs, skip_first_n_tokens=n_skip)
    expected = snapshot(kv)
    restore(kv, before)
    scatter_chunks(kv, ids, srcs, skip_first_n_tokens=n_skip)

    assert all(torch.equal(a, b) for a, b in zip(kv.layers, expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(srcs, src_copies, strict=True))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("kind", ROW_LAYOUTS)
def test_block_sized_runs_on_every_instruction_set_and_thread_count(
    kind: KVLayoutKind,
    storage: str,
    threads: int,
    kernel: native.NativeCopy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """32 KiB block rows, > 1 MiB per chunk (one piece per thread), a skip and a short chunk."""
    mla = kind is KVLayoutKind.MLA
    kv = make_cache(
        kind, torch.bfloat16, 16, "cpu", storage, num_layers=6 if mla else 3,
        kv_heads=8, head_dim=1024 if mla else 128, num_blocks=20,
    )  # fmt: skip
    # 7 full blocks and a chunk ending 5 tokens into a block: row counts that are
    # not a multiple of the 4 runs the kernel interleaves, and gcd-sized rows.
    ids, tokens = batch(kv, 7, 5)
    srcs = random_chunks(kv, tokens, "cpu")
    monkeypatch.setattr(kvmesh.kernels.ops, "_CPU_BACKEND", "native")
    set_copy_threads(threads)
    try:
        before = snapshot(kv)
        ref_scatter_chunks(kv, ids, srcs, skip_first_n_tokens=21)
        expected = snapshot(kv)
        want = [torch.zeros_like(s) for s in srcs]
        ref_gather_chunks(kv, ids, want)
        for isa in isas(kernel):
            counting = CountingKernel(kernel, isa)
            monkeypatch.setattr(native, "library", lambda c=counting: c)
            restore(kv, before)
            scatter_chunks(kv, ids, srcs, skip_first_n_tokens=21)
            assert all(torch.equal(a, b) for a, b in zip(kv.layers, expected, strict=True)), isa
            outs = [torch.zeros_like(s) for s in srcs]
            gather_chunks(kv, ids, outs)
            assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True)), isa
            assert counting.calls >= 2 * threads
    finally:
        set_copy_threads(None)


@pytest.mark.parametrize("offset_elems", [1, 3, 8, 32])
def test_chunks_at_unaligned_addresses_copy_correctly(
    offset_elems: int, kernel: native.NativeCopy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An L1 object may start anywhere: every run then has an unaligned head and tail."""
    kv = make_cache(KVLayoutKind.FLASH_ATTN, torch.float16, 16, "cpu", "fused", head_dim=64)
    shape = kv.chunk_shape(40)
    numel = int(torch.tensor(shape).prod())
    for isa in isas(kernel):
        counting = CountingKernel(kernel, isa)
        monkeypatch.setattr(kvmesh.kernels.ops, "_CPU_BACKEND", "native")
        monkeypatch.setattr(native, "library", lambda c=counting: c)
        pool = torch.zeros(numel + 2 * offset_elems, dtype=kv.dtype)
        out = pool[offset_elems : offset_elems + numel].view(shape)
        want = torch.zeros(shape, dtype=kv.dtype)
        gather_chunks(kv, [[3, 8, 5]], [out])
        ref_gather_chunks(kv, [[3, 8, 5]], [want])
        assert torch.equal(out, want)
        assert not pool[:offset_elems].any()
        assert not pool[offset_elems + numel :].any()

        before = snapshot(kv)
        ref_scatter_chunks(kv, [[1, 2, 4]], [out])
        expected = snapshot(kv)
        restore(kv, before)
        scatter_chunks(kv, [[1, 2, 4]], [out])
        assert all(torch.equal(a, b) for a, b in zip(kv.layers, expected, strict=True))
        assert counting.calls == 2


# ---- the C function on its own --------------------------------------------------------------


@pytest.mark.parametrize("run_bytes", RUN_LENGTHS)
def test_copy_runs_handles_odd_lengths_and_unaligned_offsets(
    run_bytes: int, kernel: native.NativeCopy
) -> None:
    rng = np.random.default_rng(run_bytes)
    for isa, n_runs in itertools.product(isas(kernel), RUN_COUNTS):
        # Source and destination runs start at every alignment mod 64, in shuffled order.
        stride = run_bytes + 71
        src = rng.integers(0, 256, n_runs * stride + 128, dtype=np.uint8)
        src_off = rng.permutation(n_runs).astype(np.int64) * stride + rng.integers(0, 64, n_runs)
        dst_off = np.arange(n_runs, dtype=np.int64) * stride + rng.integers(0, 64, n_runs)
        dst = np.full(n_runs * stride + 128, 0xA5, dtype=np.uint8)
        want = dst.copy()
        for s, d in zip(src_off.tolist(), dst_off.tolist(), strict=True):
            want[d : d + run_bytes] = src[s : s + run_bytes]

        used = kernel.copy_runs(src, dst, src_off, dst_off, run_bytes, isa)

        assert np.array_equal(dst, want), f"isa {isa}, {n_runs} runs"  # and nothing else written
        assert used == (isa if run_bytes >= 256 else native.ISA_MEMCPY)


def test_copy_runs_rejects_runs_outside_the_arrays(kernel: native.NativeCopy) -> None:
    src = np.zeros(1000, dtype=np.uint8)
    dst = np.zeros(1000, dtype=np.uint8)
    one = np.array([0], dtype=np.int64)
    with pytest.raises(ValueError, match="outside src"):
        kernel.copy_runs(src, dst, np.array([901], dtype=np.int64), one, 100)
    with pytest.raises(ValueError, match="outside dst"):
        kernel.copy_runs(src, dst, one, np.array([-1], dtype=np.int64), 100)
    with pytest.raises(ValueError, match="one length"):
        kernel.copy_runs(src, dst, one, np.array([0, 1], dtype=np.int64), 10)
    with pytest.raises(ValueError, match="run count"):
        kernel.copy_runs_at(src.ctypes.data, dst.ctypes.data, 0, 0, 0, -1)


def test_the_best_instruction_set_is_reported(kernel: native.NativeCopy) -> None:
    assert kernel.isa_name in native.ISA_NAMES.values()
    if "avx2" in Path("/proc/cpuinfo").read_text(errors="replace").split():
        assert kernel.isa == native.ISA_AVX2
    assert native.status().startswith(f"loaded ({kernel.isa_name})")


# ---- the loader and its fallbacks -----------------------------------------------------------


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A loader that has loaded nothing yet."""
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    monkeypatch.delenv(native.ENV_LIBRARY, raising=False)
    native._reset()
    yield
    native._reset()


def test_the_kernel_was_built_with_the_package(fresh_loader: None) -> None:
    """setup.py compiled it at install time, next to the loader."""
    path = native.installed_path()
    assert path is not None, "kvmesh/kernels/_ntcopy*.so is missing: was kvmesh installed?"
    assert path.parent == Path(native.__file__).parent
    loaded = native.load()
    assert loaded is not None, native.status()
    assert loaded.path == path


def test_loading_runs_no_compiler_or_other_process(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the loader started a process: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    assert native.library() is not None, native.status()


@pytest.mark.slow
def test_importing_kernels_loads_nothing() -> None:
    code = (
        "import kvmesh.kernels, kvmesh.kernels.native as n, kvmesh.storage.core.transfer.engine; "
        "assert n.status() == 'not loaded yet', n.status()"
    )
    env = dict(os.environ)
    env.pop(native.ENV_SWITCH, None)
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, check=True, timeout=300)


@pytest.mark.parametrize("value", ["0", "off", "False"])
def test_switched_off_the_ops_copy_with_numpy(
    value: str, fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, value)
    monkeypatch.setattr(kvmesh.kernels.ops, "_CPU_BACKEND", "native")
    assert native.library() is None
    assert native.load() is None
    assert native.status().startswith("disabled")
    kv = make_cache(KVLayoutKind.FLASHINFER, torch.bfloat16, 16, "cpu", "per_layer")
    ids, tokens = batch(kv, 2, 3)
    outs = [torch.zeros(kv.chunk_shape(n), dtype=kv.dtype) for n in tokens]
    want = [torch.zeros_like(o) for o in outs]
    gather_chunks(kv, ids, outs)
    ref_gather_chunks(kv, ids, want)
    assert all(torch.equal(a, b) for a, b in zip(outs, want, strict=True))
    srcs = random_chunks(kv, tokens, "cpu")
    before = snapshot(kv)
    ref_scatter_chunks(kv, ids, srcs, skip_first_n_tokens=16)
    expected = snapshot(kv)
    restore(kv, before)
    scatter_chunks(kv, ids, srcs, skip_first_n_tokens=16)
    assert all(torch.equal(a, b) for a, b in zip(kv.layers, expected, strict=True))


def test_an_install_without_the_kernel_warns_once_and_copies_with_numpy(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A host whose install had no C compiler: one warning, then NumPy for good."""
    monkeypatch.setattr(native, "installed_path", lambda: None)
    monkeypatch.setattr(kvmesh.kernels.ops, "_CPU_BACKEND", "native")
    with caplog.at_level(logging.WARNING, logger="kvmesh.kernels.native"):
        assert native.load() is None
        kv = make_cache(KVLayoutKind.MLA, torch.float16, 16, "cpu", "fused")
        out = torch.zeros(kv.chunk_shape(20), dtype=kv.dtype)
        want = torch.zeros_like(out)
        for _ in range(3):
            gather_chunks(kv, [[4, 6]], [out])
    ref_gather_chunks(kv, [[4, 6]], [want])
    assert torch.equal(out, want)
    assert native.status().startswith("unavailable: kvmesh/kernels/_ntcopy*.so was not built")
    assert "\n" not in native.status()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "use NumPy" in warnings[0].getMessage()


def test_a_library_that_is_not_the_kernel_is_refused(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bogus = tmp_path / "libbogus.so"
    bogus.write_bytes(b"not an ELF file")
    bogus.chmod(0o755)
    monkeypatch.setenv(native.ENV_LIBRARY, str(bogus))
    assert native.load() is None
    assert native.status().startswith(f"unavailable: cannot load {bogus}")


def test_a_library_others_can_write_is_refused(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    installed = native.installed_path()
    assert installed is not None
    copy = tmp_path / "ntcopy.so"
    shutil.copyfile(installed, copy)
    copy.chmod(0o777)
    monkeypatch.setenv(native.ENV_LIBRARY, str(copy))
    assert native.load() is None
    assert "writable by group or others" in native.status()
    native._reset()
    copy.chmod(0o755)
    loaded = native.load()
    assert loaded is not None, native.status()
    assert loaded.path == copy


def test_the_instruction_set_can_be_capped(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, "sse2")
    loaded = native.load()
    assert loaded is not None, native.status()
    assert loaded.isa <= native.ISA_SSE2
    native._reset()
    monkeypatch.setenv(native.ENV_SWITCH, "avx9000")
    assert native.load() is None
    assert "is not one of" in native.status()


def test_a_forked_child_does_not_inherit_a_held_lock(fresh_loader: None) -> None:
    """What the at-fork hook does in the child, run in place: the loader works again."""
    native._lock.acquire()  # as if another thread of the parent held it at fork time
    native._after_fork_in_child()
    assert native.load() is not None, native.status()


def test_the_batched_tile_call_copies_each_item_and_refuses_bad_element_sizes(
    kernel: native.NativeCopy,
) -> None:
    from kvmesh.kernels import paged_layer_shape

    amx = KVLayoutKind.VLLM_CPU_AMX
    layer = torch.ones(paged_layer_shape(amx, 2, 16, 1, 16), dtype=torch.bfloat16)
    rows = torch.zeros(16, 16, dtype=torch.bfloat16)
    blocks = np.zeros(1, dtype=np.int64)
    item = [layer.data_ptr(), rows.data_ptr(), rows.data_ptr(), blocks.ctypes.data, 1, 16, 0]
    items = np.array([item], dtype=np.int64)
    with pytest.raises(ValueError, match="3-byte elements"):
        kernel.tiles_batch("vec", items, (1, 16, 16, 3), gather=True)
    kernel.tiles_batch("amx", items[:0], (1, 16, 16, 2), gather=True)  # an empty batch
    assert not rows.any()
    kernel.tiles_batch("amx", items, (1, 16, 16, 2), gather=True)
    assert bool((rows == 1).all())  # block 0's K and V, all ones
