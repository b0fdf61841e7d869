"""Quantile Balancing: the defining property, convergence on a skewed router, the histogram estimator
(one process and two gloo ranks), the DeepSeek baseline, load statistics and input validation."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3.model.balancing import (
    deepseek_sign_update,
    margin_histogram,
    quantile_balance_bias,
    quantile_balance_bias_distributed,
    quantile_thresholds,
    route_top_k,
    routing_stats,
    skewed_router_scores,
    target_load,
    thresholds_from_histogram,
)

M, N, K = 4096, 64, 4
SKEW = 2.0


@pytest.fixture(autouse=True)
def _one_thread():
    # Small tensors: one thread is fastest, and it avoids oversubscribing shared CI cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _cutoffs(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(scores + bias, k + 1, dim=1).values[:, k]


def _max_over_mean(scores: torch.Tensor, bias: torch.Tensor, k: int) -> float:
    return routing_stats(route_top_k(scores, bias, k), scores.shape[1]).max_over_mean


# ------------------------------------------------------------------------------------------- convergence


def test_quantile_balancing_balances_fresh_batches_and_beats_sign_update():
    gen = torch.Generator().manual_seed(0)
    zero = torch.zeros(N)
    batch = skewed_router_scores(M, N, gen, SKEW)
    unbalanced = _max_over_mean(batch, zero, K)
    assert unbalanced > 5.0, f"precondition: the synthetic router must be skewed, got max/mean {unbalanced}"

    qb_bias, ds_bias = zero.clone(), zero.clone()
    qb_trace, ds_trace = [], []
    for _ in range(5):
        # Each update is computed on one batch and judged on the next, fresh one.
        qb_bias = quantile_balance_bias(batch, qb_bias, K)
        ds_bias = deepseek_sign_update(batch, ds_bias, K, gamma=0.001)
        batch = skewed_router_scores(M, N, gen, SKEW)
        qb_trace.append(_max_over_mean(batch, qb_bias, K))
        ds_trace.append(_max_over_mean(batch, ds_bias, K))
    print(
        f"\nmax/mean load: unbalanced {unbalanced:.3f}; after 5 updates quantile balancing "
        f"{qb_trace[-1]:.3f} (trace {[round(v, 3) for v in qb_trace]}), DeepSeek ±0.001 "
        f"{ds_trace[-1]:.3f} (trace {[round(v, 3) for v in ds_trace]})"
    )
    assert qb_trace[-1] <= 1.25
    assert ds_trace[-1] > qb_trace[-1]
    assert abs(float(qb_bias.mean())) < 1e-6


def test_skewed_router_is_one_distribution_and_validates():
    a = skewed_router_scores(8, 5, torch.Generator().manual_seed(3), 1.0)
    b = skewed_router_scores(8, 5, torch.Generator().manual_seed(3), 1.0)
    assert torch.equal(a, b) and a.shape == (8, 5)
    assert bool(((a > 0) & (a < 1)).all())
    # Expert 0 is the popular one: its mean score beats the last expert's on a large batch.
    big = skewed_router_scores(2000, 5, torch.Generator().manual_seed(4), 1.0)
    assert big[:, 0].mean() > big[:, -1].mean() + 0.2
    with pytest.raises(ValueError, match="n must be at least 2"):
        skewed_router_scores(8, 1, torch.Generator(), 1.0)
    with pytest.raises(ValueError, match="m must be a positive int"):
        skewed_router_scores(0, 4, torch.Generator(), 1.0)
    with pytest.raises(ValueError, match="generator must be a torch.Generator"):
        skewed_router_scores(8, 4, 0, 1.0)
    with pytest.raises(ValueError, match="skew must be finite"):
        skewed_router_scores(8, 4, torch.Generator(), float("nan"))


# ------------------------------------------------------------------------------------- exact property


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(4096, 64, 4), (1000, 24, 3), (37, 8, 2), (10, 16, 1), (5, 3, 2)],
    ids=["divisible", "floor", "small", "q-zero", "k-is-n-minus-1"],
)
def test_exactly_q_tokens_pass_each_threshold_holding_cutoffs(m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    scores = torch.rand(m, n, generator=gen)
    bias = 0.1 * torch.randn(n, generator=gen)
    q = target_load(m, n, k)
    assert q == (m * k) // n < m

    thresholds = quantile_thresholds(scores, bias, k)
    cutoffs = _cutoffs(scores, bias, k)
    margins = scores - cutoffs[:, None]
    passing = (margins > thresholds[None, :]).sum(dim=0)
    # Tokens whose (k+1)-th choice is expert j all have margin exactly -b_j (up to rounding): they are
    # indifferent to j. When the (q+1)-th largest margin lands on that tie no threshold admits exactly q;
    # everywhere else exactly q pass.
    q_th = torch.topk(margins, q, dim=0).values[-1] if q > 0 else torch.full((n,), float("inf"))
    untied = (q_th - thresholds) > 1e-6
    assert passing[untied].tolist() == [q] * int(untied.sum())
    assert int(untied.sum()) >= n // 2, "most experts must be tie-free for this test to say anything"
    tied = ~untied
    torch.testing.assert_close(thresholds[tied], -bias[tied], rtol=0, atol=1e-6)
    assert bool((passing[tied] <= q).all())
    assert bool(((margins >= thresholds[None, :] - 1e-6).sum(dim=0) >= q + 1).all())

    # The returned bias is −threshold shifted to zero mean (shifting every expert alike changes no choice).
    new_bias = quantile_balance_bias(scores, bias, k)
    shift = float(thresholds.mean())
    torch.testing.assert_close(new_bias, -thresholds + shift)
    assert abs(float(new_bias.mean())) < 1e-6


def test_thresholds_match_a_sorted_reference():
    gen = torch.Generator().manual_seed(11)
    m, n, k = 9, 4, 1
    scores = torch.rand(m, n, generator=gen)
    bias = torch.tensor([0.05, -0.02, 0.0, 0.1])
    q = (m * k) // n  # 2
    expected = []
    for j in range(n):
        margins = []
        for i in range(m):
            biased = sorted((float(scores[i, e] + bias[e]) for e in range(n)), reverse=True)
            margins.append(float(scores[i, j]) - biased[k])  # (k+1)-th largest, 0-based index k
        expected.append(sorted(margins, reverse=True)[q])  # (q+1)-th largest
    torch.testing.assert_close(quantile_thresholds(scores, bias, k), torch.tensor(expected))


def test_bias_keeps_dtype_and_accepts_bf16_scores():
    scores = torch.rand(64, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    out = quantile_balance_bias(scores, torch.zeros(8, dtype=torch.float64), 2)
    assert out.dtype == torch.float64 and out.shape == (8,)


@pytest.mark.parametrize(
    ("scores", "bias", "k", "match"),
    [
        (torch.rand(8), torch.zeros(8), 2, "scores must be a 2-D tensor"),
        (torch.ones(8, 4, dtype=torch.int64), torch.zeros(4), 2, "scores must be floating point"),
        (torch.rand(0, 4), torch.zeros(4), 2, "scores must hold at least one token"),
        (torch.rand(8, 4), torch.zeros(5), 2, r"bias must be a 1-D tensor of shape \(4,\)"),
        (torch.rand(8, 4), torch.zeros(4, dtype=torch.int32), 2, "bias must be floating point"),
        (torch.rand(8, 4), torch.zeros(4), 0, "top_k must satisfy 1 <= top_k < num_experts"),
        (torch.rand(8, 4), torch.zeros(4), 4, "top_k must satisfy 1 <= top_k < num_experts"),
        (torch.rand(8, 4), torch.zeros(4), True, "top_k must be an int"),
        (torch.rand(8, 4), torch.zeros(4), 2.0, "top_k must be an int"),
    ],
)
def test_bad_inputs_are_rejected(scores, bias, k, match):
    with pytest.raises(ValueError, match=match):
        quantile_balance_bias(scores, bias, k)
    with pytest.raises(ValueError, match=match):
        margin_histogram(scores, bias, k)


# ------------------------------------------------------------------------------------ routing statistics


def test_routing_stats_from_ids_and_counts():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])
    stats = routing_stats(ids, 5)
    assert stats.load.tolist() == [4, 2, 1, 1, 0]
    assert stats.mean_load == pytest.approx(1.6)
    assert stats.max_load == 4 and stats.min_load == 0
    assert stats.max_over_mean == pytest.approx(2.5)
    assert stats.min_over_mean == 0.0
    assert stats.cv == pytest.approx(float(torch.tensor([4, 2, 1, 1, 0.0]).std(correction=0)) / 1.6)
    same = routing_stats(None, 5, counts=torch.tensor([4, 2, 1, 1, 0]))
    assert same.max_over_mean == stats.max_over_mean and same.load.tolist() == stats.load.tolist()
    assert routing_stats(None, 3, counts=torch.tensor([5, 5, 5])).max_over_mean == 1.0


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((torch.tensor([0, 1]), 0), {}, "num_experts must be a positive int"),
        ((None, 3), {}, "exactly one of expert_ids and counts"),
        ((torch.tensor([0]), 3), {"counts": torch.tensor([1, 0, 0])}, "exactly one of"),
        ((torch.tensor([0.0, 1.0]), 3), {}, "expert_ids must be an integer tensor"),
        ((torch.tensor([0, 3]), 3), {}, r"expert_ids must lie in \[0, 3\)"),
        ((torch.tensor([-1, 0]), 3), {}, r"expert_ids must lie in \[0, 3\)"),
        ((None, 3), {"counts": torch.tensor([1, 2])}, r"counts must have shape \(3,\)"),
        ((None, 2), {"counts": torch.tensor([1.0, 2.0])}, "counts must be an integer tensor"),
        ((None, 2), {"counts": torch.tensor([-1, 2])}, "counts must be non-negative"),
        ((None, 2), {"counts": torch.tensor([0, 0])}, "no entries were routed"),
    ],
)
def test_routing_stats_rejects_bad_input(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        routing_stats(*args, **kwargs)


# -------------------------------------------------------------------------------------------- baseline


def test_deepseek_sign_update_moves_by_gamma_against_the_load():
    # Top-1 by biased score sends 3 tokens to expert 0, 1 to expert 1, none to expert 2 (mean 4/3).
    scores = torch.tensor([[0.9, 0.1, 0.2], [0.8, 0.3, 0.1], [0.7, 0.6, 0.1], [0.1, 0.9, 0.2]])
    bias = torch.tensor([0.0, 0.05, -0.05])
    assert routing_stats(route_top_k(scores, bias, 1), 3).load.tolist() == [3, 1, 0]
    new = deepseek_sign_update(scores, bias, 1, gamma=0.01)
    torch.testing.assert_close(new, torch.tensor([-0.01, 0.06, -0.04]))
    # Experts exactly at the mean load keep their bias.
    even = deepseek_sign_update(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.zeros(2), 1)
    assert even.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="gamma must be a positive number"):
        deepseek_sign_update(scores, bias, 1, gamma=0.0)


# ------------------------------------------------------------------------------------ histogram, 1 rank


def test_histogram_threshold_within_one_bin_of_exact():
    gen = torch.Generator().manual_seed(5)
    scores = skewed_router_scores(3000, 32, gen, SKEW)
    bias = quantile_balance_bias(scores, torch.zeros(32), 4)  # a realistic non-zero bias
    num_bins, value_range = 512, (-1.0, 1.0)
    width = (value_range[1] - value_range[0]) / num_bins
    counts = margin_histogram(scores, bias, 4, num_bins=num_bins, value_range=value_range)
    assert counts.shape == (32, num_bins) and counts.dtype == torch.int64
    assert counts.sum(dim=1).tolist() == [3000] * 32

    estimate = thresholds_from_histogram(counts, 4, value_range=value_range)
    exact = quantile_thresholds(scores, bias, 4)
    err = estimate.double() - exact.double()
    # The right edge is never below the exact value and at most one bin above it.
    assert float(err.min()) >= -1e-6
    assert float(err.max()) <= width + 1e-6
    # At most q tokens lie above the estimate (holding the cutoffs).
    cutoffs = _cutoffs(scores, bias, 4)
    above = (scores - cutoffs[:, None] > estimate[None, :]).sum(dim=0)
    assert int(above.max()) <= target_load(3000, 32, 4)


def test_histogram_counts_out_of_range_margins_in_edge_bins():
    scores = torch.tensor([[0.9, 0.1, 0.5]])
    bias = torch.zeros(3)
    # cutoff (2nd largest, k=1) = 0.5 -> margins [0.4, -0.4, 0.0]; range (-0.1, 0.1) in 2 bins.
    counts = margin_histogram(scores, bias, 1, num_bins=2, value_range=(-0.1, 0.1))
    assert counts.tolist() == [[0, 1], [1, 0], [0, 1]]


@pytest.mark.parametrize(
    ("num_bins", "value_range", "match"),
    [
        (0, (-1.0, 1.0), "num_bins must be a positive int"),
        (8.0, (-1.0, 1.0), "num_bins must be a positive int"),
        (8, (1.0, -1.0), "value_range must be finite with low < high"),
        (8, (-1.0, float("inf")), "value_range must be finite with low < high"),
        (8, (0.0,), r"value_range must be a pair \(low, high\)"),
        (8, "ab", r"value_range must be a pair \(low, high\)"),
    ],
)
def test_histogram_rejects_bad_bins(num_bins, value_range, match):
    with pytest.raises(ValueError, match=match):
        margin_histogram(torch.rand(4, 3), torch.zeros(3), 1, num_bins=num_bins, value_range=value_range)


def test_thresholds_from_histogram_rejects_bad_counts():
    with pytest.raises(ValueError, match="counts must be an integer tensor"):
        thresholds_from_histogram(torch.ones(3, 4), 1)
    with pytest.raises(ValueError, match="rows must all sum to the same token count"):
        thresholds_from_histogram(torch.tensor([[1, 0], [1, 1], [0, 2]]), 1)
    with pytest.raises(ValueError, match="counts hold no tokens"):
        thresholds_from_histogram(torch.zeros(3, 4, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="top_k must satisfy"):
        thresholds_from_histogram(torch.ones(3, 4, dtype=torch.int64), 3)


def test_distributed_variant_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        quantile_balance_bias_distributed(torch.rand(4, 3), torch.zeros(3), 1)


# ------------------------------------------------------------------------------------ histogram, 2 ranks

RANK_TOKENS = (1500, 2200)  # unequal on purpose: q comes from the union's token count
DIST_EXPERTS, DIST_TOP_K, DIST_BINS = 32, 4, 1024


def _rank_scores(rank: int) -> torch.Tensor:
    return skewed_router_scores(RANK_TOKENS[rank], DIST_EXPERTS, torch.Generator().manual_seed(100 + rank), SKEW)


def _common_bias() -> torch.Tensor:
    return 0.2 * torch.randn(DIST_EXPERTS, generator=torch.Generator().manual_seed(7))


def _gloo_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        scores, bias = _rank_scores(rank), _common_bias()
        new_bias = quantile_balance_bias_distributed(
            scores, bias, DIST_TOP_K, num_bins=DIST_BINS, value_range=(-1.0, 1.0)
        )
        counts = margin_histogram(scores, bias, DIST_TOP_K, num_bins=DIST_BINS)
        dist.all_reduce(counts)
        thresholds = thresholds_from_histogram(counts, DIST_TOP_K)
        result = {"bias": new_bias.tolist(), "thresholds": thresholds.tolist(), "tokens": int(counts[0].sum())}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_gloo_ranks_match_exact_quantile_over_the_union(tmp_path):
    init_file = tmp_path / "rendezvous"
    mp.spawn(_gloo_worker, args=(2, str(init_file), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1], "every rank must get the same bias"
    assert results[0]["tokens"] == sum(RANK_TOKENS)

    union = torch.cat([_rank_scores(0), _rank_scores(1)])
    exact = quantile_thresholds(union, _common_bias(), DIST_TOP_K).double()
    estimate = torch.tensor(results[0]["thresholds"], dtype=torch.float64)
    width = 2.0 / DIST_BINS
    assert float((estimate - exact).min()) >= -1e-6
    assert float((estimate - exact).max()) <= width + 1e-6
    # A single rank's exact quantile is not the union's: the all-reduce is doing real work.
    alone = quantile_thresholds(_rank_scores(0), _common_bias(), DIST_TOP_K).double()
    assert float((alone - exact).abs().max()) > width

    new_bias = torch.tensor(results[0]["bias"], dtype=torch.float64)
    torch.testing.assert_close(new_bias, -estimate + estimate.mean(), rtol=0, atol=1e-6)
