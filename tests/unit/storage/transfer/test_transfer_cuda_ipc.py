"""TransferEngine with CUDA IPC handles (needs a GPU).

The exporter is another process, as in production.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvmesh.common.errors import InvalidArgument
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


def _event_exporter(conn: Any) -> None:  # pragma: no cover - child process
    """Writes the layers on a side stream after a long kernel; sends handles and the event."""
    layout = make_layout(KVLayoutKind.FLASH_ATTN, torch.bfloat16, num_layers=1)
    layers = [torch.zeros(layout.layer_shape, device="cuda", dtype=layout.dtype)]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            busy = busy @ busy  # keeps the stream busy well past the parent's first copy
        layers[0].fill_(1.5)
        event = torch.cuda.Event(interprocess=True)
        event.record(stream)
    conn.send(([CudaIpcHandle.from_tensor(t) for t in layers], event.ipc_handle()))
    conn.recv()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device present")
def test_copies_wait_for_the_engines_event_on_the_device(engine: TransferEngine) -> None:
    """A gather given the producer's event sees what the producer wrote before it."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_event_exporter, args=(child,))
    proc.start()
    try:
        handles, event_handle = parent.recv()
        layout = make_layout(KVLayoutKind.FLASH_ATTN, torch.bfloat16, num_layers=1)
        engine.register("gpu-engine", layout, handles)
        out = torch.zeros_like(random_chunk(layout, 16, seed=1))
        engine.gather_chunks("gpu-engine", [[2]], [16], [out], producer_event=event_handle)
        assert bool((out == 1.5).all())
        with pytest.raises(InvalidArgument, match="64-byte"):
            engine.gather_chunks("gpu-engine", [[2]], [16], [out], producer_event=b"short")
        engine.unregister("gpu-engine")
        parent.send("exit")
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
