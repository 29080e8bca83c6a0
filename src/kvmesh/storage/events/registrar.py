"""The storage node's membership loop: register with the coordinator, heartbeat, deregister.

Behaviour follows LMCache's ``keep_registered`` (docs/events.md, "Registrar")
against a :class:`MembershipClient` (the gRPC ``MembershipService`` client
plugs in there):

* the first attempt happens at once, then one tick every
  ``heartbeat_interval_s`` (default 5 s);
* not registered → ``register``; after *every* successful (re-)registration
  ``on_registered`` runs (the node republishes its capacity and, after a
  coordinator cold start, can re-announce its L2 index);
* registered → ``heartbeat``; :class:`~kvmesh.common.errors.NotFound`
  means the coordinator forgot us, so the id is dropped and the next tick
  registers again;
* any other error (transport, server error, malformed reply) is logged and
  retried next tick keeping the id, so it never causes a duplicate
  registration and never ends the loop;
* on stop, a held id is deregistered, errors suppressed.

It runs on its own daemon thread with a stop Event rather than as an asyncio
task: the client calls are blocking (each with its own deadline), the loop is
independent of the gRPC server's event loop, and a thread is simple to stop
and test. :meth:`Registrar.tick` is one iteration, callable directly.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvmesh.common.errors import InvalidArgument, NotFound

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Registration:
    """The coordinator's answer to a registration."""

    #: The id the coordinator knows this node by (normally the one requested).
    instance_id: str
    #: True when the coordinator already had an entry for this id.
    re_registered: bool
    #: The heartbeat interval the coordinator asks for (0 = keep our own).
    heartbeat_interval_s: float = 0.0
    #: How long the coordinator waits for a heartbeat before dropping us (0 = unknown).
    instance_timeout_s: float = 0.0


class MembershipClient(Protocol):
    """Blocking client of the coordinator's membership API; every call has a deadline."""

    def register(self, instance_id: str, metadata: Mapping[str, str]) -> Registration:
        """Register (or re-register) this node; returns the id assigned."""
        ...

    def heartbeat(self, instance_id: str) -> None:
        """Refresh the node's liveness; raises NotFound when the coordinator forgot it."""
        ...

    def deregister(self, instance_id: str) -> None:
        """Remove the node (idempotent on the coordinator)."""
        ...


@dataclass(frozen=True, slots=True)
class RegistrarStats:
    """Counters of the membership loop."""

    registered_id: str | None
    registrations: int
    heartbeats: int
    heartbeats_not_found: int
    errors: int
    last_error: str


class Registrar:
    """Keeps one storage node registered with the coordinator (module docstring).

    ``metadata`` is sent with every registration (address, incarnation,
    ...). ``on_registered`` receives the :class:`Registration` after every
    successful registration; an exception from it is logged and does not
    undo the registration.
    """

    def __init__(
        self,
        client: MembershipClient,
        instance_id: str,
        metadata: Mapping[str, str] | None = None,
        *,
        heartbeat_interval_s: float = 5.0,
        on_registered: Callable[[Registration], None] | None = None,
    ) -> None:
        if not instance_id:
            raise InvalidArgument("instance_id must not be empty", field="instance_id")
        if not 0.0 < heartbeat_interval_s < float("inf"):
            raise InvalidArgument(
                "heartbeat_interval_s must be finite and > 0", field="heartbeat_interval_s"
            )
        self._client = client
        self._instance_id = instance_id
        self._metadata = dict(metadata or {})
        self._interval = heartbeat_interval_s
        self._on_registered = on_registered
        self._lock = threading.Lock()
        self._registered_id: str | None = None
        self._registrations = 0
        self._heartbeats = 0
        self._not_found = 0
        self._errors = 0
        self._last_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # One tick at a time, whether from the thread or a direct tick() call.
        self._tick_lock = threading.Lock()

    @property
    def heartbeat_interval_s(self) -> float:
        """The interval in use: the configured one, or the coordinator's once it states one."""
        with self._lock:
            return self._interval

    @property
    def registered_id(self) -> str | None:
        """The id currently registered, or None while (re-)registration is pending."""
        with self._lock:
            return self._registered_id

    def stats(self) -> RegistrarStats:
        """A snapshot of the loop's counters."""
        with self._lock:
            return RegistrarStats(
                registered_id=self._registered_id,
                registrations=self._registrations,
                heartbeats=self._heartbeats,
                heartbeats_not_found=self._not_found,
                errors=self._errors,
                last_error=self._last_error,
            )

    def tick(self) -> None:
        """One iteration: register when not registered, else heartbeat. Never raises."""
        with self._tick_lock:
            current = self.registered_id
            try:
                if current is None:
                    self._register()
                else:
                    self._heartbeat(current)
            except Exception as exc:
                with self._lock:
                    self._errors += 1
                    self._last_error = f"{type(exc).__name__}: {exc}"
                # Expected while the coordinator is down; keep the id and retry.
                logger.warning(
                    "coordinator membership %s failed (will retry in %.1fs): %s",
                    "registration" if current is None else "heartbeat",
                    self.heartbeat_interval_s,
                    exc,
                )

    def _register(self) -> None:
        registration = self._client.register(self._instance_id, dict(self._metadata))
        if not isinstance(registration, Registration) or not registration.instance_id:
            raise ValueError(f"malformed registration reply: {registration!r}")
        if registration.instance_id != self._instance_id:
            logger.warning(
                "coordinator registered us as %r, not %r; cache events still carry %r",
                registration.instance_id,
                self._instance_id,
                self._instance_id,
            )
        with self._lock:
            self._registered_id = registration.instance_id
            self._registrations += 1
            asked = registration.heartbeat_interval_s
            # The coordinator knows its own timeout; follow its pace when it states one.
            if 0.0 < asked < float("inf") and asked != self._interval:
                logger.info("heartbeat interval %.3gs (set by the coordinator)", asked)
                self._interval = asked
        logger.info(
            "registered with the coordinator as %s%s",
            registration.instance_id,
            " (re-registered)" if registration.re_registered else "",
        )
        if self._on_registered is not None:
            try:
                self._on_registered(registration)
            except Exception:
                logger.exception("on_registered callback failed")

    def _heartbeat(self, current: str) -> None:
        try:
            self._client.heartbeat(current)
        except NotFound:
            with self._lock:
                if self._registered_id == current:
                    self._registered_id = None
                self._not_found += 1
            logger.warning(
                "coordinator does not know %s any more; registering again next tick", current
            )
            return
        with self._lock:
            self._heartbeats += 1

    def start(self) -> None:
        """Start the loop thread; the first tick runs at once. Idempotent."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._run, name=f"registrar-{self._instance_id}", daemon=True
            )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(self.heartbeat_interval_s)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop, then deregister a held id (errors logged, not raised).

        Waits up to ``timeout`` s for an in-progress call to finish first, so
        a late registration cannot outlive the deregistration.
        """
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("registrar thread did not stop within %.1fs", timeout)
        with self._lock:
            current, self._registered_id = self._registered_id, None
        if current is None:
            return
        try:
            self._client.deregister(current)
        except Exception as exc:
            logger.warning("deregistering %s from the coordinator failed: %s", current, exc)
        else:
            logger.info("deregistered %s from the coordinator", current)
