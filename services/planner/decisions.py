"""How many replicas a Deployment should have: pure functions of its load, its replicas and a policy.

Nothing here reads a clock, a metric or the Kubernetes API; the planner service feeds in what it measured
and the time, and keeps the returned ``ScalerState`` for the next interval. That makes every decision
replayable in a test.

Design decisions:

- **Pressure.** Each signal becomes a ratio to its target, 1.0 meaning "exactly on target"; the pressure is
  the largest ratio (the most loaded resource decides). Throughput and queue ratios are per replica, so they
  shrink as replicas are added (``desired = ceil(current * pressure)`` lands on target, as Kubernetes' HPA
  does). An expert pool's throughput is bounded by its hottest expert, so its token rate is multiplied by
  the pool's imbalance (max/mean rows over its experts): a pool at 2x imbalance saturates at half the
  balanced rate. TTFT p95 is a latency ratio, not divided by replicas; step limits keep its effect gradual.
- **Hysteresis, against flapping.** Scale up only after ``up_intervals`` consecutive intervals above the
  high watermark, down only after ``down_intervals`` consecutive intervals below the low watermark; a
  value in between (or a missing one) resets both counts, so inputs oscillating around a threshold never
  accumulate. After any change there is a ``cooldown_s`` during which nothing changes (the new replicas
  need time to start and to show up in the metrics).
- **Scale-down never overshoots.** The target is ``ceil(current * pressure)``, which keeps the predicted
  pressure at or below 1.0 (< high watermark) for the per-replica signals; if that is not below the current
  count, nothing happens. Step limits cap each change in both directions.
- **No data, no change.** Without any signal (metrics missing, source down) the decision is to hold and
  forget the counts: an outage of the metrics pipeline must never scale a service down.
- **Bounds first.** A Deployment outside ``[min_replicas, max_replicas]`` is brought to the nearest bound at
  once, whatever the load (someone scaled it by hand or the bounds changed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from k3.services.common.config import ConfigError, documented


@dataclass(frozen=True)
class Signals:
    """One interval's measurements of one Deployment (all replicas together); ``None`` = not measured."""

    tokens_per_s: float | None = None
    """Tokens (decode) or latent rows (expert pool) processed per second, summed over replicas."""
    imbalance: float | None = None
    """Expert pools: max/mean rows over the pool's experts (1.0 = balanced)."""
    queue_length: float | None = None
    """Requests waiting, summed over replicas."""
    ttft_p95_s: float | None = None
    """95th percentile time to first token, seconds."""

    def __post_init__(self) -> None:
        for name in ("tokens_per_s", "imbalance", "queue_length", "ttft_p95_s"):
            value = getattr(self, name)
            if value is not None and (not math.isfinite(value) or value < 0):
                raise ValueError(f"signal {name} must be a finite number >= 0 or None, got {value!r}")


@dataclass
class Policy:
    """Targets, bounds and hysteresis of one Deployment. A target left at ``None`` ignores that signal."""

    min_replicas: int = documented(1, doc="Never fewer replicas than this (>= 1).")
    max_replicas: int = documented(4, doc="Never more replicas than this.")
    target_tokens_per_s: float | None = documented(
        None, doc="Tokens (or expert rows) per second one replica should process at a balanced load.")
    target_queue_length: float | None = documented(None, doc="Waiting requests per replica considered full.")
    target_ttft_p95_s: float | None = documented(None, doc="TTFT p95 in seconds considered on target.")
    high_watermark: float = documented(1.2, doc="Pressure (load / target) above which to scale up; > 1.")
    low_watermark: float = documented(0.6, doc="Pressure below which to scale down; in (0, 1).")
    up_intervals: int = documented(2, doc="Consecutive intervals above the high watermark before scaling up.")
    down_intervals: int = documented(6, doc="Consecutive intervals below the low watermark before scaling down.")
    cooldown_s: float = documented(120.0, doc="Seconds after a change during which nothing changes.")
    max_step_up: int = documented(2, doc="Most replicas added by one change.")
    max_step_down: int = documented(1, doc="Most replicas removed by one change.")

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ConfigError(f"must be >= 1, got {self.min_replicas}", field="min_replicas")
        if self.max_replicas < self.min_replicas:
            raise ConfigError(f"must be >= min_replicas ({self.min_replicas}), got {self.max_replicas}",
                              field="max_replicas")
        for name in ("target_tokens_per_s", "target_queue_length", "target_ttft_p95_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"must be > 0 or null, got {value}", field=name)
        if not self.high_watermark > 1.0:
            raise ConfigError(f"must be > 1, got {self.high_watermark}", field="high_watermark")
        if not 0.0 < self.low_watermark < 1.0:
            raise ConfigError(f"must be in (0, 1), got {self.low_watermark}", field="low_watermark")
        for name in ("up_intervals", "down_intervals", "max_step_up", "max_step_down"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        if self.cooldown_s < 0:
            raise ConfigError(f"must be >= 0, got {self.cooldown_s}", field="cooldown_s")


@dataclass(frozen=True)
class ScalerState:
    """What one Deployment's decisions remember between intervals."""

    above: int = 0
    """Consecutive intervals above the high watermark."""
    below: int = 0
    """Consecutive intervals below the low watermark."""
    last_change_s: float | None = None
    """When the last change was decided (the caller's clock, seconds)."""


@dataclass(frozen=True)
class Decision:
    current: int
    desired: int
    pressure: float | None
    reason: str
    state: ScalerState

    @property
    def changed(self) -> bool:
        return self.desired != self.current


def pressure(signals: Signals, policy: Policy, replicas: int) -> float | None:
    """The largest load/target ratio over the signals that have both a value and a target (None: none)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1 to compute a pressure, got {replicas}")
    ratios = []
    if signals.tokens_per_s is not None and policy.target_tokens_per_s is not None:
        hot = max(signals.imbalance, 1.0) if signals.imbalance is not None else 1.0
        ratios.append(signals.tokens_per_s * hot / (policy.target_tokens_per_s * replicas))
    if signals.queue_length is not None and policy.target_queue_length is not None:
        ratios.append(signals.queue_length / (policy.target_queue_length * replicas))
    if signals.ttft_p95_s is not None and policy.target_ttft_p95_s is not None:
        ratios.append(signals.ttft_p95_s / policy.target_ttft_p95_s)
    return max(ratios) if ratios else None


def decide(current: int, signals: Signals, policy: Policy, state: ScalerState, now_s: float) -> Decision:
    """The replicas ``current`` should become at time ``now_s`` (module docstring for the rules)."""
    if current < 0:
        raise ValueError(f"current replicas must be >= 0, got {current}")
    if current < policy.min_replicas or current > policy.max_replicas:
        desired = min(max(current, policy.min_replicas), policy.max_replicas)
        return Decision(current, desired, None, f"outside bounds [{policy.min_replicas}, {policy.max_replicas}]",
                        ScalerState(last_change_s=now_s))
    p = pressure(signals, policy, current)
    if p is None:
        return Decision(current, current, None, "no data", replace(state, above=0, below=0))
    above = state.above + 1 if p > policy.high_watermark else 0
    below = state.below + 1 if p < policy.low_watermark else 0
    counted = ScalerState(above=above, below=below, last_change_s=state.last_change_s)
    cooling = state.last_change_s is not None and now_s - state.last_change_s < policy.cooldown_s
    if above >= policy.up_intervals and current < policy.max_replicas and not cooling:
        want = max(math.ceil(current * p), current + 1)
        desired = min(want, current + policy.max_step_up, policy.max_replicas)
        return Decision(current, desired, p, f"pressure {p:.2f} > {policy.high_watermark} for {above} intervals",
                        ScalerState(last_change_s=now_s))
    if below >= policy.down_intervals and current > policy.min_replicas and not cooling:
        desired = max(math.ceil(current * p), current - policy.max_step_down, policy.min_replicas)
        if desired < current:
            return Decision(current, desired, p,
                            f"pressure {p:.2f} < {policy.low_watermark} for {below} intervals",
                            ScalerState(last_change_s=now_s))
    reason = "cooldown" if cooling and (above or below) else "within watermarks" if not (above or below) else "waiting"
    return Decision(current, current, p, reason, counted)
