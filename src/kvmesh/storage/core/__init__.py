"""A storage node's logic: L1, L2, controllers, eviction, transfers (no protobuf, no gRPC)."""
