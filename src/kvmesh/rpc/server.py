"""One bootstrap for every kvmesh service.

``config → create_server(config, app) → await server.start() → … → await server.stop()``

A service is a :class:`ServiceApp`: its servicers (as :class:`ServiceBinding`),
the Prometheus collectors that export its core's stats, and optional
start/stop hooks for background work. ``create_server`` adds what every
server has — ``grpc.health.v1`` and reflection, the tracing interceptor (when
tracing is on) and the error-mapping/metrics interceptor, the one decode path
that answers a request that does not parse with INVALID_ARGUMENT
(src/kvmesh/rpc/handlers.py), a ``/metrics`` endpoint and, when configured,
the local lane (src/kvmesh/rpc/lane/) — binds TCP or a unix socket and
reports the bound address.
``run_until_signalled`` is the process entry point: it runs until SIGTERM/SIGINT/SIGHUP,
then flips health to NOT_SERVING, stops with a grace period and runs the
app's stop hook.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from kvmesh.common.config import ConfigError, check_creatable, setting
from kvmesh.common.long_lived import freeze_long_lived
from kvmesh.common.telemetry import (
    configure_tracing,
    shutdown_tracing,
    tracing_enabled,
    untraced_calls,
)
from kvmesh.rpc.handlers import HandlerRegistry
from kvmesh.rpc.interceptors import ServiceInterceptor
from kvmesh.rpc.lane.server import LaneMethod, LaneServer, claim_unix_socket, unary_methods
from kvmesh.rpc.loop_lag import LoopLagMonitor
from kvmesh.rpc.metrics import MetricsServer, RpcMetrics
from kvmesh.rpc.transport import DEFAULT_MAX_MESSAGE_BYTES as _DEFAULT_MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICE = "grpc.reflection.v1alpha.ServerReflection"
#: Defined in src/kvmesh/rpc/transport.py (clients need it without the server); kept here too.
DEFAULT_MAX_MESSAGE_BYTES = _DEFAULT_MAX_MESSAGE_BYTES


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Settings every service has. Service configs inherit them."""

    host: str = setting("127.0.0.1", "address to listen on for gRPC")
    port: int = setting(0, "gRPC port (0 picks a free one)")
    unix_socket: str = setting("", "listen on this unix socket path instead of TCP")
    lane_socket: str = setting(
        "",
        "also serve the unary RPCs on this unix socket over the local lane (framed Protobuf, "
        "a fraction of gRPC's per-call cost; clients dial lane:<path>); empty turns it off",
    )
    metrics_host: str = setting("127.0.0.1", "address of the Prometheus /metrics endpoint")
    metrics_port: int = setting(0, "port of /metrics (0 picks a free one, -1 disables it)")
    grace_seconds: float = setting(5.0, "how long in-flight RPCs may finish on shutdown")
    max_message_bytes: int = setting(
        DEFAULT_MAX_MESSAGE_BYTES, "largest gRPC message accepted or sent"
    )
    log_level: str = setting("INFO", "log level (DEBUG, INFO, WARNING, ERROR)")
    loop_lag_interval_ms: float = setting(
        50.0,
        "how often the event loop's lateness is sampled into kvmesh_event_loop_lag_seconds "
        "(a stall shows as its length less up to this; each sample costs the idle loop a "
        "wake-up); 0 turns it off",
    )
    ready_file: str = setting(
        "", "once serving, write the bound endpoints here as JSON (used by kvmesh up)"
    )

    def validate_server(self) -> None:
        """Raise ConfigError for unusable server settings."""
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        if self.grace_seconds < 0:
            raise ConfigError("grace_seconds must be >= 0")
        if self.max_message_bytes < 1024:
            raise ConfigError("max_message_bytes must be >= 1024")
        if self.loop_lag_interval_ms != 0 and not 1 <= self.loop_lag_interval_ms <= 60_000:
            raise ConfigError(
                f"loop_lag_interval_ms must be 0 (off) or in [1, 60000], "
                f"got {self.loop_lag_interval_ms}"
            )
        if self.lane_socket and self.lane_socket == self.unix_socket:
            raise ConfigError("lane_socket and unix_socket must be different paths")
        for name in ("unix_socket", "lane_socket"):
            # Checked before the app is built: a path that can never be bound.
            path = Path(getattr(self, name))
            if str(path) != "." and path.exists() and not path.is_socket():
                raise ConfigError(f"{name} {path} exists and is not a socket")
            if str(path) != ".":
                check_creatable(name, path)
        levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
        if self.log_level.upper() not in levels:
            raise ConfigError(
                f"log_level {self.log_level!r} is not a log level (one of {', '.join(levels)})"
            )


@dataclass(frozen=True)
class ServiceBinding:
    """One gRPC service of an app: its full name and how to add its servicer.

    ``add_to_server`` is called with the server's
    :class:`~kvmesh.rpc.handlers.HandlerRegistry`, which offers the two
    registration methods of ``grpc.aio.Server`` that generated
    ``add_*Servicer_to_server`` functions use.
    """

    name: str
    add_to_server: Callable[[grpc.aio.Server], None]


class ServiceApp(Protocol):
    """What a service hands to the bootstrap."""

    #: Short name: "coordinator", "storage", "gateway".
    name: str

    def bindings(self) -> Sequence[ServiceBinding]:
        """The servicers to register."""
        ...

    def collectors(self) -> Sequence[Collector]:
        """Prometheus collectors exporting the core's stats."""
        ...

    async def start(self) -> None:
        """Start background work (called once the server listens)."""
        ...

    async def stop(self) -> None:
        """Stop background work and flush state (called after the server stopped)."""
        ...


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Channel arguments of every kvmesh server."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Without this a second server could bind the same port silently.
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
    ]


class Server:
    """A created (bound) server; start() makes it serve."""

    def __init__(
        self,
        app: ServiceApp,
        server: grpc.aio.Server,
        address: str,
        port: int,
        health: HealthServicer,
        service_names: Sequence[str],
        registry: CollectorRegistry,
        metrics: MetricsServer | None,
        settings: ServerSettings,
        lane: LaneServer | None = None,
        loop_lag: LoopLagMonitor | None = None,
    ) -> None:
        self.app = app
        self.grpc_server = server
        self.address = address
        self.port = port
        self.health = health
        self.service_names = list(service_names)
        self.registry = registry
        self.metrics = metrics
        self.settings = settings
        self.lane = lane
        self.loop_lag = loop_lag
        self._stopped = False
        self._app_health: dict[str, bool] = {}
        self._health_tasks: set[asyncio.Future[None]] = set()

    @property
    def target(self) -> str:
        """What a client dials: ``host:port`` or ``unix:path``."""
        return self.address

    async def start(self) -> None:
        """Serve, start the app's background work, then report SERVING.

        An app that needs its own bound addresses (a storage node registers
        them with the coordinator) gets them through an optional
        ``on_bound(grpc_address, metrics_address)`` hook first.
        """
        await self.grpc_server.start()
        if self.lane is not None:
            await self.lane.start()
        if self.loop_lag is not None:
            self.loop_lag.start()
        on_bound = getattr(self.app, "on_bound", None)
        if callable(on_bound):
            on_bound(self.address, self.metrics.address if self.metrics else "")
        try:
            await self.app.start()
        except BaseException:
            # A start that fails (an endpoint it cannot bind) stops what did start.
            await self.stop(grace=0)
            raise
        watch = getattr(self.app, "watch_health", None)
        if callable(watch):
            # The app reports services it cannot serve (a gateway whose storage is down).
            watch(self.set_serving)
        for name in ["", *self.service_names]:
            await self.health.set(name, self._health_status(name))
        logger.info("%s serving on %s", self.app.name, self.address)

    def _health_status(self, name: str) -> Any:
        serving = health_pb2.HealthCheckResponse.SERVING
        if self._stopped:
            return health_pb2.HealthCheckResponse.NOT_SERVING
        down = {n for n, ok in self._app_health.items() if not ok}
        # The whole server ("") is NOT_SERVING while any of its gRPC services is. A
        # health-only name (a storage node's CoordinatorLink) tells its own state only.
        if (name and name in down) or (not name and down & set(self.service_names)):
            return health_pb2.HealthCheckResponse.NOT_SERVING
        return serving

    def set_serving(self, service: str, serving: bool) -> None:
        """Mark one of the app's services (not) serving; the overall status follows.

        ``service`` may also be a name that only health serves (no gRPC service of
        that name): it is answered as reported and leaves the overall status alone.
        """
        self._app_health[service] = serving
        if self._stopped:
            return
        for name in ("", service):
            task = asyncio.ensure_future(self.health.set(name, self._health_status(name)))
            self._health_tasks.add(task)
            task.add_done_callback(self._health_tasks.discard)

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING first (so probes drain traffic), then stop with grace, then the app."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        grace = self.settings.grace_seconds if grace is None else grace
        if self.lane is not None:
            # Both drain within the one grace period.
            await asyncio.gather(self.lane.stop(grace), self.grpc_server.stop(grace))
        else:
            await self.grpc_server.stop(grace)
        try:
            await self.app.stop()
        finally:
            if self.loop_lag is not None:
                await self.loop_lag.stop()
            if self.metrics is not None:
                self.metrics.close()
        logger.info("%s stopped", self.app.name)

    def endpoints(self) -> dict[str, Any]:
        """Bound endpoints, as written to the ready file."""
        return {
            "service": self.app.name,
            "grpc": self.address,
            "metrics": self.metrics.address if self.metrics else "",
            "lane": self.lane.target if self.lane is not None else "",
            "pid": os.getpid(),
        }


def _bind(server: grpc.aio.Server, settings: ServerSettings) -> tuple[str, int]:
    if settings.unix_socket:
        path = Path(settings.unix_socket)
        claim_unix_socket(path)  # removes a stale socket left by a killed server
        target = f"unix:{path}"
        if not path.parent.is_dir():
            # Checked here: gRPC core would print its own error lines before raising.
            raise ConfigError(f"cannot listen on {target}: no directory {path.parent}")
        try:
            server.add_insecure_port(target)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {target}: {exc}") from exc
        return target, 0
    target = f"{settings.host}:{settings.port}"
    # Probe first: gRPC core would log its own multi-line error before raising.
    if settings.port and _port_in_use(settings):
        raise ConfigError(f"cannot listen on {target}: address in use")
    try:
        port = server.add_insecure_port(target)
    except RuntimeError as exc:
        reason = "address in use" if settings.port and _port_in_use(settings) else str(exc)
        raise ConfigError(f"cannot listen on {target}: {reason}") from exc
    if port == 0:
        raise ConfigError(f"cannot listen on {target}: address in use or not available")
    host = settings.host
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{port}", port


def _port_in_use(settings: ServerSettings) -> bool:
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    with socket.socket(family) as probe:
        # Like the real listener: connections in TIME_WAIT must not count as "in use".
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((settings.host, settings.port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def create_server(
    settings: ServerSettings,
    app: ServiceApp,
    *,
    registry: CollectorRegistry | None = None,
) -> Server:
    """Build and bind a server for ``app``; raises ConfigError when it cannot listen."""
    settings.validate_server()
    registry = registry or CollectorRegistry()
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if configure_tracing(app.name) or tracing_enabled():
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        interceptors.append(aio_server_interceptor(filter_=untraced_calls()))
    rpc_metrics = RpcMetrics(registry, app.name)
    interceptors.append(ServiceInterceptor(rpc_metrics))
    server = grpc.aio.server(
        interceptors=interceptors, options=server_options(settings.max_message_bytes)
    )
    bindings = list(app.bindings())
    # Handlers go through the registry: it gives gRPC the decode path that answers a
    # request that does not parse with INVALID_ARGUMENT, and keeps them for the lane.
    handlers = HandlerRegistry(server)
    for binding in bindings:
        binding.add_to_server(handlers)  # type: ignore[arg-type]
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, handlers)
    names = [b.name for b in bindings]
    reflection.enable_server_reflection([*names, HEALTH_SERVICE, reflection.SERVICE_NAME], server)
    for collector in app.collectors():
        registry.register(collector)
    address, port = _bind(server, settings)
    metrics: MetricsServer | None = None
    if settings.metrics_port >= 0:
        try:
            metrics = MetricsServer(registry, settings.metrics_host, settings.metrics_port)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve /metrics on {settings.metrics_host}:{settings.metrics_port}: "
                f"{exc.strerror or exc}"
            ) from exc
    lane: LaneServer | None = None
    if settings.lane_socket:
        lane = LaneServer(
            settings.lane_socket,
            _lane_methods(names, handlers),
            metrics=rpc_metrics,
            max_message_bytes=settings.max_message_bytes,
        )
        try:
            lane.bind()
        except ConfigError:
            if metrics is not None:
                metrics.close()
            raise
    loop_lag = (
        LoopLagMonitor(registry, app.name, interval_s=settings.loop_lag_interval_ms / 1e3)
        if settings.loop_lag_interval_ms
        else None
    )
    return Server(
        app, server, address, port, health, names, registry, metrics, settings, lane, loop_lag
    )


def _lane_methods(services: Sequence[str], handlers: HandlerRegistry) -> dict[str, LaneMethod]:
    """The lane's method table: each unary method of the services, from its descriptor."""
    pool = descriptor_pool.Default()
    table: dict[str, LaneMethod] = {}
    for service in services:
        try:
            descriptor = pool.FindServiceByName(service)
        except KeyError:
            raise ValueError(f"service {service} is not in the Protobuf descriptor pool") from None

        def servicer_method(rpc: str, service: str = service) -> Any:
            handler = handlers.handler(f"/{service}/{rpc}")
            return None if handler is None else handler.unary_unary

        table.update(unary_methods(descriptor, servicer_method))
    return table


def write_ready_file(path: str, endpoints: dict[str, Any]) -> None:
    """Atomically write the bound endpoints (tmp + rename) so a reader never sees half."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(endpoints))
    tmp.replace(target)


#: Each of these stops a service the same clean way (SIGHUP: its terminal was closed).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def run_until_signalled(server: Server) -> None:
    """Serve until SIGTERM, SIGINT or SIGHUP (a closed terminal), then stop gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in _STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    freeze_long_lived(server.app.name)  # before the first request: see common/long_lived.py
    if server.settings.ready_file:
        write_ready_file(server.settings.ready_file, server.endpoints())
    try:
        await stop.wait()
        logger.info("%s: shutting down", server.app.name)
    finally:
        await server.stop()
        for sig in _STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        if server.settings.ready_file:
            with contextlib.suppress(FileNotFoundError):
                Path(server.settings.ready_file).unlink()
        if server.settings.unix_socket:
            with contextlib.suppress(FileNotFoundError):
                Path(server.settings.unix_socket).unlink()
        shutdown_tracing()


def replace_settings(settings: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` for frozen configs (used by kvmesh up and tests)."""
    return dataclasses.replace(settings, **changes)
