"""``kvmesh traces``: a trace file read back as a list of traces and as one trace's tree.

The file is written by the same exporter the services use, from real SDK spans
(a private tracer provider: no global one is installed in the test process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from kvmesh.cli.main import main
from kvmesh.common.span_export import JsonLinesSpanExporter


def _write(path: Path) -> tuple[str, str]:
    """Two traces: a gateway call with a storage child (one failing), then a lone heartbeat."""
    ids = []
    for service, names in (
        ("kvmesh-gateway", ["/kvmesh.gateway.v1.GatewayService/Store"]),
        ("kvmesh-storage", ["/kvmesh.coordinator.v1.MembershipService/Heartbeat"]),
    ):
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path=str(path))))
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span(names[0], kind=trace.SpanKind.SERVER) as root:
            if service == "kvmesh-gateway":
                with tracer.start_as_current_span(
                    "/kvmesh.storage.v1.StorageService/StoreChunks",
                    kind=trace.SpanKind.CLIENT,
                    attributes={"rpc.system": "kvmesh-lane"},
                ) as child:
                    child.set_status(trace.StatusCode.ERROR, "L1 is full")
        ids.append(f"{root.get_span_context().trace_id:032x}")
        provider.shutdown()
    return ids[0], ids[1]


def test_without_an_id_it_lists_the_traces_latest_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "spans.jsonl"
    store, heartbeat = _write(path)
    assert main(["traces", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(store)
    assert "/kvmesh.gateway.v1.GatewayService/Store" in lines[0]
    assert "2 spans" in lines[0]
    assert lines[1].startswith(heartbeat)


def test_with_an_id_prefix_it_prints_the_tree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "spans.jsonl"
    store, _ = _write(path)
    assert main(["traces", str(path), store[:10]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"trace {store}: 2 spans, kvmesh-gateway"
    assert lines[1].startswith("  /kvmesh.gateway.v1.GatewayService/Store  SERVER  kvmesh-gateway")
    assert lines[2].startswith(
        "    /kvmesh.storage.v1.StorageService/StoreChunks  CLIENT  kvmesh-gateway"
    )
    assert lines[2].endswith("[kvmesh-lane]  ERROR: L1 is full")


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (None, ["ffff"], "no trace in the file with an id starting 'ffff'"),
        ("not json\n", [], "line 1: not JSON"),
        ('{"name": "x"}\n', [], "line 1: not a span"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    content: str | None,
    args: list[str],
    message: str,
) -> None:
    path = tmp_path / "spans.jsonl"
    if content is None:
        _write(path)
    else:
        path.write_text(content)
    code = main(["traces", str(path), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1
    assert message in err


def test_a_missing_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["traces", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "cannot read trace file" in err
