"""Prometheus metrics: per-RPC series every server gets, and a way to export core stats.

Each server owns a ``CollectorRegistry`` (so several servers can run in one
test process) served on its own ``/metrics`` port. Core classes never import
prometheus: they keep plain counters, and a :class:`StatsCollector` turns a
``stats()`` callback into ``kvmesh_*`` series at scrape time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

# Seconds; fine-grained at the bottom because lookups are sub-millisecond.
RPC_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class RpcMetrics:
    """Request count, latency and errors by gRPC method and status code."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self.requests = Counter(
            "kvmesh_rpc_requests",
            "RPCs handled, by method and status code.",
            ["service", "method", "code"],
            registry=registry,
        )
        self.latency = Histogram(
            "kvmesh_rpc_latency_seconds",
            "Time to handle an RPC (streams: until the stream ends).",
            ["service", "method"],
            buckets=RPC_LATENCY_BUCKETS,
            registry=registry,
        )
        self.errors = Counter(
            "kvmesh_rpc_errors",
            "RPCs that ended with a non-OK status, by method and code.",
            ["service", "method", "code"],
            registry=registry,
        )
        self.service = service
        self._children: dict[tuple[str, str], tuple[Any, Any, Any | None]] = {}
        self._lock = threading.Lock()

    def observe(self, method: str, code: str, seconds: float) -> None:
        """Record one finished RPC (children are cached: this is on every call)."""
        key = (method, code)
        children = self._children.get(key)
        if children is None:
            with self._lock:
                children = (
                    self.requests.labels(self.service, method, code),
                    self.latency.labels(self.service, method),
                    None if code == "OK" else self.errors.labels(self.service, method, code),
                )
                self._children[key] = children
        requests, latency, errors = children
        requests.inc()
        latency.observe(seconds)
        if errors is not None:
            errors.inc()


@dataclass(frozen=True)
class Series:
    """One exported series of a stats collector.

    ``path`` walks the stats dict ("l1.used_bytes"); ``label`` turns a dict
    at that path into one sample per key (e.g. bytes per salt), ``labels``
    (several names) a dict keyed by tuples of as many values.
    """

    name: str
    help: str
    path: str
    kind: str = "gauge"  # or "counter"
    label: str | None = None
    labels: tuple[str, ...] = ()


class StatsCollector(Collector):
    """Exports values from a ``stats()`` callback at scrape time."""

    def __init__(
        self,
        stats: Callable[[], Mapping[str, Any]],
        series: Iterable[Series],
        const_labels: Mapping[str, str] | None = None,
    ) -> None:
        self._stats = stats
        self._series = list(series)
        self._const = dict(const_labels or {})

    @staticmethod
    def _walk(data: Mapping[str, Any], path: str) -> Any:
        value: Any = data
        for part in path.split("."):
            if not isinstance(value, Mapping) or part not in value:
                return None
            value = value[part]
        return value

    def collect(self) -> Iterable[Any]:
        try:
            data = self._stats()
        except Exception:  # a broken stats() must not break the scrape of everything else
            logger.exception("stats callback failed during a metrics scrape")
            return
        const_names = list(self._const)
        const_values = list(self._const.values())
        for s in self._series:
            value = self._walk(data, s.path)
            if value is None:
                continue
            labels = const_names + ([s.label] if s.label else []) + list(s.labels)
            family: Any
            if s.kind == "counter":
                family = CounterMetricFamily(s.name, s.help, labels=labels)
            else:
                family = GaugeMetricFamily(s.name, s.help, labels=labels)
            if s.labels:
                if isinstance(value, Mapping):
                    for key, v in value.items():
                        parts = key if isinstance(key, tuple) else (key,)
                        if len(parts) == len(s.labels):
                            family.add_metric([*const_values, *map(str, parts)], float(v))
            elif s.label:
                if isinstance(value, Mapping):
                    for key, v in value.items():
                        family.add_metric([*const_values, str(key)], float(v))
            elif isinstance(value, bool | int | float):
                family.add_metric(const_values, float(value))
            else:
                continue
            yield family


def add_process_metrics(registry: CollectorRegistry) -> None:
    """The standard ``process_*`` series (memory, CPU, open and max fds, start time).

    Read from /proc at scrape time; a registry that has them already is left as it is.
    """
    with contextlib.suppress(ValueError):  # "Duplicated timeseries": an earlier server's
        ProcessCollector(registry=registry)


class MetricsServer:
    """The ``/metrics`` HTTP endpoint of one service, on its own thread.

    It serves the service's registry plus the ``process_*`` series, and says
    where it listens in one INFO line (a standalone service's metrics port is
    random by default).
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        add_process_metrics(registry)
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port = int(self._server.server_port)
        logger.info("metrics on http://%s/metrics", self.address)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        """Stop serving and join the thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
