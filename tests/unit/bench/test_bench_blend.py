"""``kvmesh bench blend`` end to end on a small random-weight Llama (its default is SmolLM2)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.bench import blend
from kvmesh.bench.blend_corpus import first_river
from kvmesh.cli.main import bench_parser
from kvmesh.engine.vllm.model import make_tiny_model
from tests.support.waiting import wait_until

SMALL = ["--documents", "3", "--docs-per-prompt", "2", "--prompts", "2", "--sentences", "3"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_every_arrangement_is_measured_and_ratio_one_is_exact(tiny_folder: Path) -> None:
    args = bench_parser("blend", blend).parse_args(
        ["--model", str(tiny_folder), *SMALL, "--generate", "4", "--quiet", "--no-vllm"]
    )
    result = blend.run(args)
    rows = result["arrangements"]
    assert set(rows) == {"full_prefill", "prefix_only", "blend_0", "blend_0_15", "blend_1"}
    for row in rows.values():
        assert set(row) >= {"ttft_mean_ms", "reused_token_fraction", "greedy_agreement"}
        assert row["ttft_mean_ms"] > 0
    assert rows["full_prefill"]["reused_token_fraction"] == 0
    assert rows["full_prefill"]["greedy_agreement"] == 1.0
    assert rows["full_prefill"]["first_token_kl"] == 0.0
    assert rows["full_prefill"]["answer_agreement"] == 1.0
    for row in rows.values():
        assert 0.0 <= row["answer_accuracy"] <= 1.0
    # Ratio 1 recomputes everything through the blend path: the full prefill's tokens.
    assert rows["blend_1"]["greedy_agreement"] == 1.0
    assert rows["blend_1"]["first_token_kl"] == 0.0
    assert rows["blend_1"]["answer_agreement"] == 1.0
    assert rows["blend_1"]["reused_token_fraction"] == 0
    reused = [rows[name]["reused_token_fraction"] for name in ("blend_0", "blend_0_15")]
    assert reused[0] > reused[1] > rows["prefix_only"]["reused_token_fraction"] > 0
    assert result["not_run"] == {"reorder_vllm": "--no-vllm"}
    assert result["model"] == str(tiny_folder)
    table = blend.format_table(result)
    for name in rows:
        assert name in table
    json.dumps(result)  # the --json output is plain JSON


@pytest.mark.parametrize(
    ("text", "river"),
    [
        ("Elsby is located on the river Nidd, a tributary of the Wear.", "Nidd"),
        ("The Wear, not the Nidd.", "Wear"),
        ("It lies on the Niddle, near Esker.", None),  # whole words only
        ("", None),
    ],
)
def test_the_answer_is_the_first_river_the_text_names(text: str, river: str | None) -> None:
    assert first_river(text) == river


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--prompts", "0"], "--prompts must be >= 1"),
        (["--documents", "2", "--docs-per-prompt", "3"], "--docs-per-prompt must be <= "),
        (["--check-layer", "4"], r"--check-layer must be in \[0, 4\)"),
    ],
)
def test_bad_options_are_refused_by_name(
    tiny_folder: Path, options: list[str], message: str
) -> None:
    args = bench_parser("blend", blend).parse_args(["--model", str(tiny_folder), *options])
    with pytest.raises(SystemExit, match=message):
        blend.run(args)


def test_the_cli_names_a_model_it_cannot_find(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "bench", "blend", "--model", str(tmp_path / "none")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "neither a directory nor a model name" in done.stderr, done.stderr


def _blend_dirs() -> set[Path]:
    return set(Path("/dev/shm").glob("kvmesh-bench-blend-*"))


def _users(shm: Path) -> list[int]:
    """Processes whose command line names ``shm`` (the benchmark's node)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(shm).encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            continue
    return found


def test_sigterm_stops_the_node_it_started_and_leaves_no_shared_memory(
    tiny_folder: Path, tmp_path: Path
) -> None:
    before = _blend_dirs()
    bench = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.cli", "bench", "blend", "--model", str(tiny_folder),
         *SMALL, "--no-vllm", "--quiet"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: bool(_blend_dirs() - before) or bench.poll() is not None, 120)
        assert bench.poll() is None, bench.communicate()[1][-2000:]
        (mine,) = _blend_dirs() - before
        wait_until(lambda: bool(_users(mine)) or bench.poll() is not None, 60)
        assert _users(mine), "the benchmark's node never started"
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 128 + signal.SIGTERM
        assert not mine.exists()
        assert _users(mine) == []  # the node it started is gone too
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()


@pytest.mark.parametrize(
    ("flag", "extra"), [("--oracle", "oracle_0_3"), ("--deviation", "deviation_0_3")]
)
def test_extra_rules_blend_each_ratio_between_0_and_1_with_their_own_rows(
    tiny_folder: Path, flag: str, extra: str
) -> None:
    """--oracle (rows from the full prefill), --deviation (CacheBlend's own rule)."""
    args = bench_parser("blend", blend).parse_args(
        ["--model", str(tiny_folder), *SMALL, "--generate", "4", "--quiet", "--no-vllm",
         "--ratios", "0,0.3,1", flag]
    )  # fmt: skip
    rows = blend.run(args)["arrangements"]
    assert set(rows) == {"full_prefill", "prefix_only", "blend_0", "blend_0_3", "blend_1", extra}
    # The same share of the cached rows is recomputed, only chosen otherwise.
    assert rows[extra]["reused_token_fraction"] == rows["blend_0_3"]["reused_token_fraction"]
    assert rows[extra]["ttft_mean_ms"] > 0
    assert 0.0 <= rows[extra]["greedy_agreement"] <= 1.0
