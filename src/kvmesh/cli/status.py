"""``kvmesh status``: the fleet as the coordinator sees it, as tables (or JSON).

Instances and their incarnations, each emitter's ingest cursor and gap flag,
keys and bytes per tier and per salt, declared capacities and quotas, and
what the nodes answered to the coordinator's commands (counts per command
and result, the latest refusals with the node's reason) — all read over the
coordinator's gRPC APIs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import grpc

from kvmesh.api.common.v1 import common_pb2
from kvmesh.api.coordinator.v1 import admin_pb2, directory_pb2, membership_pb2, policy_pb2
from kvmesh.cli import fleetfile
from kvmesh.cli.plainjson import plain
from kvmesh.coordinator.client import DirectoryClient, MembershipClient
from kvmesh.coordinator.operator_client import AdminClient, PolicyClient
from kvmesh.rpc.client import create_channel

DEFAULT_COORDINATOR = "127.0.0.1:8300"
#: What ``kvmesh status`` shows of each node's gateway, read off its /metrics.
GATEWAY_SERIES = {
    "kvmesh_gateway_registered_engines": "engines",
    "kvmesh_gateway_engines_reaped_total": "engines_reaped",
    "kvmesh_gateway_reregistrations_total": "reregistrations",
    "kvmesh_gateway_live_owners": "live_owners",
    "kvmesh_gateway_active_sessions": "sessions",
}
TIER_NAMES = {common_pb2.TIER_L1: "L1", common_pb2.TIER_L2: "L2"}


def _bytes(n: float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain fixed-width text table."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def collect(target: str, timeout: float = 5.0) -> dict[str, Any]:
    """Everything ``kvmesh status`` shows, as protobuf responses."""
    channel = create_channel(target)
    try:
        admin = AdminClient(target, channel=channel)
        directory = DirectoryClient(target, channel=channel)
        membership = MembershipClient(target, channel=channel)
        policy = PolicyClient(target, channel=channel)
        return {
            "status": admin.get_status(admin_pb2.GetStatusRequest(), timeout=timeout),
            "instances": membership.list_instances(
                membership_pb2.ListInstancesRequest(), timeout=timeout
            ),
            "cursors": directory.list_ingest_cursors(
                directory_pb2.ListIngestCursorsRequest(), timeout=timeout
            ),
            "stats": directory.get_stats(directory_pb2.GetStatsRequest(), timeout=timeout),
            "usage": policy.get_usage(policy_pb2.GetUsageRequest(), timeout=timeout),
            "quotas": policy.list_quotas(
                policy_pb2.ListQuotasRequest(tier=common_pb2.TIER_L2), timeout=timeout
            ),
            "default_quota": policy.get_default_quota(
                policy_pb2.GetDefaultQuotaRequest(tier=common_pb2.TIER_L2), timeout=timeout
            ),
        }
    finally:
        channel.close()


#: Responses that are one list: ``--json`` prints the list under the section's name
#: (``"instances": [...]``, not ``"instances": {"instances": [...]}``).
_LISTS = {"instances": "instances", "cursors": "cursors"}


def as_json(data: dict[str, Any]) -> dict[str, Any]:
    """What ``kvmesh status --json`` prints for :func:`collect`'s responses."""
    out: dict[str, Any] = {}
    for name, message in data.items():
        section = plain(message)
        inner = _LISTS.get(name)
        out[name] = section[inner] if inner is not None else section
    return out


def render(data: dict[str, Any], target: str) -> str:
    """The tables."""
    status: admin_pb2.GetStatusResponse = data["status"]
    out = [
        f"coordinator {target}  version {status.version}  ready {status.ready}  "
        f"chunk size {status.chunk_size}  keys {status.num_keys}  "
        f"batches admitted {status.batches_admitted} / duplicate {status.batches_duplicate} "
        f"/ stale {status.batches_stale}",
    ]
    if status.HasField("nats"):
        n = status.nats
        out.append(
            f"NATS stream {n.stream}: {'connected' if n.connected else 'NOT connected'}, "
            f"next seq {n.next_seq}, {n.pending} pending (lag), {n.applied} applied, "
            f"{n.skipped} skipped"
        )
    out += ["", "Instances"]
    cursors = {c.instance_id: c for c in data["cursors"].cursors}
    rows = []
    for inst in data["instances"].instances:
        c = cursors.get(inst.instance_id)
        rows.append(
            [
                inst.instance_id,
                inst.incarnation,
                f"{inst.heartbeat_age_seconds:.1f} s",
                "yes" if inst.stream_connected else "no",
                c.last_seq if c else "-",
                ("GAP" if c.gap_detected else "ok") if c else "-",
                inst.endpoints.storage_address or "-",
            ]
        )
    out.append(
        table(
            ["instance", "incarnation", "heartbeat", "stream", "last seq", "gap", "storage"], rows
        )
        if rows
        else "  (none registered)"
    )
    out += ["", "Ingest cursors"]
    rows = [
        [
            c.instance_id,
            c.incarnation,
            c.last_seq,
            "GAP" if c.gap_detected else "ok",
            c.batches_admitted,
            c.batches_duplicate,
            c.batches_stale,
        ]
        for c in data["cursors"].cursors
    ]
    out.append(
        table(["emitter", "incarnation", "last seq", "gap", "admitted", "duplicate", "stale"], rows)
        if rows
        else "  (no events yet)"
    )
    stats: directory_pb2.GetStatsResponse = data["stats"]
    out += [
        "",
        "Directory",
        table(
            ["tier", "placements", "bytes"],
            [
                ["L1", stats.l1_placements, _bytes(stats.l1_size_bytes)],
                ["L2", stats.l2_placements, _bytes(stats.l2_size_bytes)],
            ],
        ),
        "",
        "Usage per instance",
    ]
    rows = []
    for inst in data["usage"].instances:
        for m in inst.modules:
            ratio = f"{m.usage_ratio:.1%}" if m.HasField("usage_ratio") else "-"
            rows.append(
                [
                    inst.instance_id,
                    TIER_NAMES.get(m.tier, "?"),
                    m.backend,
                    _bytes(m.used_bytes),
                    _bytes(m.capacity_bytes) if m.capacity_bytes else "-",
                    ratio,
                ]
            )
    for m in data["usage"].shared_modules:
        ratio = f"{m.usage_ratio:.1%}" if m.HasField("usage_ratio") else "-"
        rows.append(
            [
                "(shared)",
                TIER_NAMES.get(m.tier, "?"),
                m.backend,
                _bytes(m.used_bytes),
                _bytes(m.capacity_bytes) if m.capacity_bytes else "-",
                ratio,
            ]
        )
    out.append(
        table(["instance", "tier", "backend", "used", "capacity", "ratio"], rows)
        if rows
        else "  (nothing stored)"
    )
    out += ["", "Usage per salt and quotas"]
    quotas = {q.cache_salt: q for q in data["quotas"].quotas}
    rows = []
    for s in data["usage"].salts:
        q = quotas.get(s.cache_salt)
        limit = "-"
        if s.tier == common_pb2.TIER_L2 and q is not None and q.HasField("limit_bytes"):
            limit = _bytes(q.limit_bytes)
        rows.append(
            [s.cache_salt or '""', TIER_NAMES.get(s.tier, "?"), _bytes(s.used_bytes), limit]
        )
    for salt, q in quotas.items():
        if not any(s.cache_salt == salt for s in data["usage"].salts) and q.HasField("limit_bytes"):
            rows.append([salt or '""', "L2", _bytes(0), _bytes(q.limit_bytes)])
    default = data["default_quota"]
    out.append(
        table(["salt", "tier", "used", "quota"], rows) if rows else "  (no salts with bytes)"
    )
    out.append(
        "default L2 quota: "
        + (_bytes(default.limit_bytes) if default.HasField("limit_bytes") else "none (exempt)")
    )
    out += _commands(status)
    return "\n".join(out)


def _commands(status: admin_pb2.GetStatusResponse) -> list[str]:
    """The nodes' answers to the coordinator's commands, and the latest refusals."""
    out = [
        "",
        f"Node commands ({status.commands_awaiting_answer} awaiting an answer, "
        f"{status.resyncs_requested} resyncs asked)",
    ]
    rows = [[c.command, c.result, c.count] for c in status.command_results]
    out.append(table(["command", "result", "count"], rows) if rows else "  (no answers yet)")
    failures = status.recent_command_failures
    refused = sum(c.count for c in status.command_results if c.result != "OK")
    if refused:
        out += ["", f"REFUSED node commands: {refused} (latest first)"]
        out.append(
            table(
                ["when", "instance", "command", "what", "code", "message"],
                [
                    [
                        f.answered_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"),
                        f.instance_id,
                        f.command,
                        f.summary or "-",
                        f.code,
                        f.message or "-",
                    ]
                    for f in failures
                ],
            )
        )
    return out


def add_status_command(sub: Any) -> None:
    """Register ``kvmesh status``."""
    p = sub.add_parser(
        "status",
        help="show the fleet: instances, cursors and gap flags, usage per tier and salt, quotas",
        description="Show the fleet as the coordinator sees it.",
    )
    p.add_argument(
        "--coordinator",
        default=None,
        help="coordinator address (default: $KVMESH_COORDINATOR, else the running kvmesh up's "
        f"(found in {fleetfile.where()}), else {DEFAULT_COORDINATOR})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per call (default: 5)")
    p.set_defaults(handler=run_status)


def _coordinator(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """The coordinator to ask, where that address came from, and the running fleet's file."""
    running = fleetfile.find()
    fleet = running.data if running is not None else None
    note = running.note() if running is not None else None
    if note and not args.coordinator:
        print(note, file=sys.stderr)
    if args.coordinator:
        return args.coordinator, "--coordinator", fleet
    if os.environ.get("KVMESH_COORDINATOR"):
        return os.environ["KVMESH_COORDINATOR"], "$KVMESH_COORDINATOR", fleet
    if fleet is not None and fleet.get("coordinator"):
        return str(fleet["coordinator"]), fleetfile.describe(running), fleet
    return DEFAULT_COORDINATOR, f"the default; {fleetfile.describe(running)}", fleet


def node_links(fleet: dict[str, Any] | None, timeout: float) -> list[dict[str, Any]]:
    """Each storage node of the fleet file: whether its link to the coordinator is up.

    Asked of the nodes themselves (StorageService/GetStatus), so it shows even
    when the coordinator cannot be reached.
    """
    from kvmesh.api.storage.v1 import storage_pb2
    from kvmesh.storage.client import StorageClient

    async def ask(name: str, target: str) -> dict[str, Any]:
        client = StorageClient(target)
        try:
            resp = await client.get_status(storage_pb2.GetStatusRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            return {"node": name, "storage": target, "reachable": False, "error": exc.details()}
        finally:
            await client.close()
        linked = resp.HasField("emitter")
        return {
            "node": name,
            "storage": target,
            "reachable": True,
            "instance_id": resp.instance_id,
            "coordinator_connected": bool(resp.emitter.connected) if linked else None,
            "unacked_batches": int(resp.emitter.unacked_batches) if linked else 0,
            "leases": {
                "active": int(resp.leases.active),
                "held_locks": int(resp.leases.held_locks),
                "expired": int(resp.leases.expired),
                "ended_by_owner": int(resp.leases.ended_by_owner),
            },
            "p2p": plain(resp.p2p),
        }

    async def ask_all() -> list[dict[str, Any]]:
        nodes = [n for n in (fleet or {}).get("nodes") or [] if n.get("storage")]
        links = list(await asyncio.gather(*(ask(n["name"], n["storage"]) for n in nodes)))
        gateways = await asyncio.gather(
            *(
                asyncio.to_thread(gateway_counters, n.get("gateway_metrics", ""), timeout)
                for n in nodes
            )
        )
        for link, counters in zip(links, gateways, strict=True):
            link["gateway"] = counters
        return links

    return asyncio.run(ask_all())


def gateway_counters(metrics: str, timeout: float) -> dict[str, int] | None:
    """A gateway's engines, reaps, re-registrations and sessions (None: no answer)."""
    import urllib.error
    import urllib.request

    if not metrics:
        return None
    try:
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=timeout) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError, ValueError):
        return None
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in GATEWAY_SERIES:
            found[GATEWAY_SERIES[name]] = int(float(value))
    return found


def render_links(links: list[dict[str, Any]]) -> str:
    """The nodes' view of their coordinator link, as a table."""
    rows = []
    for link in links:
        if not link["reachable"]:
            state = f"node NOT reachable: {link['error']}"
        elif link["coordinator_connected"] is None:
            state = "no coordinator configured"
        elif link["coordinator_connected"]:
            state = "connected"
        else:
            state = f"NOT connected ({link['unacked_batches']} event batches waiting)"
        rows.append(
            [
                link["node"],
                link["storage"],
                state,
                _p2p_cell(link.get("p2p")),
                _engines_cell(link.get("gateway")),
                _leases_cell(link.get("leases")),
            ]
        )
    return table(
        [
            "node",
            "storage",
            "coordinator link (as the node sees it)",
            "P2P in / out",
            "engines (reaped, re-registered) / sessions",
            "lookup leases / locks held",
        ],
        rows,
    )


def _leases_cell(leases: dict[str, int] | None) -> str:
    """A node's lookup leases alive and the read locks they hold."""
    if not leases:
        return "-"
    return f"{leases['active']} / {leases['held_locks']}"


def _engines_cell(gateway: dict[str, int] | None) -> str:
    """A node gateway's engines: registered (reaped, re-registered so far) / open sessions."""
    if not gateway:
        return "-"
    return (
        f"{gateway.get('engines', 0)} ({gateway.get('engines_reaped', 0)}, "
        f"{gateway.get('reregistrations', 0)}) / {gateway.get('sessions', 0)}"
    )


def _p2p_cell(p2p: dict[str, Any] | None) -> str:
    """A node's P2P traffic: chunks and bytes fetched from / served to peers, the transport."""
    if not p2p:
        return "-"
    fetched = f"{int(p2p['fetched_chunks'])} ({_bytes(int(p2p['fetched_bytes']))})"
    served = f"{int(p2p['served_chunks'])} ({_bytes(int(p2p['served_bytes']))})"
    state = p2p["transport"] if p2p["enabled"] else f"{p2p['transport']}, fetch off"
    failures = int(p2p["fetch_failures"])
    return f"{fetched} / {served} [{state}" + (f", {failures} failed]" if failures else "]")


def run_status(args: argparse.Namespace) -> int:
    """Handler of ``kvmesh status``."""
    target, source, fleet = _coordinator(args)
    args.coordinator = target
    links = node_links(fleet, min(args.timeout, 2.0)) if fleet else []
    try:
        data = collect(args.coordinator, args.timeout)
    except grpc.RpcError as exc:
        print(
            f"kvmesh status: error: cannot reach the coordinator at {target} (from {source}): "
            f"{exc.code().name}; give --coordinator ADDR or set KVMESH_COORDINATOR",
            file=sys.stderr,
        )
        if links:
            print(render_links(links), file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(as_json(data) | ({"nodes": links} if links else {}), indent=2))
    else:
        out = render(data, args.coordinator)
        if links:
            out += "\n\nNodes of the fleet file\n" + render_links(links)
        print(out)
    return 0
