"""Event sources of the coordinator besides its gRPC services: the NATS JetStream stream.

nats-py is optional (the ``nats`` extra), so this package imports nothing:
:mod:`.jetstream` (the :class:`NatsEventSource` consumer) and
:mod:`.commands` need nats-py; :mod:`.settings`, :mod:`.position`,
:mod:`.apply` and :mod:`.dispatch` do not.
"""
