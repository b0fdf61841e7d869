"""Exact small cases of the RL algorithms in ``k3.model.rl``."""

import math

import pytest
import torch

from k3.model.rl import (
    EffortBudgets,
    StalenessGate,
    TeacherSet,
    decoupled_ppo_loss,
    grpo_advantages,
    overlong_penalty,
    reverse_kl_advantage,
    token_staleness,
)


def test_grpo_advantages_are_group_standardised():
    adv = grpo_advantages([1.0, 0.0, 0.0, 1.0, 0.5, 0.5], ["a", "a", "b", "b", "c", "c"])
    # group a: mean 0.5, std 0.5 -> +1, -1; group b likewise; group c: all equal -> exactly 0
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0, 0.0]), atol=1e-5)
    assert adv[4] == 0 and adv[5] == 0


def test_grpo_without_std_scaling_is_mean_centred():
    adv = grpo_advantages([3.0, 1.0, 2.0], [0, 0, 0], scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0]))


def test_grpo_rejects_mismatched_and_non_finite_inputs():
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages([1.0, 2.0], ["a"])
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages([1.0, math.nan], ["a", "a"])


def test_decoupled_ppo_loss_exact_values():
    logp = torch.log(torch.tensor([0.6, 0.2, 0.5, 0.5])).requires_grad_()
    prox = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    behav = torch.log(torch.tensor([0.5, 0.5, 0.1, 0.5]))
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, mask, clip_eps=0.1, weight_cap=2.0)
    # token 0: r=1.2, clipped 1.1, A=1 -> min(1.2, 1.1)=1.1, w=1
    # token 1: r=0.4, clipped 0.9, A=-1 -> min(-0.4, -0.9)=-0.9, w=1
    # token 2: r=1, A=2 -> 2, w=min(5, 2)=2 -> 4
    expected = -(1.1 - 0.9 + 4.0) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert stats.clip_fraction == pytest.approx(2 / 3)
    assert stats.weight_capped_fraction == pytest.approx(1 / 3)
    loss.backward()
    # the clipped tokens get no gradient; token 2's gradient is -w*A*r = -4 (d r / d logp = r); token 3 masked
    assert logp.grad[0] == 0 and logp.grad[1] == 0 and logp.grad[3] == 0
    assert logp.grad[2].item() == pytest.approx(-4.0 / 3, rel=1e-5)


def test_decoupled_ppo_loss_checks_shapes_and_hyperparameters():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="one shape"):
        decoupled_ppo_loss(x, x, x, torch.zeros(2), x)
    with pytest.raises(ValueError, match="clip_eps"):
        decoupled_ppo_loss(x, x, x, x, x, clip_eps=0)


def test_staleness_gate_is_areal_rule():
    gate = StalenessGate(max_staleness=1, batch_size=4)
    assert gate.capacity(0) == 8 and gate.capacity(3) == 20
    assert gate.admits(accepted=4, running=3, version=0)
    assert not gate.admits(accepted=4, running=4, version=0)
    assert gate.admissible(accepted=4, running=1, version=1) == 7
    assert gate.admissible(accepted=40, running=0, version=1) == 0
    with pytest.raises(ValueError, match="batch_size"):
        StalenessGate(1, 0)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(-1, 4)


def test_areal_rule_bounds_staleness_when_consumed_in_order():
    # Simulate: the k-th admitted trajectory starts at the version current when it was admitted; the learner
    # consumes batch_size per version in admission order. Every trajectory's staleness stays within eta.
    for eta in (0, 1, 3):
        gate, batch = StalenessGate(eta, 4), 4
        started, version, consumed = [], 0, 0
        while consumed < 40:
            while gate.admits(consumed, len(started) - consumed, version):
                started.append(version)
            learn = started[consumed:consumed + batch]
            assert max(version - v for v in learn) <= eta
            consumed += batch
            version += 1


def test_token_staleness():
    assert token_staleness([3, 4, 5], 5) == 2
    assert token_staleness([], 7) == 0
    with pytest.raises(ValueError, match="newer"):
        token_staleness([6], 5)


def test_effort_budgets_and_overlong_penalty():
    b = EffortBudgets(low=10, high=20, max=40, allowed_multiple=2.0, penalty=0.5)
    assert b.budget("low") == 10 and b.budget("max", scale=1.5) == 60
    assert b.limit(10) == 20
    assert b.penalty_for(10, 10) == 0.0
    assert b.penalty_for(15, 10) == pytest.approx(0.25)
    assert b.penalty_for(20, 10) == 0.5 and b.penalty_for(99, 10) == 0.5
    assert overlong_penalty(5, 10, 1.0, 0.3) == 0.0 and overlong_penalty(11, 10, 1.0, 0.3) == 0.3
    with pytest.raises(ValueError, match="effort"):
        b.budget("medium")
    with pytest.raises(ValueError, match="grow"):
        EffortBudgets(low=50, high=20)
    with pytest.raises(ValueError, match="penalty"):
        EffortBudgets(penalty=2.0)
    with pytest.raises(ValueError, match="effort_budgets.bogus"):
        EffortBudgets.from_dict({"bogus": 1})


def test_reverse_kl_advantage_and_teacher_routing():
    student = torch.log(torch.tensor([0.5, 0.25, 0.1]))
    teacher = torch.log(torch.tensor([0.25, 0.5, 0.1]))
    adv = reverse_kl_advantage(student, teacher, torch.tensor([1, 1, 0]))
    assert torch.allclose(adv, torch.tensor([-math.log(2), math.log(2), 0.0]))
    teachers = TeacherSet({("math", "low"): "m-low", ("math", "max"): "m-max", ("code", "*"): "code-any"})
    assert teachers.for_trajectory("math", "max") == "m-max"
    assert teachers.for_trajectory("code", "high") == "code-any"
    with pytest.raises(KeyError, match="no teacher for domain 'math' and effort 'high'"):
        teachers.for_trajectory("math", "high")
