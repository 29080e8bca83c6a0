"""The coordinator's engine settings: --engine-events, --engine-events-file, --score-weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.common.config import ConfigError
from kvmesh.coordinator.config import CoordinatorConfig
from kvmesh.coordinator.core.engines import EngineSpec


def test_engines_from_the_flag_and_the_file_together(tmp_path: Path) -> None:
    path = tmp_path / "engines.json"
    path.write_text(json.dumps([{"engine_id": "b", "endpoint": "ipc:///tmp/b", "model_name": "m"}]))
    config = CoordinatorConfig(
        engine_events="a=tcp://h:5557, replay=tcp://h:5558, model=m, node=n-1, dp=2 ; ",
        engine_events_file=str(path),
    )
    config.validate()
    assert config.engine_specs() == [
        EngineSpec("a", "tcp://h:5557", "m", "tcp://h:5558", "n-1", "", 2),
        EngineSpec("b", "ipc:///tmp/b", "m"),
    ]
    assert (
        EngineSpec("a", "tcp://h:5557", "m", data_parallel_size=2).rank_endpoint("tcp://h:5557", 1)
        == "tcp://h:5558"
    )


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"engine_events": "a=tcp://h:1,model=m;a=tcp://h:2,model=m"}, "named twice"),
        ({"engine_events": "a=tcp://h:1"}, "model=NAME is required"),
        ({"engine_events": "a=tcp://h:1,model=m,colour=red"}, "unknown option 'colour=red'"),
        ({"engine_events": "tcp://h:1"}, "expected ID=ENDPOINT"),
        ({"engine_events": "a=tcp://h:1,model=m,dp=x"}, "dp must be a number"),
        ({"score_weights": "gpu=1"}, "unknown tier 'gpu'"),
        ({"score_weights": "l2=lots"}, "'l2=lots' is not TIER=NUMBER"),
        ({"score_weights": "engine=inf"}, "weight engine must be a finite number"),
        ({"publish_events_replay_endpoint": "tcp://*:1"}, "needs publish_events_endpoint"),
    ],
)
def test_bad_engine_settings_are_one_clear_error(settings: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        CoordinatorConfig(**settings).validate()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("not json", "not JSON"),
        ('{"engine_id": "a"}', "a JSON list of objects"),
        ('[{"engine_id": "a", "endpoint": "tcp://h:1"}]', "engine_events_file"),
        ('[{"engine_id": "a", "endpoint": "tcp://h:1", "model_name": "m", "x": 1}]', "'x'"),
    ],
)
def test_a_bad_engines_file_is_one_clear_error(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "engines.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        CoordinatorConfig(engine_events_file=str(path)).validate()
