"""The lane's wire format without sockets: the request parser on malformed frames, replies."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from kvmesh.rpc.errors import RpcError, error_info, status_bytes
from kvmesh.rpc.lane.framing import (
    MAX_METHOD_BYTES,
    MAX_TRACEPARENT_BYTES,
    REQUEST,
    FrameError,
    RequestFrame,
    RequestReader,
    cancel_frame,
    hello,
    read_hello,
    reply_result,
    request_frame,
)

LIMIT = 1024
PING = b"/kvmesh.gateway.v1.GatewayService/Ping"
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def raw(
    call_id: int,
    method: bytes,
    payload: bytes = b"",
    traceparent: bytes = b"",
    *,
    declared: int | None = None,
    method_len: int | None = None,
    tp_len: int | None = None,
    timeout_ms: int = 0,
) -> bytes:
    """A request frame whose header may lie about its lengths."""
    header = REQUEST.pack(
        len(payload) if declared is None else declared,
        call_id,
        timeout_ms,
        len(method) if method_len is None else method_len,
        len(traceparent) if tp_len is None else tp_len,
    )
    return header + method + traceparent + payload


def test_a_whole_frame_is_one_request() -> None:
    reader = RequestReader(LIMIT)
    data = request_frame(7, PING, TRACEPARENT, b"\x08\x01", timeout=2.5)
    assert reader.feed(data) == [
        RequestFrame(7, 2500, PING.decode(), TRACEPARENT.decode(), b"\x08\x01")
    ]
    assert reader.pending == 0


def test_frames_split_byte_by_byte_and_batched_are_all_found_in_order() -> None:
    reader = RequestReader(LIMIT)
    data = b"".join(request_frame(i, PING, b"", bytes([i]) * i, None) for i in range(1, 6))
    found: list[RequestFrame | FrameError] = []
    for i in range(len(data)):
        found += reader.feed(data[i : i + 1])
    assert [(f.call_id, f.payload) for f in found if isinstance(f, RequestFrame)] == [
        (i, bytes([i]) * i) for i in range(1, 6)
    ]
    assert RequestReader(LIMIT).feed(data) == found


@pytest.mark.parametrize(
    "cut", [1, REQUEST.size - 1, REQUEST.size, REQUEST.size + 3, REQUEST.size + len(PING) + 1]
)
def test_a_truncated_frame_waits_for_the_rest(cut: int) -> None:
    reader = RequestReader(LIMIT)
    data = raw(1, PING, b"\x08\x01\x10\x02")
    assert reader.feed(data[:cut]) == []
    assert reader.pending == cut
    [frame] = reader.feed(data[cut:])
    assert isinstance(frame, RequestFrame)
    assert frame.payload == b"\x08\x01\x10\x02"
    assert reader.pending == 0


def test_a_payload_over_the_limit_is_refused_and_ends_the_stream() -> None:
    reader = RequestReader(LIMIT)
    good = raw(1, PING)
    oversize = raw(2, PING, declared=LIMIT + 1)  # only the header arrives: no need to wait
    [first, error] = reader.feed(good + oversize)
    assert isinstance(first, RequestFrame)
    assert error == FrameError(
        2,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"request of {LIMIT + 1} bytes exceeds max_message_bytes {LIMIT}",
        fatal=True,
    )
    assert reader.feed(raw(3, PING)) == []  # nothing after it is trusted
    assert reader.pending == 0


def test_a_payload_at_the_limit_is_accepted() -> None:
    [frame] = RequestReader(LIMIT).feed(raw(1, PING, b"x" * LIMIT))
    assert isinstance(frame, RequestFrame)


@pytest.mark.parametrize(
    ("method_len", "tp_len"),
    [(MAX_METHOD_BYTES + 1, 0), (0xFFFF, 0), (10, MAX_TRACEPARENT_BYTES + 1), (0xFFFF, 0xFFFF)],
)
def test_header_lengths_no_real_frame_has_are_refused_and_end_the_stream(
    method_len: int, tp_len: int
) -> None:
    reader = RequestReader(LIMIT)
    [error] = reader.feed(raw(4, b"", method_len=method_len, tp_len=tp_len))
    assert isinstance(error, FrameError)
    assert (error.call_id, error.code, error.fatal) == (4, grpc.StatusCode.INVALID_ARGUMENT, True)
    assert reader.feed(raw(5, PING)) == []


@pytest.mark.parametrize(
    ("method", "traceparent"), [("/é".encode(), b""), (b"\xff\xfe", b""), (PING, b"\x80abc")]
)
def test_a_non_ascii_method_or_traceparent_is_refused_and_the_stream_goes_on(
    method: bytes, traceparent: bytes
) -> None:
    reader = RequestReader(LIMIT)
    error, after = reader.feed(raw(1, method, b"\x08\x01", traceparent) + raw(2, PING))
    assert isinstance(error, FrameError)
    assert (error.call_id, error.code, error.fatal) == (1, grpc.StatusCode.INVALID_ARGUMENT, False)
    assert "not ASCII" in error.message
    assert isinstance(after, RequestFrame)
    assert after.call_id == 2


def test_a_cancel_frame_names_no_method_and_a_payload_without_one_is_refused() -> None:
    reader = RequestReader(LIMIT)
    cancel, refused = reader.feed(cancel_frame(9) + raw(10, b"", b"\x08\x01"))
    assert cancel == RequestFrame(9, 0, "", "", b"")
    assert isinstance(refused, FrameError)
    assert (refused.call_id, refused.code, refused.fatal) == (
        10,
        grpc.StatusCode.INVALID_ARGUMENT,
        False,
    )


def test_request_frame_timeouts_round_up_and_saturate() -> None:
    def timeout_ms(timeout: float | None) -> int:
        frame = RequestReader(LIMIT).feed(request_frame(1, PING, b"", b"", timeout))[0]
        assert isinstance(frame, RequestFrame)
        return frame.timeout_ms

    assert timeout_ms(None) == 0
    assert timeout_ms(0.0001) == 1
    assert timeout_ms(1e9) == 0xFFFFFFFF


# -- the client's side ---------------------------------------------------------------------


def test_an_ok_reply_is_the_response_bytes() -> None:
    assert reply_result(0, b"\x08\x10") == b"\x08\x10"


def test_an_error_reply_is_an_rpc_error_with_its_error_info() -> None:
    info = error_details_pb2.ErrorInfo(reason="NO_LOOKUP", domain="kvmesh.dev")
    body = status_bytes(grpc.StatusCode.NOT_FOUND, "no lookup r", info)
    with pytest.raises(RpcError) as err:
        reply_result(grpc.StatusCode.NOT_FOUND.value[0], body)
    assert isinstance(err.value, grpc.RpcError)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.NOT_FOUND, "no lookup r")
    assert error_info(err.value) == info


def test_an_error_reply_without_details_and_an_unknown_code() -> None:
    with pytest.raises(RpcError) as err:
        reply_result(99, status_pb2.Status(code=99, message="odd").SerializeToString())
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.trailing_metadata() == ()
    assert error_info(err.value) is None


def test_an_error_reply_that_does_not_parse_is_internal() -> None:
    with pytest.raises(RpcError) as err:
        reply_result(grpc.StatusCode.NOT_FOUND.value[0], b"\xff\xff\xff")
    assert err.value.code() == grpc.StatusCode.INTERNAL


def test_a_hello_in_another_language_is_unavailable() -> None:
    assert read_hello("/x", hello(4096)) == 4096
    with pytest.raises(RpcError) as err:
        read_hello("/x", b"HTTP/1.1 400")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
