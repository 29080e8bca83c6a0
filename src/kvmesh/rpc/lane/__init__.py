"""The local lane: a service's unary RPCs as framed Protobuf over a unix socket.

Why it exists: on the small hosts kvmesh is measured on, one Python gRPC
round trip costs 0.6–0.9 ms even for an empty message (gRPC core hands each
call between its own threads and the Python one), while a plain unix-socket
round trip costs about 0.04 ms. An engine asks its node's gateway for a
lookup on every scheduled request, so that hop is the one that matters; the
lane serves it without gRPC's thread hand-offs.

It changes the transport only, never the contract: the lane carries the
exact request and response messages of the service's ``.proto``, runs the
same servicer methods, maps their errors with the same code as gRPC
(src/kvmesh/rpc/interceptors.py), counts them in the same RPC metrics and
answers with the same status codes and ``google.rpc.Status`` details
(ErrorInfo included). Streaming RPCs are not served on the lane
(UNIMPLEMENTED); use gRPC for those.

By job:

- :mod:`kvmesh.rpc.lane.framing`: the wire format — frames, the parser of a
  request stream, the meaning of a reply;
- :mod:`kvmesh.rpc.lane.client`: ``LaneTransport`` (blocking) and
  ``AsyncLaneTransport`` (asyncio), the typed clients' transports for
  ``lane:<path>`` targets (src/kvmesh/rpc/transport.py);
- :mod:`kvmesh.rpc.lane.gilsocket`: the blocking client's socket calls,
  which release the GIL only while they wait;
- :mod:`kvmesh.rpc.lane.server`: ``LaneServer``, which dispatches each call
  from the service descriptor to its servicer method and enforces the
  deadline the client sent.

This package's ``__init__`` imports nothing, so a client loads only the
framing and the client modules.
"""
