"""TTFT and TPOT as the router records them, on a controlled clock, read back through an in-memory reader."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from k3.services.common import metric_names as mn
from k3.services.router import latency


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def recorder(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(latency.time, "monotonic", clock)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    yield latency.LatencyRecorder(provider.get_meter("k3")), clock, reader
    provider.shutdown()


def histograms(reader) -> dict[tuple[str, str], tuple[int, float]]:
    """(metric, request kind) -> (count, sum)."""
    out = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for point in metric.data.data_points:
                    out[(metric.name, point.attributes["k3.request.kind"])] = (point.count, point.sum)
    return out


def test_ttft_counts_from_arrival_and_tpot_spreads_over_the_later_tokens(recorder):
    rec, clock, reader = recorder
    request = rec.start("chat")
    clock.now += 0.5          # admission and prefill
    request.tokens_arrived(0)  # a message without tokens does not count as the first token
    clock.now += 0.25
    request.tokens_arrived(1)  # first token at +0.75
    clock.now += 0.3
    request.tokens_arrived(2)
    clock.now += 0.3
    request.tokens_arrived(2)  # last token at +1.35: 4 tokens after the first in 0.6 s
    request.finish()
    request.finish()          # recorded once
    got = histograms(reader)
    assert got[(mn.TTFT.name, "chat")][0] == 1 and got[(mn.TTFT.name, "chat")][1] == pytest.approx(0.75)
    assert got[(mn.TPOT.name, "chat")][0] == 1 and got[(mn.TPOT.name, "chat")][1] == pytest.approx(0.15)


def test_one_token_has_no_tpot_and_no_token_records_nothing(recorder):
    rec, clock, reader = recorder
    single = rec.start("generate")
    clock.now += 0.2
    single.tokens_arrived(1)
    single.finish()
    refused = rec.start("generate")
    refused.finish()
    got = histograms(reader)
    assert got[(mn.TTFT.name, "generate")] == (1, pytest.approx(0.2))
    assert (mn.TPOT.name, "generate") not in got
