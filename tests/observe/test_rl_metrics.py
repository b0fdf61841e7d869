"""The RL metrics helper through a real Prometheus endpoint: reward and staleness histograms, bad numbers refused."""

from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from k3.services.common import metric_names as mn
from k3.services.common.config import ServerConfig
from k3.services.common.rl_metrics import RLMetrics
from k3.services.common.telemetry import Telemetry, setup_telemetry
from k3.services.observe import free_port

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def telemetry():
    telemetry = setup_telemetry("rollout", ServerConfig(metrics_port=free_port("127.0.0.1")))
    yield telemetry
    telemetry.shutdown()


def samples(telemetry) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(telemetry.metrics_endpoint.url, timeout=5) as answer:
        families = text_string_to_metric_families(answer.read().decode())
        return {(s.name, labels(s)): s.value for f in families for s in f.samples}


def labels(sample) -> tuple[tuple[str, str], ...]:
    """The sample's own labels (the exporter adds the instrumentation scope as otel_scope_* labels)."""
    return tuple(sorted((k, v) for k, v in sample.labels.items() if not k.startswith("otel_scope_")))


def test_rewards_and_staleness_reach_the_metrics_endpoint(telemetry):
    rl = RLMetrics.from_telemetry(telemetry)
    for reward in (1.0, 0.0, 0.8):
        rl.record_reward(reward, task="arithmetic")
    rl.record_reward(0.3)
    assert rl.record_staleness(7, 7) == 0
    assert rl.record_staleness(9, 6) == 3
    got = samples(telemetry)
    reward, staleness = mn.RL_REWARD.prometheus, mn.RL_STALENESS.prometheus
    task = (("task", "arithmetic"),)
    assert got[(f"{reward}_count", task)] == 3 and math.isclose(got[(f"{reward}_sum", task)], 1.8)
    assert got[(f"{reward}_bucket", (("le", "0.75"), *task))] == 1  # 0.0 only
    assert got[(f"{reward}_bucket", (("le", "0.9"), *task))] == 2
    assert got[(f"{reward}_count", (("task", ""),))] == 1  # no task given
    assert got[(f"{staleness}_count", ())] == 2 and got[(f"{staleness}_sum", ())] == 3
    assert got[(f"{staleness}_bucket", (("le", "0.0"),))] == 1
    assert got[(f"{staleness}_bucket", (("le", "3.0"),))] == 2


def test_bad_numbers_are_refused(telemetry):
    rl = RLMetrics.from_telemetry(telemetry)
    for bad in (1.5, -0.1, float("nan"), True, "1"):
        with pytest.raises(ValueError, match=r"reward must be a number in \[0, 1\], got "):
            rl.record_reward(bad)
    with pytest.raises(ValueError, match="task must be a string, got int"):
        rl.record_reward(0.5, task=3)
    with pytest.raises(ValueError, match=r"learner_version must be an integer >= 0, got -1"):
        rl.record_staleness(-1, 0)
    with pytest.raises(ValueError, match=r"oldest_token_version must be an integer >= 0, got 2\.0"):
        rl.record_staleness(3, 2.0)
    with pytest.raises(ValueError, match=r"the trajectory's version 5 is newer than the learner's 4"):
        rl.record_staleness(4, 5)
    assert not any(name.startswith("k3_rl_") for name, _ in samples(telemetry))  # nothing half-recorded


def test_without_telemetry_recording_is_free_and_still_checked():
    rl = RLMetrics.from_telemetry(None)
    rl.record_reward(0.5)
    assert RLMetrics.from_telemetry(Telemetry()).record_staleness(2, 1) == 1
    with pytest.raises(ValueError):
        rl.record_reward(2.0)
