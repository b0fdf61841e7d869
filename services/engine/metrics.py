"""Engine counters, kept as plain numbers (for ``Load`` RPCs and tests) and exported with an OpenTelemetry meter.

Counters (monotonic): ``k3.engine.tokens`` (attribute ``phase``: prompt or decode; tokens run through the
model), ``k3.engine.requests.finished`` (attribute ``finish_reason``), ``k3.engine.requests.aborted``,
``k3.engine.states.expired`` (handed-off states never claimed). Gauges, read when the meter collects:
``k3.engine.running``, ``k3.engine.queued``, ``k3.engine.parked``, ``k3.engine.free_slots``,
``k3.engine.free_pages``, ``k3.engine.kda_state_memory`` and ``k3.engine.kv_latent_memory`` (bytes of the slots
and pages held by live sequences). Names, units and kinds of the catalogued ones come from
``k3.services.common.metric_names``.

The gauges call back into the engine (``snapshot``), so what the exporter sees and what ``Engine.stats``
returns are the same numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from k3.services.common import metric_names as mn


@dataclass
class EngineStats:
    running: int
    """Sequences prefilling or decoding."""
    queued: int
    """Requests waiting for a slot or pages."""
    parked: int
    """Handed-off states waiting for their stream."""
    free_slots: int
    free_pages: int
    tokens_processed: int
    """Prompt and decode tokens run through the model since start."""
    finished: int
    aborted: int
    expired: int
    steps: int
    """Scheduler steps run."""


class EngineMetrics:
    """Thread-safe counters mirrored to OpenTelemetry instruments."""

    def __init__(self, meter: metrics.Meter | None, gauges: Callable[[], dict[str, int]]):
        meter = meter or metrics.NoOpMeterProvider().get_meter("k3")
        self._lock = threading.Lock()
        self.tokens_processed = 0
        self.finished = 0
        self.aborted = 0
        self.expired = 0
        self._tokens = mn.ENGINE_TOKENS.instrument(meter)
        self._finished = meter.create_counter("k3.engine.requests.finished", unit="{request}",
                                              description="Requests that finished generating")
        self._aborted = meter.create_counter("k3.engine.requests.aborted", unit="{request}",
                                             description="Requests stopped by abort, deadline or disconnect")
        self._expired = meter.create_counter("k3.engine.states.expired", unit="{state}",
                                             description="Handed-off states freed because no stream claimed them")
        self._gauges = gauges
        for entry in (mn.ENGINE_RUNNING, mn.ENGINE_QUEUED, mn.ENGINE_FREE_SLOTS, mn.ENGINE_FREE_PAGES,
                      mn.KDA_STATE_MEMORY, mn.KV_LATENT_MEMORY):
            entry.instrument(meter, callbacks=[self._observer(entry.name.rpartition(".")[2])])
        meter.create_observable_gauge("k3.engine.parked", callbacks=[self._observer("parked")],
                                      description="Handed-off states waiting for their stream")

    def _observer(self, name: str):
        def observe(options: CallbackOptions):
            return [Observation(self._gauges()[name])]
        return observe

    def add_tokens(self, count: int, phase: str) -> None:
        with self._lock:
            self.tokens_processed += count
        self._tokens.add(count, {"phase": phase})

    def add_finished(self, finish_reason: str) -> None:
        with self._lock:
            self.finished += 1
        self._finished.add(1, {"finish_reason": finish_reason})

    def add_aborted(self) -> None:
        with self._lock:
            self.aborted += 1
        self._aborted.add(1)

    def add_expired(self) -> None:
        with self._lock:
            self.expired += 1
        self._expired.add(1)
