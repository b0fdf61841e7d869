"""Reinforcement-learning metrics: the verifier reward of each finished trajectory and its staleness.

A rollout worker calls ``record_reward`` when a trajectory is scored; the learner calls ``record_staleness``
when it trains on a trajectory. Both histograms are the catalogue's (``metric_names.RL_REWARD`` and
``RL_STALENESS``), so dashboards, alert rules and the Prometheus names stay in step with the code.

Design decisions:

- One ``RLMetrics`` per process, built from the process's ``Telemetry`` (or any meter): instruments are
  created once, not per call (the SDK warns on every duplicate), and without telemetry the no-op meter makes
  every call free.
- Bad numbers are the caller's bug, not data: a reward outside [0, 1] (the verifiers' range), a negative or
  non-integer staleness, or a NaN raise ``ValueError`` instead of skewing the histograms silently.
- Staleness is counted in weight versions: the learner's version when it trains minus the oldest policy
  version that generated a token of the trajectory (partial rollouts span versions; the oldest bounds the
  off-policy error, which is what AReaL's admission rule caps).
"""

from __future__ import annotations

import math

from opentelemetry import metrics

from k3.services.common import metric_names as mn
from k3.services.common.telemetry import Telemetry


class RLMetrics:
    """The RL histograms on one meter."""

    def __init__(self, meter: metrics.Meter | None = None):
        meter = meter or metrics.NoOpMeterProvider().get_meter("k3")
        self._reward = mn.RL_REWARD.instrument(meter)
        self._staleness = mn.RL_STALENESS.instrument(meter)

    @classmethod
    def from_telemetry(cls, telemetry: Telemetry | None) -> RLMetrics:
        """Instruments on ``telemetry``'s meter (no-op when it is None or records no metrics)."""
        return cls(telemetry.meter() if telemetry is not None and telemetry.metrics else None)

    def record_reward(self, reward: float, task: str = "") -> None:
        """One finished trajectory's verifier reward, in [0, 1]; ``task`` names the task family."""
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward) \
                or not 0.0 <= reward <= 1.0:
            raise ValueError(f"reward must be a number in [0, 1], got {reward!r}")
        if not isinstance(task, str):
            raise ValueError(f"task must be a string, got {type(task).__name__}")
        self._reward.record(float(reward), {"task": task})  # "" (no task) is an absent label to PromQL

    def record_staleness(self, learner_version: int, oldest_token_version: int) -> int:
        """Versions between generating a trajectory (its oldest token) and learning from it; returns them."""
        for name, value in (("learner_version", learner_version), ("oldest_token_version", oldest_token_version)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        staleness = learner_version - oldest_token_version
        if staleness < 0:
            raise ValueError(f"the trajectory's version {oldest_token_version} is newer than the learner's "
                             f"{learner_version}")
        self._staleness.record(staleness)
        return staleness
