"""The vLLM connector's parts that need no running engine: settings, the KV file, layouts.

These modules load no vLLM (only ``KVMeshConnector`` does), so collecting
this file is cheap; the one test that asks vLLM's attention code which layout
it uses needs the ``vllm`` extra (CI has it; without it that test fails under
KVMESH_REQUIRE_SERVICES=1 and skips otherwise).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh.api.common.v1 import common_pb2
from kvmesh.connector.vllm.cuda import gpu_layout_kind, layout_fields
from kvmesh.connector.vllm.layouts import cache_salt, cpu_layout
from kvmesh.connector.vllm.settings import (
    DEFAULT_GATEWAY,
    SettingsError,
    loads_by_layer,
    parse_settings,
)
from kvmesh.connector.vllm.shm_pool import SharedMemoryPool, reclaim_stale
from tests.support.memory import resident_bytes
from tests.support.servers import require_vllm

# ---- the package -----------------------------------------------------------------------------


def test_importing_the_package_and_its_parts_loads_no_vllm() -> None:
    # vLLM reads KVMeshConnector off the package (the real-vLLM tests load it that
    # way); everything else must stay cheap to import, in tools and in tests alike.
    code = (
        "import sys, kvmesh.connector.vllm as pkg, kvmesh.connector.vllm.settings, "
        "kvmesh.connector.vllm.shm_pool, kvmesh.connector.vllm.layouts, "
        "kvmesh.connector.vllm.cuda\n"
        "assert 'vllm' not in sys.modules, sorted(m for m in sys.modules if 'vllm' in m)\n"
        "try:\n    pkg.NoSuchThing\nexcept AttributeError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "module 'kvmesh.connector.vllm' has no attribute 'NoSuchThing'"


# ---- settings -------------------------------------------------------------------------------


def test_settings_default_and_prefixed_keys() -> None:
    assert parse_settings(None).gateway == DEFAULT_GATEWAY
    s = parse_settings({"kvmesh.gateway": "lane:/x.lane", "rpc_timeout_s": "2.5"})
    assert s.gateway == "lane:/x.lane"
    assert s.rpc_timeout_s == 2.5
    assert s.register_timeout_s == 30.0  # its own, longer default
    assert parse_settings({"register_timeout_s": 60}).register_timeout_s == 60.0


BAD_SETTINGS: list[tuple[dict[str, Any], str]] = [
    ({"gatway": "x"}, "unknown key 'gatway'"),
    ({"gateway": ""}, "'gateway' must not be empty"),
    ({"gateway": 5}, "'gateway' must be a string"),
    ({"rpc_timeout_s": 0}, "'rpc_timeout_s' must be > 0"),
    ({"lookup_timeout_s": "nan"}, "'lookup_timeout_s' must be > 0"),
    ({"register_timeout_s": -1}, "'register_timeout_s' must be > 0"),
    ({"lookup_wait_ms": 5000}, "'lookup_wait_ms' must be in [0, 1000]"),
    ({"transfer_threads": 0}, "'transfer_threads' must be >= 1"),
    ({"transfer_threads": "two"}, "'transfer_threads' must be int"),
    ({"transfer_threads": True}, "must be a number"),
    ({"keep_failure_policy": "maybe"}, "must be true or false"),
    ({"log_level": "verbose"}, "'log_level' must be one of DEBUG, INFO, WARNING, ERROR"),
    ({"load_by_layer": "sometimes"}, "'load_by_layer' must be one of auto, true, false"),
    ({"load_by_layer": 1}, "'load_by_layer' must be a string"),
]


def test_load_by_layer_takes_auto_and_json_booleans() -> None:
    assert parse_settings(None).load_by_layer == "auto"
    assert parse_settings({"load_by_layer": False}).load_by_layer == "false"
    assert parse_settings({"kvmesh.load_by_layer": True}).load_by_layer == "true"
    assert parse_settings({"load_by_layer": "false"}).load_by_layer == "false"


def test_auto_loads_by_layer_on_gpus_only() -> None:
    assert loads_by_layer("auto", "cuda") is True
    assert loads_by_layer("auto", "cpu") is False
    assert loads_by_layer("true", "cpu") is True
    assert loads_by_layer("false", "cuda") is False


@pytest.mark.parametrize(("extra", "message"), BAD_SETTINGS)
def test_a_bad_setting_names_the_key_and_what_is_valid(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        parse_settings(extra)
    assert message in str(info.value)
    assert str(info.value).startswith("kv_connector_extra_config:")


# ---- the shared-memory file vLLM's CPU KV cache lives in ------------------------------------


def test_the_pool_keeps_the_kv_file_nameless_so_nothing_outlives_its_processes(
    tmp_path: Path,
) -> None:
    """The default: no name in the folder, ever; storage opens vLLM's descriptor of it."""
    pool = SharedMemoryPool(tmp_path)
    with pool:
        kv = torch.zeros(4 << 20, dtype=torch.int8)
    assert pool.buffer is kv
    assert list(tmp_path.iterdir()) == []
    assert str(pool.path).startswith(f"/proc/{os.getpid()}/fd/")
    assert os.readlink(pool.path).startswith(f"{tmp_path}/")
    kv[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.int8)
    with open(pool.path, "rb") as f:  # what storage maps: the same pages
        assert f.read(4) == b"\x01\x02\x03\x04"
    pool.close()
    assert not os.path.exists(pool.path)
    assert int(kv[:4].sum()) == 10  # vLLM's mapping stays valid after close
    assert list(tmp_path.iterdir()) == []


def test_a_nameless_kv_file_is_freed_when_its_process_is_killed() -> None:
    """SIGKILL leaves nothing in /dev/shm: the kernel frees the file with its last mapping."""
    code = (
        "import os, sys, torch\n"
        "from kvmesh.connector.vllm.shm_pool import SharedMemoryPool\n"
        "pool = SharedMemoryPool(sys.argv[1])\n"
        "with pool:\n"
        "    kv = torch.zeros(8 << 20, dtype=torch.int8)\n"
        "print(pool.path, flush=True)\n"
        "sys.stdin.read()\n"
    )
    folder = Path(tempfile.mkdtemp(prefix="kvmesh-pool-kill-", dir="/dev/shm"))
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", code, str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        path = child.stdout.readline().strip()
        assert os.readlink(path).startswith(f"{folder}/")
        assert list(folder.iterdir()) == []
        child.kill()
        child.wait(10)
        assert not os.path.exists(path)
        assert list(folder.iterdir()) == []
    finally:
        shutil.rmtree(folder)


def test_the_named_pool_maps_the_kv_allocation_and_removes_its_file(tmp_path: Path) -> None:
    pool = SharedMemoryPool(tmp_path, named=True)
    with pool:
        small = torch.zeros(16, dtype=torch.int8)  # below MIN_BYTES: left to torch
        kv = torch.zeros(4 << 20, dtype=torch.int8)
        other = torch.zeros(4 << 20, dtype=torch.int8)  # only the first large one is mapped
    assert pool.buffer is kv
    assert pool.path.exists()
    assert pool.path.stat().st_size == 4 << 20
    assert pool.offset_of(kv[1024:2048]) == 1024
    assert pool.offset_of(small) is None
    assert pool.offset_of(other) is None
    kv[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.int8)
    assert pool.path.read_bytes()[:4] == b"\x01\x02\x03\x04"  # MAP_SHARED: the file sees it
    pool.close()
    assert not pool.path.exists()


def test_the_pool_allocates_its_file_and_maps_every_page_up_front() -> None:
    """vLLM's first reads, and storage's first copies, pay no page allocation."""
    folder = Path(tempfile.mkdtemp(prefix="kvmesh-pool-test-", dir="/dev/shm"))
    try:
        pool = SharedMemoryPool(folder)
        with pool:
            kv = torch.zeros(4 << 20, dtype=torch.int8)
        assert pool.buffer is kv
        assert pool.path.stat().st_blocks * 512 >= 4 << 20
        assert resident_bytes(os.readlink(pool.path)) >= 4 << 20
        assert int(kv.abs().sum()) == 0  # still what torch.zeros promises
        pool.close()
    finally:
        shutil.rmtree(folder)


def test_a_kv_cache_the_folder_cannot_hold_stays_in_vllms_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A full /dev/shm: one warning, torch allocates as without kvmesh, no file is left."""

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    pool = SharedMemoryPool(tmp_path, named=True)
    with caplog.at_level(logging.WARNING, logger="kvmesh"), pool:
        kv = torch.zeros(4 << 20, dtype=torch.int8)
    assert pool.buffer is None
    assert kv.shape == (4 << 20,)
    assert int(kv.abs().sum()) == 0
    assert not pool.path.exists()
    assert list(tmp_path.iterdir()) == []
    assert "No space left on device" in caplog.text
    assert "kvmesh stays off for this engine" in caplog.text


def test_a_file_left_by_a_dead_process_is_reclaimed_and_a_live_ones_kept(tmp_path: Path) -> None:
    """A named file's owner holds its lock: a file nobody locks is stale, whatever its pid."""
    mine = os.getpid()
    # Unlocked, named after a live pid (another PID namespace's engine reused it).
    stale = tmp_path / f"kvmesh-vllm-{mine}-0-0123abcd"
    live = tmp_path / "kvmesh-vllm-1-99-89abcdef"  # locked, pid 1 of some namespace
    unrelated = tmp_path / "kvmesh-vllm-notapid"
    for path in (stale, live, unrelated):
        path.write_bytes(b"kv")
    holder = os.open(live, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        assert reclaim_stale(tmp_path) == [stale]
    finally:
        os.close(holder)
    assert live.exists()
    assert unrelated.exists()
    assert not stale.exists()
    # Its owner gone (the lock with it), the live file is stale too.
    assert reclaim_stale(tmp_path) == [live]


def test_a_file_of_an_older_kvmesh_is_judged_by_its_pid(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = tmp_path / f"kvmesh-vllm-{dead.stdout.strip()}-0"
    live = tmp_path / f"kvmesh-vllm-{os.getpid()}-99"
    for path in (stale, live):
        path.write_bytes(b"kv")
    assert reclaim_stale(tmp_path) == [stale]
    assert live.exists()


def test_two_named_pools_of_one_pid_never_collide_and_hold_their_files(tmp_path: Path) -> None:
    first = SharedMemoryPool(tmp_path, named=True)
    second = SharedMemoryPool(tmp_path, named=True)
    assert first.path != second.path
    with first:
        torch.zeros(2 << 20, dtype=torch.int8)
    assert first.buffer is not None
    assert first.path.exists()
    assert reclaim_stale(tmp_path) == []  # its owner (this process) holds the lock
    first.close()
    assert not first.path.exists()


def test_the_pool_refuses_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SharedMemoryPool(tmp_path / "nope")


# ---- layouts --------------------------------------------------------------------------------


def test_cpu_layout_follows_vllms_attention_isa() -> None:
    require_vllm()
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    layer = torch.zeros(4, 2, 128, 128, dtype=torch.bfloat16)
    kind, problem = cpu_layout(layer, vllm_block_size=128)
    isa = _get_attn_isa(torch.bfloat16, 128, 64)
    want = {
        "vec": common_pb2.KV_LAYOUT_KIND_VLLM_CPU,
        "amx": common_pb2.KV_LAYOUT_KIND_VLLM_CPU_AMX,
    }
    assert (kind, problem) == (want[isa], None)


def test_cpu_layout_refuses_shapes_it_cannot_move() -> None:
    _, problem = cpu_layout(torch.zeros(4, 2, 128, 127), vllm_block_size=128)
    assert problem is not None
    assert "unexpected KV tensor shape" in problem
    _, problem = cpu_layout(torch.zeros(4, 2, 64, 128), vllm_block_size=128)
    assert problem is not None
    assert "vLLM's block size is 128" in problem


GPU_SHAPES = [
    ((2, 10, 16, 8, 64), common_pb2.KV_LAYOUT_KIND_FLASH_ATTN, (10, 16, 8, 64)),
    ((10, 2, 16, 8, 64), common_pb2.KV_LAYOUT_KIND_FLASHINFER, (10, 16, 8, 64)),
    ((10, 16, 576), common_pb2.KV_LAYOUT_KIND_MLA, (10, 16, 1, 576)),
]


@pytest.mark.parametrize(("shape", "kind", "fields"), GPU_SHAPES)
def test_gpu_layouts_are_read_off_vllms_kv_tensor_shapes(
    shape: tuple[int, ...], kind: int, fields: tuple[int, int, int, int]
) -> None:
    # Shape logic only: a CPU tensor of the GPU shape stands in for the device tensor.
    assert gpu_layout_kind(torch.zeros(shape), block_size=16) == (kind, None)
    got = layout_fields(kind, shape)  # type: ignore[arg-type]
    assert (got["num_blocks"], got["block_size"], got["kv_heads"], got["head_dim"]) == fields


def test_gpu_layouts_kvmesh_cannot_move_keep_it_off() -> None:
    hnd = torch.zeros(2, 10, 8, 16, 64).permute(0, 1, 3, 2, 4)  # vLLM's HND stride order
    assert "not contiguous" in str(gpu_layout_kind(hnd, block_size=16)[1])
    assert "no layout" in str(gpu_layout_kind(torch.zeros(2, 2, 16, 8, 64), block_size=16)[1])
    assert "no layout" in str(gpu_layout_kind(torch.zeros(2, 10, 32, 8, 64), block_size=16)[1])


def test_lora_adapters_never_share_a_salt() -> None:
    class Lora:
        def __init__(self, name: str, int_id: int) -> None:
            self.lora_name, self.lora_int_id = name, int_id

    class Req:
        def __init__(self, salt: str | None, lora: Lora | None) -> None:
            self.cache_salt, self.lora_request = salt, lora

    salts = {
        cache_salt(Req(None, None)),  # type: ignore[arg-type]
        cache_salt(Req("t1", None)),  # type: ignore[arg-type]
        cache_salt(Req("t1", Lora("a", 1))),  # type: ignore[arg-type]
        cache_salt(Req("t1", Lora("b", 2))),  # type: ignore[arg-type]
    }
    assert len(salts) == 4
    assert cache_salt(Req(None, None)) == ""  # type: ignore[arg-type]


def test_the_connectors_default_gateway_is_where_the_gateway_listens_by_default() -> None:
    from kvmesh.gateway.config import DEFAULT_PORT

    assert parse_settings({}).gateway == f"127.0.0.1:{DEFAULT_PORT}"


# ---- RoPE parameters for the registration ----------------------------------------------------


def test_a_llama_config_gives_plain_neox_rope_parameters() -> None:
    from transformers import LlamaConfig

    from kvmesh.connector.vllm.rope import rope_parameters

    rope, why = rope_parameters(LlamaConfig(rope_theta=100000.0), 64)
    assert why == ""
    assert rope == common_pb2.RopeParameters(base=100000.0, style=common_pb2.ROPE_STYLE_NEOX)


def test_partial_rotary_and_gptj_pairing_are_read_off_the_config() -> None:
    from transformers import GPTJConfig, LlamaConfig

    from kvmesh.connector.vllm.rope import rope_parameters

    partial = LlamaConfig()
    partial.model_type = "qwen3"
    partial.partial_rotary_factor = 0.5
    rope, _ = rope_parameters(partial, 128)
    assert rope is not None
    assert rope.rotary_dim == 64
    assert rope.style == common_pb2.ROPE_STYLE_NEOX
    gptj, _ = rope_parameters(GPTJConfig(rotary_dim=64), 256)
    assert gptj == common_pb2.RopeParameters(
        base=10000.0, rotary_dim=64, style=common_pb2.ROPE_STYLE_GPTJ
    )


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model_type": "gpt2"}, "model type 'gpt2'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}}, "rope_theta"),
        ({"partial_rotary_factor": 0.3}, "rotary_dim"),
    ],
)
def test_a_rotation_not_known_here_sends_no_parameters(change: dict[str, Any], words: str) -> None:
    # A wrong guess would corrupt every moved key silently: better no segments at all.
    from transformers import LlamaConfig

    from kvmesh.connector.vllm.rope import rope_parameters

    config = LlamaConfig()
    for name, value in change.items():
        setattr(config, name, value)
    rope, why = rope_parameters(config, 64)
    assert rope is None
    assert words in why


def test_layer_names_map_to_their_registered_layer_and_shared_tensors_share_one() -> None:
    from kvmesh.connector.vllm.registration import distinct_layers, layer_indices

    a, b, c = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    caches = {"l.0": a, "l.1": b, "l.2": b, "l.3": c}  # layers 1 and 2 share one tensor
    assert [t.data_ptr() for t in distinct_layers(caches)] == [
        a.data_ptr(),
        b.data_ptr(),
        c.data_ptr(),
    ]
    assert layer_indices(caches) == {"l.0": 0, "l.1": 1, "l.2": 1, "l.3": 2}


def test_the_scheduler_starts_loads_ahead_only_where_it_is_asked_and_safe() -> None:
    """``load_ahead`` names the one worker whose loads the scheduler starts (docs/vllm.md,
    "Loads started by the scheduler"); anything that could race the engine turns it off."""
    require_vllm()
    from types import SimpleNamespace

    from kvmesh.connector.vllm.connector import KVMeshConnector

    def ahead(on_cpu: bool = True, instance: str = "inst", **changes: Any) -> str:
        options = {"load_ahead": True, "load_by_layer": "auto"} | {
            k: v for k, v in changes.items() if k in ("load_ahead", "load_by_layer")
        }
        parallel = SimpleNamespace(
            world_size=changes.get("world_size", 1),
            data_parallel_size=changes.get("data_parallel_size", 1),
        )
        config = SimpleNamespace(
            parallel_config=parallel,
            scheduler_config=SimpleNamespace(
                async_scheduling=changes.get("async_scheduling", False)
            ),
        )
        connector = SimpleNamespace(settings=parse_settings(options | {"gateway": "g"}))
        connector._on_cpu = on_cpu  # type: ignore[attr-defined]
        return KVMeshConnector._ahead_engine_id(connector, config, instance)  # type: ignore[arg-type]

    assert parse_settings(None).load_ahead is False
    assert ahead() == "inst-worker-0"  # the worker's own engine id (rank 0)
    assert ahead(load_ahead=False) == ""
    assert ahead(on_cpu=False) == ""  # GPU memory: the copy must follow vLLM's kernels
    assert ahead(instance="") == ""
    assert ahead(world_size=2) == ""
    assert ahead(data_parallel_size=2) == ""
    assert ahead(async_scheduling=True) == ""
    assert ahead(load_by_layer="true") == ""
