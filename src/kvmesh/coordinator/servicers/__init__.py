"""The coordinator's gRPC services: thin adapters from protobuf to the Coordinator core.

One module per service: :mod:`.ingest` (EventIngestService and the
registry of open node streams), :mod:`.directory`, :mod:`.membership`,
:mod:`.policy` and :mod:`.admin`. Conversions live in
:mod:`kvmesh.coordinator.wire`; the app binds the servicers.
"""
