"""TransferEngine with CUDA IPC handles (needs a GPU).

The exporter is another process, as in production.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvmesh.kernels import KVLayoutKind, PagedKVCache, ref_gather_chunks
from kvmesh.storage.core.transfer.cuda_ipc import CudaIpcHandle
from kvmesh.storage.core.transfer.engine import TransferEngine
from tests.unit.storage.transfer.support import LAYOUTS, make_layout, random_chunk


def _cuda_exporter(conn: Any, kind_name: str) -> None:  # pragma: no cover - child process
    layout = make_layout(KVLayoutKind[kind_name], torch.bfloat16)
    layers = [
        torch.randn(layout.layer_shape, device="cuda").to(layout.dtype)
        for _ in range(layout.num_layers)
    ]
    conn.send([CudaIpcHandle.from_tensor(t) for t in layers])
    conn.recv()  # the parent has scattered: send the layers back and exit
    conn.send([t.cpu() for t in layers])
    conn.recv()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device present")
@pytest.mark.parametrize("kind", LAYOUTS)
def test_cuda_ipc_registration_round_trips_chunks(
    engine: TransferEngine, kind: KVLayoutKind
) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_cuda_exporter, args=(child, kind.name))
    proc.start()
    try:
        handles = parent.recv()
        layout = make_layout(kind, torch.bfloat16)
        engine.register("gpu-engine", layout, handles)
        src = random_chunk(layout, 21, seed=11)
        engine.scatter_chunks("gpu-engine", [[3, 6]], [21], [src], skip_first_n_tokens=0)
        out = torch.zeros_like(src)
        engine.gather_chunks("gpu-engine", [[3, 6]], [21], [out])
        assert torch.equal(out, src)
        engine.unregister("gpu-engine")
        parent.send("dump")
        exported = parent.recv()
        expected = PagedKVCache(exported, kind)
        check = torch.zeros_like(src)
        ref_gather_chunks(expected, [[3, 6]], [check])
        assert torch.equal(check, src)  # the bytes landed in the exporter's own memory
        parent.send("exit")
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
