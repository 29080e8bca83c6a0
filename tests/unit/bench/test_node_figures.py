"""bench/node_figures.py: what a node's metrics pages say about the calls between two scrapes."""

from __future__ import annotations

from kvmesh.bench.node_figures import accumulate, describe, figures, parse


def _page(
    calls: int, seconds: float, copies: int, copy_s: float, copy_bytes: int, ahead: int = 0
) -> str:
    return "\n".join(
        [
            "# HELP kvmesh_rpc_latency_seconds Latency.",
            "# TYPE kvmesh_rpc_latency_seconds histogram",
            f'kvmesh_rpc_latency_seconds_count{{method="Retrieve",service="node"}} {calls}',
            f'kvmesh_rpc_latency_seconds_sum{{method="Retrieve",service="node"}} {seconds}',
            'kvmesh_rpc_latency_seconds_count{method="Lookup",service="node"} 4.0',
            'kvmesh_rpc_latency_seconds_sum{method="Lookup",service="node"} 0.002',
            f'kvmesh_storage_copies_total{{direction="retrieve"}} {copies}',
            f'kvmesh_storage_copy_seconds_total{{direction="retrieve"}} {copy_s}',
            f'kvmesh_storage_copy_bytes_total{{direction="retrieve"}} {copy_bytes}',
            'kvmesh_storage_copies_total{direction="store"} 7.0',
            f"kvmesh_gateway_retrieves_ahead_total {ahead}",
            f"kvmesh_gateway_retrieves_joined_total {max(ahead - 1, 0)}",
            'a_label_with_a_quote{name="a \\"b\\" c"} 1.0',
            'not_a_number{x="1"} NaN-ish',
        ]
    )


def test_parse_keeps_labels_apart_and_skips_comments_and_junk() -> None:
    samples = parse(_page(2, 0.01, 2, 0.004, 32_000_000))
    assert samples[("kvmesh_storage_copies_total", (("direction", "retrieve"),))] == 2
    assert samples[("kvmesh_storage_copies_total", (("direction", "store"),))] == 7
    assert samples[("a_label_with_a_quote", (("name", 'a \\"b\\" c'),))] == 1
    assert not any(name == "not_a_number" for name, _ in samples)


def test_figures_are_the_calls_between_two_scrapes() -> None:
    before = parse(_page(2, 0.010, 2, 0.004, 32_000_000))
    after = parse(_page(6, 0.034, 6, 0.020, 96_000_000))
    node = figures(before, after)
    assert node["retrieve"] == {
        "calls": 4,
        "handler_ms_mean": 6.0,
        "handler_ms_at_most": None,  # these pages have no buckets
        "started_ahead": 0,
        "joined": 0,
        "copies": 4,
        "copy_ms_mean": 4.0,
        "copy_mb_mean": 16.0,
        "copy_gb_s": 4.0,
    }
    # Nothing changed for lookups and stores between the scrapes: no mean to report.
    assert node["lookup"] == {"calls": 0, "handler_ms_mean": None, "handler_ms_at_most": None}
    assert node["store"]["calls"] == 0
    assert node["store"]["copy_gb_s"] is None
    assert describe(node) == (
        "node handlers: retrieve 4× 6.0 ms (copy 4.0 ms of 16.0 MB, 4.0 GB/s)"
    )
    assert describe(figures(before, before)) == "node handlers: no calls"


def test_loads_started_ahead_and_the_retrieves_that_joined_them_are_counted() -> None:
    before = parse(_page(2, 0.010, 2, 0.004, 32_000_000, ahead=1))
    after = parse(_page(6, 0.034, 6, 0.020, 96_000_000, ahead=4))
    node = figures(before, after)
    assert (node["retrieve"]["started_ahead"], node["retrieve"]["joined"]) == (3, 3)
    assert describe(node) == (
        "node handlers: retrieve 4× 6.0 ms, 3 joined a load started ahead "
        "(copy 4.0 ms of 16.0 MB, 4.0 GB/s)"
    )


def test_accumulate_sums_the_phases_of_several_rounds() -> None:
    pages = [parse(_page(n, 0.005 * n, n, 0.002 * n, 8_000_000 * n)) for n in (0, 1, 3, 6)]
    total: dict = {}
    accumulate(total, pages[0], pages[1])  # round 1: one retrieve
    accumulate(total, pages[2], pages[3])  # round 2: three (what ran between is left out)
    node = figures({}, total)
    assert node["retrieve"]["calls"] == 4
    assert node["retrieve"]["copy_ms_mean"] == 2.0
    assert node["retrieve"]["copy_mb_mean"] == 8.0


def _lag_page(buckets: dict[str, float]) -> str:
    lines = [
        f'kvmesh_event_loop_lag_seconds_bucket{{le="{le}",service="node"}} {n}'
        for le, n in buckets.items()
    ]
    lines.append(f'kvmesh_event_loop_lag_seconds_count{{service="node"}} {buckets["+Inf"]}')
    return "\n".join(lines)


def test_the_event_loop_late_wake_ups_between_two_scrapes() -> None:
    before = parse(
        _lag_page({"0.005": 90, "0.02": 98, "0.05": 99, "0.1": 100, "1.0": 100, "+Inf": 100})
    )
    # 400 more wake-ups: 380 under 20 ms late, 12 at 20-50 ms, 4 at 50-100 ms, 4 at 0.1-1 s.
    after = parse(
        _lag_page({"0.005": 470, "0.02": 478, "0.05": 491, "0.1": 496, "1.0": 500, "+Inf": 500})
    )
    loop = figures(before, after)["loop"]
    assert loop == {"wake_ups": 400, "late_20ms": 20, "late_100ms": 4, "longest_at_most_ms": 1000.0}
    assert describe(figures(before, after)).endswith(
        "; event loop late ≥ 20 ms 20×, ≥ 100 ms 4× (longest ≤ 1000.0 ms)"
    )


def test_no_loop_series_means_no_loop_figures() -> None:
    page = parse(_page(2, 0.010, 2, 0.004, 32_000_000))
    loop = figures(page, page)["loop"]
    assert loop == {"wake_ups": 0, "late_20ms": 0, "late_100ms": 0, "longest_at_most_ms": None}
    assert "event loop" not in describe(figures(page, page))


def _store_page(calls: int, seconds: float, copies: int, copy_s: float, waits: int) -> str:
    return "\n".join(
        [
            f'kvmesh_rpc_latency_seconds_count{{method="Store",service="node"}} {calls}',
            f'kvmesh_rpc_latency_seconds_sum{{method="Store",service="node"}} {seconds}',
            f'kvmesh_storage_copies_total{{direction="store"}} {copies}',
            f'kvmesh_storage_copy_seconds_total{{direction="store"}} {copy_s}',
            f'kvmesh_storage_copy_bytes_total{{direction="store"}} {copies * 4_000_000}',
            f"kvmesh_storage_l1_growth_waits_total {waits}",
        ]
    )


def test_store_calls_that_waited_for_l1_to_grow_are_counted() -> None:
    before = parse(_store_page(1, 0.01, 1, 0.002, 1))
    after = parse(_store_page(5, 0.41, 5, 0.010, 3))
    node = figures(before, after)
    assert node["store"]["growth_waits"] == 2
    assert describe(node) == (
        "node handlers: store 4× 100.0 ms, 2 waited for L1 to grow "
        "(copy 2.0 ms of 4.0 MB, 2.0 GB/s)"
    )
    # No growth between the scrapes: nothing said about it.
    assert "grow" not in describe(figures(after, after | parse(_store_page(6, 0.42, 6, 0.012, 3))))


def _latency_page(method: str, buckets: dict[str, float]) -> str:
    series = f'method="{method}",service="node"'
    lines = [
        f'kvmesh_rpc_latency_seconds_bucket{{le="{le}",{series}}} {n}' for le, n in buckets.items()
    ]
    lines.append(f"kvmesh_rpc_latency_seconds_count{{{series}}} {buckets['+Inf']}")
    lines.append(f"kvmesh_rpc_latency_seconds_sum{{{series}}} {0.01 * buckets['+Inf']}")
    return "\n".join(lines)


def test_the_slowest_call_between_two_scrapes_is_bounded_by_its_bucket() -> None:
    before = parse(
        "\n".join(
            [
                _latency_page("Retrieve", {"0.005": 5, "0.01": 5, "0.025": 6, "0.1": 6, "+Inf": 6}),
                _latency_page("Lookup", {"0.005": 9, "0.01": 9, "0.025": 9, "0.1": 9, "+Inf": 9}),
            ]
        )
    )
    # Four more loads: three under 5 ms, one of 25-100 ms (the mean alone hides it).
    after = parse(
        "\n".join(
            [
                _latency_page(
                    "Retrieve", {"0.005": 8, "0.01": 8, "0.025": 9, "0.1": 10, "+Inf": 10}
                ),
                _latency_page("Lookup", {"0.005": 9, "0.01": 9, "0.025": 9, "0.1": 9, "+Inf": 11}),
            ]
        )
    )
    node = figures(before, after)
    assert node["retrieve"]["handler_ms_at_most"] == 100.0
    assert describe(node) == (
        "node handlers: lookup 2× 10.0 ms; retrieve 4× 10.0 ms (slowest ≤ 100.0 ms)"
    )
    # Two lookups beyond the last bound: no bound to give.
    assert node["lookup"]["calls"] == 2
    assert node["lookup"]["handler_ms_at_most"] is None
    assert figures(after, after)["retrieve"]["handler_ms_at_most"] is None
