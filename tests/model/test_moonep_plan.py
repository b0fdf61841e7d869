"""MoonEP planner: worked examples, the §1.7 greedy against a plain-Python replay, property tests over random
and heavily skewed routings (exact CAP per rank, per-expert conservation, replica bounds, routes), the home
plan, and input validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3.model import moonep_plan
from k3.model.moonep import MoonEPMove, home_plan

pytestmark = pytest.mark.timeout(240)


# ------------------------------------------------------------------------------------------- references


def _replay_greedy(tokens: list[list[int]], epr: int) -> tuple[list[list[int]], list[tuple]]:
    """DESIGN.md §1.7 step by step in plain Python: (alloc [E][R], moves as (h, u, ((e, n), ...)))."""
    num_ranks, num_experts = len(tokens), len(tokens[0])
    load = [sum(row[e] for row in tokens) for e in range(num_experts)]
    total = sum(load)
    cap = [total // num_ranks + (1 if d < total % num_ranks else 0) for d in range(num_ranks)]
    balance = [sum(load[h * epr:(h + 1) * epr]) - cap[h] for h in range(num_ranks)]
    remaining = list(load)
    alloc = [[0] * num_ranks for _ in range(num_experts)]
    moves = []
    while max(balance) > 0:
        h, u = balance.index(max(balance)), balance.index(min(balance))
        left = amount = min(balance[h], -balance[u])
        pieces = []
        while left:
            e = max(range(h * epr, (h + 1) * epr), key=lambda x: (remaining[x], -x))
            take = min(left, remaining[e])
            remaining[e] -= take
            alloc[e][u] += take
            pieces.append((e, take))
            left -= take
        balance[h] -= amount
        balance[u] += amount
        moves.append((h, u, tuple(pieces)))
    for e in range(num_experts):
        alloc[e][e // epr] += remaining[e]
    return alloc, moves


def _replay_route(tokens: np.ndarray, alloc: np.ndarray) -> np.ndarray:
    """Entry by entry: label every entry of an expert with its source (rank order) and its destination
    (rank order of the allocation) and count the pairs."""
    num_ranks, num_experts = tokens.shape
    route = np.zeros((num_ranks, num_experts, num_ranks), dtype=np.int64)
    for e in range(num_experts):
        sources = [r for r in range(num_ranks) for _ in range(tokens[r, e])]
        dests = [d for d in range(num_ranks) for _ in range(alloc[e, d])]
        for r, d in zip(sources, dests, strict=True):
            route[r, e, d] += 1
    return route


# --------------------------------------------------------------------------------------------- routings


def _routing(kind: str, num_ranks: int, epr: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    num_experts = num_ranks * epr
    if kind == "uniform":
        return rng.integers(0, 30, (num_ranks, num_experts))
    if kind == "sparse":  # mostly empty experts, a few busy ones
        return rng.integers(0, 60, (num_ranks, num_experts)) * (rng.random((num_ranks, num_experts)) < 0.15)
    if kind == "zipf":  # popularity ~ 1/rank^1.2, experts shuffled over the ranks
        popularity = 1.0 / np.arange(1, num_experts + 1) ** 1.2
        popularity = popularity[rng.permutation(num_experts)]
        per_rank = rng.integers(50, 400, num_ranks)
        return np.stack([rng.multinomial(n, popularity / popularity.sum()) for n in per_rank])
    if kind == "hot30":  # one expert takes 30 % of all entries, spread over the source ranks at random
        tokens = rng.integers(0, 15, (num_ranks, num_experts))
        hot = int(rng.integers(num_experts))
        tokens[:, hot] = 0
        hot_total = int(round(tokens.sum() * 0.3 / 0.7))
        tokens[:, hot] = rng.multinomial(hot_total, np.full(num_ranks, 1.0 / num_ranks))
        return tokens
    raise AssertionError(kind)


def _check(plan, tokens: np.ndarray, epr: int) -> None:
    num_ranks, num_experts = tokens.shape
    total = int(tokens.sum())
    for name in ("tokens", "cap", "alloc", "route"):
        assert getattr(plan, name).dtype == torch.int64, name
    alloc, route, cap = plan.alloc.numpy(), plan.route.numpy(), plan.cap.numpy()
    assert (alloc >= 0).all() and (route >= 0).all()
    # Exactly CAP entries per rank: floor(total/R), one more on the first total mod R ranks.
    expected_cap = [total // num_ranks + (d < total % num_ranks) for d in range(num_ranks)]
    assert cap.tolist() == expected_cap
    assert alloc.sum(axis=0).tolist() == expected_cap
    # Conservation per expert, and the routes account for every source entry and every allocation.
    assert (alloc.sum(axis=1) == tokens.sum(axis=0)).all()
    assert (route.sum(axis=2) == tokens).all()
    assert (route.sum(axis=0) == alloc).all()
    # Replicas: exactly the foreign experts with entries on the rank.
    home = np.arange(num_experts) // epr
    for d in range(num_ranks):
        foreign = [e for e in range(num_experts) if alloc[e, d] > 0 and home[e] != d]
        assert list(plan.replicas[d]) == foreign
    # Roles: donors only send, receivers only receive; each (donor, receiver) pair has at most one move.
    balance = tokens.sum(axis=0).reshape(num_ranks, epr).sum(axis=1) - np.array(expected_cap)
    for move in plan.moves:
        assert balance[move.source] > 0 > balance[move.dest]
        assert all(home[e] == move.source and n > 0 for e, n in move.pieces)
    assert len({(m.source, m.dest) for m in plan.moves}) == len(plan.moves)
    for d in range(num_ranks):
        if plan.replicas[d]:
            assert balance[d] < 0
        if balance[d] <= 0:
            assert all(alloc[e, d] == tokens[:, e].sum() for e in range(d * epr, (d + 1) * epr))
    # Moves and replica bounds.
    nonzero = int((balance != 0).sum())
    assert len(plan.moves) <= max(nonzero - 1, 0) <= num_ranks - 1
    for d in range(num_ranks):
        k = plan.moves_into(d)
        if k:
            assert len(plan.replicas[d]) <= plan.replica_bound(d) <= k + epr - 1
        else:
            assert plan.replicas[d] == () and plan.replica_bound(d) == 0
        assert len(plan.replicas[d]) <= num_ranks + epr - 2
    donors, receivers = int((balance > 0).sum()), int((balance < 0).sum())
    replicas = sum(len(r) for r in plan.replicas)
    assert replicas <= len(plan.moves) + receivers * (epr - 1)
    if total >= num_ranks:  # every donor keeps CAP >= 1 entries, so it drains at most E/R - 1 experts
        assert replicas <= len(plan.moves) + min(donors, receivers) * (epr - 1)
    # It is the greedy of DESIGN.md §1.7, and the routes cut each expert in rank order.
    ref_alloc, ref_moves = _replay_greedy(tokens.tolist(), epr)
    assert alloc.tolist() == ref_alloc
    assert [(m.source, m.dest, m.pieces) for m in plan.moves] == ref_moves
    if total <= 20_000:
        assert (route == _replay_route(tokens, alloc)).all()


# ------------------------------------------------------------------------------------- worked examples


def test_worked_example_one_hot_expert():
    tokens = torch.tensor([[9, 3, 0, 0, 1, 2], [6, 0, 2, 0, 0, 1], [3, 0, 1, 1, 0, 1]])
    plan = moonep_plan(tokens, 2)
    # Loads per home rank 21, 4, 5 with CAP 10: rank 0 gives 6 entries of expert 0 to rank 1, then 5 to rank 2.
    assert plan.cap.tolist() == [10, 10, 10]
    assert plan.moves == (MoonEPMove(0, 1, ((0, 6),)), MoonEPMove(0, 2, ((0, 5),)))
    assert plan.alloc.tolist() == [[7, 6, 5], [3, 0, 0], [0, 3, 0], [0, 1, 0], [0, 0, 1], [0, 0, 4]]
    assert plan.replicas == ((), (0,), (0,))
    # Expert 0: sources [0, 9) [9, 15) [15, 18) cut at destinations [0, 7) [7, 13) [13, 18).
    assert plan.route[:, 0, :].tolist() == [[7, 2, 0], [0, 4, 2], [0, 0, 3]]
    assert plan.route[0, 5].tolist() == [0, 0, 2]  # unreplicated experts go home
    assert plan.send_counts().tolist() == [[10, 2, 3], [0, 6, 3], [0, 2, 4]]  # columns sum to CAP


def test_move_takes_largest_remaining_experts_whole_first():
    tokens = torch.tensor([[5, 4, 3, 0, 0, 0], [5, 4, 3, 0, 0, 0]])
    plan = moonep_plan(tokens, 3)
    assert plan.moves == (MoonEPMove(0, 1, ((0, 10), (1, 2))),)
    assert plan.alloc[:, 0].tolist() == [0, 6, 6, 0, 0, 0]
    assert plan.replicas == ((), (0, 1))


def test_move_is_capped_at_the_donor_excess_and_the_bound_is_reached():
    # Balances [1, 1, 1, -3]: moving -balance[u] = 3 from rank 0 would overdraw it; three moves fill rank 3.
    tokens = torch.tensor([[5, 5, 5, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    plan = moonep_plan(tokens, 1)
    assert [(m.source, m.dest, m.amount) for m in plan.moves] == [(0, 3, 1), (1, 3, 1), (2, 3, 1)]
    assert plan.alloc.sum(0).tolist() == [4, 4, 4, 4]
    assert plan.replicas == ((), (), (), (0, 1, 2))
    assert plan.replica_bound(3) == 3 and len(plan.moves) == 3  # R - 1 moves, bound met with equality


def test_remainder_goes_to_the_first_ranks():
    tokens = torch.tensor([[7, 0, 0, 0], [0, 0, 0, 0]])  # R = 2, total 7
    plan = moonep_plan(tokens, 2)
    assert plan.cap.tolist() == [4, 3] and plan.alloc.sum(0).tolist() == [4, 3]


def test_balanced_or_empty_routing_needs_no_moves():
    assert moonep_plan(torch.full((4, 8), 3), 2).moves == ()
    empty = moonep_plan(torch.zeros(3, 3, dtype=torch.int32), 1)
    assert empty.moves == () and empty.cap.tolist() == [0, 0, 0] and empty.replicas == ((), (), ())


def test_large_plan_r64_e1024():
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 64, (64, 1024))
    tokens[:, 17] += 4000  # a very hot expert
    plan = moonep_plan(torch.from_numpy(tokens), 16)
    assert plan.alloc.sum(0).unique().numel() <= 2 and int(plan.alloc.sum(0).max() - plan.alloc.sum(0).min()) <= 1
    assert (plan.alloc.sum(1).numpy() == tokens.sum(0)).all()
    assert (plan.route.sum(2).numpy() == tokens).all()
    assert len(plan.moves) <= 63
    assert all(len(plan.replicas[d]) <= plan.replica_bound(d) for d in range(64))


# ------------------------------------------------------------------------------------- property tests


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["uniform", "sparse", "zipf", "hot30"]),
    num_ranks=st.integers(2, 16),
    epr=st.sampled_from([1, 2, 3, 4, 8]),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_generated_routings(kind, num_ranks, epr, seed):
    tokens = _routing(kind, num_ranks, epr, seed)
    _check(moonep_plan(torch.from_numpy(tokens), epr), tokens, epr)


@st.composite
def _small_matrices(draw):
    num_ranks = draw(st.integers(2, 6))
    epr = draw(st.integers(1, 4))
    cells = draw(st.lists(st.integers(0, 6), min_size=num_ranks * num_ranks * epr,
                          max_size=num_ranks * num_ranks * epr))
    return np.array(cells, dtype=np.int64).reshape(num_ranks, num_ranks * epr), epr


@settings(max_examples=150, deadline=None)
@given(_small_matrices())
def test_property_small_matrices_including_totals_below_r(case):
    tokens, epr = case
    _check(moonep_plan(torch.from_numpy(tokens), epr), tokens, epr)


def test_hot_expert_taking_30_percent_is_spread_over_ranks():
    tokens = _routing("hot30", 16, 4, seed=3)
    plan = moonep_plan(torch.from_numpy(tokens), 4)
    hot = int(tokens.sum(0).argmax())
    assert tokens[:, hot].sum() >= 0.29 * tokens.sum()
    assert int((plan.alloc[hot] > 0).sum()) >= 4  # one rank could hold at most CAP of its 30 %
    assert home_plan(torch.from_numpy(tokens), 4).cap.max() > 4 * plan.cap.max()


# -------------------------------------------------------------------------------------------- home plan


def test_home_plan_sends_everything_home():
    tokens = torch.tensor([[9, 3, 0, 0, 1, 2], [6, 0, 2, 0, 0, 1], [3, 0, 1, 1, 0, 1]])
    plan = home_plan(tokens, 2)
    assert plan.cap.tolist() == [21, 4, 5] and plan.moves == () and plan.replicas == ((), (), ())
    assert plan.alloc.tolist() == [[18, 0, 0], [3, 0, 0], [0, 3, 0], [0, 1, 0], [0, 0, 1], [0, 0, 4]]
    assert plan.route[1, 2].tolist() == [0, 2, 0] and (plan.route.sum(2) == tokens).all()


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("planner", [moonep_plan, home_plan])
def test_bad_inputs(planner):
    with pytest.raises(ValueError, match=r"num_experts E=6 .* not divisible by the number of ranks R=4"):
        planner(torch.zeros(4, 6, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match=r"experts_per_rank=3 does not match .* E=8 experts over R=4 ranks is 2"):
        planner(torch.zeros(4, 8, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="experts_per_rank must be a positive integer, got 0"):
        planner(torch.zeros(2, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="experts_per_rank must be a positive integer, got True"):
        planner(torch.zeros(2, 2, dtype=torch.int64), True)
    with pytest.raises(ValueError, match="must hold integers, got dtype torch.float32"):
        planner(torch.zeros(2, 4), 2)
    with pytest.raises(ValueError, match=r"must be \[num_ranks, num_experts\] .* got shape \(8,\)"):
        planner(torch.zeros(8, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="must be non-negative, got -1 at rank 1, expert 2"):
        planner(torch.tensor([[0, 0, 0, 0], [0, 0, -1, 0]]), 2)
    with pytest.raises(ValueError, match="must be a torch.Tensor, got list"):
        planner([[1, 2]], 1)
