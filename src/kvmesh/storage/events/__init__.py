"""The node's cache-event pipeline: emitter, registration and the transports to the coordinator."""
