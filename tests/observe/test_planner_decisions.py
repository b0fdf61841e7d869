"""The planner's decision rules, replayed over synthetic load: scale up, back down, no flapping, bounds."""

from __future__ import annotations

import math

import pytest

from k3.services.common.config import ConfigError
from k3.services.planner.decisions import Policy, ScalerState, Signals, decide, pressure

INTERVAL = 15.0


def expert_policy(**overrides) -> Policy:
    fields = dict(min_replicas=1, max_replicas=6, target_tokens_per_s=1000.0, up_intervals=2, down_intervals=4,
                  cooldown_s=60.0, max_step_up=2, max_step_down=1)
    fields.update(overrides)
    return Policy(**fields)


def replay(policy: Policy, load, replicas: int = 1):
    """Run ``decide`` once per interval; ``load(step, replicas)`` gives the Signals. Returns replicas per step."""
    state, history = ScalerState(), []
    for step in range(len(load.steps)):
        decision = decide(replicas, load(step, replicas), policy, state, now_s=step * INTERVAL)
        state, replicas = decision.state, decision.desired
        history.append(replicas)
    return history


class Surge:
    """An expert pool whose token rate and imbalance surge for a while, then return to normal."""

    def __init__(self, steps: list[tuple[float, float]]):
        self.steps = steps  # (tokens/s over the Deployment, imbalance) per interval

    def __call__(self, step: int, replicas: int) -> Signals:
        tokens, imbalance = self.steps[step]
        return Signals(tokens_per_s=tokens, imbalance=imbalance)


def changes(history: list[int], start: int) -> list[int]:
    previous, out = start, []
    for value in history:
        if value != previous:
            out.append(value - previous)
        previous = value
    return out


def test_imbalance_surge_scales_the_pool_up_then_back_down_without_flapping():
    calm, hot = (600.0, 1.1), (2200.0, 1.8)  # hot: 2200 tok/s x 1.8 imbalance = 3.96 balanced replicas
    load = Surge([calm] * 5 + [hot] * 20 + [calm] * 40)
    history = replay(expert_policy(), load)
    assert max(history) == 4 == math.ceil(2200 * 1.8 / 1000)
    assert history[:5] == [1] * 5
    ups = changes(history[:25], 1)
    # Two intervals above the watermark, +2 (step limit), cooldown, then +1 more to reach the target.
    assert ups == [2, 1]
    assert history[5] == 1 and history[6] == 3  # the second hot interval triggers the change
    downs = changes(history[25:], history[24])
    assert downs == [-1, -1, -1]  # one replica at a time, each after the low watermark held for 4 intervals
    assert history[-1] == 1
    # Directions: all ups strictly before all downs (one up phase, one down phase).
    signs = [d > 0 for d in changes(history, 1)]
    assert signs == sorted(signs, reverse=True)


def test_oscillating_load_near_the_high_watermark_changes_nothing():
    # Pressure alternates 1.25 / 1.15 around the 1.2 watermark: never two intervals above in a row.
    load = Surge([(1250.0, 1.0), (1150.0, 1.0)] * 30)
    assert replay(expert_policy(), load) == [1] * 60


def test_oscillating_load_near_the_low_watermark_changes_nothing():
    # Three replicas, pressure alternates 0.55 / 0.65 around the 0.6 watermark.
    load = Surge([(1650.0, 1.0), (1950.0, 1.0)] * 30)
    assert replay(expert_policy(), load, replicas=3) == [3] * 60


def test_scale_down_target_never_overshoots_above_the_high_watermark():
    # 4 replicas at pressure 0.3: the target is ceil(4 * 0.3) = 2, not 1 (which would give pressure 1.2).
    policy = expert_policy(max_step_down=4)
    decision = decide(4, Signals(tokens_per_s=1200.0), policy, ScalerState(below=3), now_s=0.0)
    assert decision.desired == 2
    assert pressure(Signals(tokens_per_s=1200.0), policy, decision.desired) <= 1.0


def test_cooldown_holds_changes_but_keeps_counting():
    policy = expert_policy(up_intervals=1, cooldown_s=100.0)
    hot = Signals(tokens_per_s=5000.0)
    first = decide(1, hot, policy, ScalerState(), now_s=0.0)
    assert first.desired == 3
    held = decide(3, hot, policy, first.state, now_s=50.0)
    assert held.desired == 3 and held.reason == "cooldown" and held.state.above == 1
    after = decide(3, hot, policy, held.state, now_s=100.0)
    assert after.desired == 5


def test_bounds_are_respected_and_restored():
    policy = expert_policy(min_replicas=2, max_replicas=3, up_intervals=1, cooldown_s=0.0)
    very_hot = Signals(tokens_per_s=50_000.0)
    assert decide(2, very_hot, policy, ScalerState(), 0.0).desired == 3
    at_max = decide(3, very_hot, policy, ScalerState(above=5), 0.0)
    assert at_max.desired == 3 and not at_max.changed
    idle = Signals(tokens_per_s=0.0)
    assert decide(2, idle, policy, ScalerState(below=10), 0.0).desired == 2
    # Scaled by hand outside the bounds: brought back whatever the load.
    assert decide(7, very_hot, policy, ScalerState(), 0.0).desired == 3
    assert decide(0, idle, policy, ScalerState(), 0.0).desired == 2
    # Whole replay under a huge surge never leaves the bounds.
    history = replay(policy, Surge([(50_000.0, 3.0)] * 10 + [(0.0, 1.0)] * 30), replicas=2)
    assert set(history) <= {2, 3} and history[-1] == 2


def test_missing_data_holds_and_forgets_the_counts():
    policy = expert_policy()
    state = ScalerState(above=1, below=0)
    decision = decide(2, Signals(), policy, state, 0.0)
    assert decision.desired == 2 and decision.reason == "no data" and decision.state.above == 0
    # A signal without a target counts as no data as well.
    assert decide(2, Signals(queue_length=100.0), policy, ScalerState(below=9), 0.0).desired == 2


def test_decode_pressure_is_the_largest_ratio():
    policy = Policy(target_tokens_per_s=100.0, target_queue_length=4.0, target_ttft_p95_s=0.5)
    signals = Signals(tokens_per_s=150.0, queue_length=4.0, ttft_p95_s=0.4)
    assert pressure(signals, policy, 2) == pytest.approx(0.8)  # ttft 0.4 / 0.5 beats 150/200 and 4/8
    assert pressure(Signals(queue_length=24.0), policy, 2) == pytest.approx(3.0)
    # Imbalance multiplies the token rate (the hottest expert saturates first); below 1 it is ignored.
    assert pressure(Signals(tokens_per_s=100.0, imbalance=2.0), policy, 1) == pytest.approx(2.0)
    assert pressure(Signals(tokens_per_s=100.0, imbalance=0.0), policy, 1) == pytest.approx(1.0)


@pytest.mark.parametrize("fields, field, message", [
    (dict(min_replicas=0), "min_replicas", "must be >= 1, got 0"),
    (dict(min_replicas=3, max_replicas=2), "max_replicas", "must be >= min_replicas (3), got 2"),
    (dict(high_watermark=1.0), "high_watermark", "must be > 1, got 1.0"),
    (dict(low_watermark=1.0), "low_watermark", "must be in (0, 1), got 1.0"),
    (dict(low_watermark=0.0), "low_watermark", "must be in (0, 1), got 0.0"),
    (dict(up_intervals=0), "up_intervals", "must be >= 1, got 0"),
    (dict(max_step_down=0), "max_step_down", "must be >= 1, got 0"),
    (dict(cooldown_s=-1.0), "cooldown_s", "must be >= 0, got -1.0"),
    (dict(target_queue_length=0.0), "target_queue_length", "must be > 0 or null, got 0.0"),
])
def test_policy_rejects_bad_values(fields, field, message):
    with pytest.raises(ConfigError) as info:
        Policy(**fields)
    assert info.value.field == field and info.value.reason == message


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match=r"signal queue_length must be a finite number >= 0 or None, got -1"):
        Signals(queue_length=-1.0)
    with pytest.raises(ValueError, match=r"signal tokens_per_s must be a finite number >= 0 or None, got nan"):
        Signals(tokens_per_s=float("nan"))
    with pytest.raises(ValueError, match=r"current replicas must be >= 0, got -1"):
        decide(-1, Signals(), Policy(), ScalerState(), 0.0)
    with pytest.raises(ValueError, match=r"replicas must be >= 1 to compute a pressure, got 0"):
        pressure(Signals(), Policy(), 0)
