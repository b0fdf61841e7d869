"""Latency seen by clients: time to first token (TTFT) and time per output token (TPOT), per request.

Design decisions:

- Measured at the router, because only it sees a request from arrival to the last token: TTFT starts when the
  request reaches the pipeline (admission waits included -- a client waits through them too) and ends when
  the first generated token arrives from the decode worker, right before it is sent on. TPOT is the time from
  the first to the last token divided by the tokens after the first, so a request with one token has no TPOT.
- Only requests that produced a token are recorded: a refused or failed request has no first token, and
  counting it as a fast one would hide the failure (errors are in ``rpc.server.requests`` by status).
- The histograms are the catalogue's (``metric_names.TTFT`` / ``TPOT``) with the ``k3.request.kind``
  attribute (generate or chat), so the planner's TTFT query and the dashboards read exactly these.
"""

from __future__ import annotations

import time

from opentelemetry import metrics

from k3.services.common import metric_names as mn


class LatencyRecorder:
    """The TTFT and TPOT histograms; ``start`` one ``RequestClock`` per request."""

    def __init__(self, meter: metrics.Meter | None = None):
        meter = meter or metrics.NoOpMeterProvider().get_meter("k3")
        self._ttft = mn.TTFT.instrument(meter)
        self._tpot = mn.TPOT.instrument(meter)

    def start(self, kind: str) -> RequestClock:
        return RequestClock(self, kind)


class RequestClock:
    """The token timings of one request, recorded once by ``finish``."""

    def __init__(self, recorder: LatencyRecorder, kind: str):
        self._recorder = recorder
        self._attributes = {"k3.request.kind": kind}
        self.started = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self._done = False

    def tokens_arrived(self, count: int) -> None:
        """``count`` generated tokens arrived now (0 is ignored: a message without tokens)."""
        if count <= 0:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += count

    def finish(self) -> None:
        """Record TTFT (and TPOT with two or more tokens); idempotent, nothing without a token."""
        if self._done or self.first is None:
            return
        self._done = True
        self._recorder._ttft.record(self.first - self.started, self._attributes)
        if self.tokens > 1:
            self._recorder._tpot.record((self.last - self.first) / (self.tokens - 1), self._attributes)
