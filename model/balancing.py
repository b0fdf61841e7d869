"""Quantile Balancing: the router bias that gives every expert the same load, computed in closed form.

A sigmoid router scores m tokens against n experts (``scores`` [m, n], values in (0, 1)); each token takes
the top-k experts by ``scores + bias``. The bias is used for *selection only* (DESIGN.md §1.5), so balancing
is a question of choosing ``bias`` such that every expert is picked by the same number of tokens,
q = m·k/n.

Design decisions:

* **Exact rule.** Per token i the cutoff c_i is the (k+1)-th largest biased score: a token picks expert j
  exactly when s_ij + b_j > c_i. Holding the cutoffs, the new bias b̂_j = −t_j with t_j the (q+1)-th largest
  margin (s_ij − c_i) over tokens lets exactly q tokens pass expert j. One tie is built in: every token
  whose (k+1)-th choice is j has margin exactly −b_j (it is indifferent to j). When the (q+1)-th largest
  margin falls on that tie, fewer than q tokens pass strictly and more than q pass with equality; no
  threshold does better, and the next batch's fresh cutoffs break the tie. The cutoffs and the bias are the two sets of dual variables of the equal-work assignment
  problem, so one application is a step of exact coordinate ascent in the dual: no step size, unlike
  DeepSeek's loss-free ±γ update (:func:`deepseek_sign_update`, kept for comparison).
* **Centering.** Adding one constant to every expert's bias changes no top-k choice, so the returned bias
  has zero mean; that keeps the bias from drifting over training.
* **Rounding of q.** q = floor(m·k/n). Because 1 ≤ k < n (the (k+1)-th largest score must exist),
  m·k/n < m, so q ≤ m − 1 and the (q+1)-th largest margin always exists; q ≥ m cannot occur.
* **Across data-parallel ranks** the exact order statistic would need every rank's margins. Instead each
  rank histograms its margins per expert over fixed bins, the counts are summed with one all-reduce, and the
  threshold is read off the summed histogram (:func:`thresholds_from_histogram`). The bins are the same on
  every rank, so the summed histogram is exactly the histogram of the union of the ranks' tokens and the
  only error is the bin width.
* Everything is vectorised with ``torch.topk`` / ``torch.kthvalue`` / ``torch.bincount``: no Python loop
  over tokens or experts. Bias arithmetic runs in fp32 whatever the score dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "RoutingStats",
    "deepseek_sign_update",
    "margin_histogram",
    "quantile_balance_bias",
    "quantile_balance_bias_distributed",
    "quantile_thresholds",
    "route_top_k",
    "routing_stats",
    "skewed_router_scores",
    "target_load",
    "thresholds_from_histogram",
]


# --------------------------------------------------------------------------------------------------------
# validation


def _check_top_k(top_k: object, num_experts: int) -> int:
    # bool is an int subclass; True as a top-k is always a mistake.
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k < num_experts:
        raise ValueError(
            f"top_k must satisfy 1 <= top_k < num_experts ({num_experts}) so that the (top_k+1)-th "
            f"largest score exists, got {top_k}"
        )
    return top_k


def _check_inputs(scores: torch.Tensor, bias: torch.Tensor, top_k: object) -> int:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        shape = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a 2-D tensor [tokens, experts], got {shape}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be floating point, got {scores.dtype}")
    m, n = scores.shape
    if m < 1:
        raise ValueError("scores must hold at least one token, got 0 rows")
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,):
        shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be a 1-D tensor of shape ({n},) matching scores' experts, got {shape}")
    if not bias.is_floating_point():
        raise ValueError(f"bias must be floating point, got {bias.dtype}")
    if bias.device != scores.device:
        raise ValueError(f"bias is on {bias.device} but scores are on {scores.device}")
    return _check_top_k(top_k, n)


def target_load(num_tokens: int, num_experts: int, top_k: int) -> int:
    """Per-expert target load q = floor(num_tokens · top_k / num_experts) (see the module docstring)."""
    return (num_tokens * top_k) // num_experts


# --------------------------------------------------------------------------------------------------------
# routing and load statistics


def route_top_k(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """Expert ids [m, top_k] chosen by the biased scores (the bias only selects; it never weights)."""
    _check_inputs(scores, bias, top_k)
    return torch.topk(scores.float() + bias.float(), top_k, dim=1).indices


@dataclass(frozen=True)
class RoutingStats:
    """Load of each expert for one batch, and how far it is from even.

    Attributes:
        load: int64 [num_experts], number of (token, slot) entries routed to each expert.
        mean_load: total entries / num_experts (the perfectly balanced load).
        max_load: the busiest expert's load; in expert parallelism the step waits for it.
        min_load: the idlest expert's load.
        max_over_mean: max_load / mean_load; 1.0 is perfect balance. The headline figure.
        min_over_mean: min_load / mean_load.
        cv: coefficient of variation of the load (population std / mean).
    """

    load: torch.Tensor
    mean_load: float
    max_load: int
    min_load: int
    max_over_mean: float
    min_over_mean: float
    cv: float


def routing_stats(
    expert_ids: torch.Tensor | None, num_experts: int, *, counts: torch.Tensor | None = None
) -> RoutingStats:
    """Load statistics from routed ``expert_ids`` (any shape, e.g. [m, k]) or from per-expert ``counts``.

    Pass exactly one of the two: ``routing_stats(ids, n)`` or ``routing_stats(None, n, counts=load)``.
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if (expert_ids is None) == (counts is None):
        raise ValueError("pass exactly one of expert_ids and counts")
    if expert_ids is not None:
        if expert_ids.is_floating_point() or expert_ids.is_complex() or expert_ids.dtype == torch.bool:
            raise ValueError(f"expert_ids must be an integer tensor, got {expert_ids.dtype}")
        flat = expert_ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
            raise ValueError(
                f"expert_ids must lie in [0, {num_experts}), got range "
                f"[{int(flat.min())}, {int(flat.max())}]"
            )
        load = torch.bincount(flat, minlength=num_experts)
    else:
        assert counts is not None
        if tuple(counts.shape) != (num_experts,):
            raise ValueError(f"counts must have shape ({num_experts},), got {tuple(counts.shape)}")
        if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
            raise ValueError(f"counts must be an integer tensor, got {counts.dtype}")
        if int(counts.min()) < 0:
            raise ValueError("counts must be non-negative")
        load = counts.long()
    total = int(load.sum())
    if total == 0:
        raise ValueError("no entries were routed: the load is all zero, so its balance is undefined")
    mean = total / num_experts
    loadf = load.double()
    return RoutingStats(
        load=load,
        mean_load=mean,
        max_load=int(load.max()),
        min_load=int(load.min()),
        max_over_mean=int(load.max()) / mean,
        min_over_mean=int(load.min()) / mean,
        cv=float(loadf.std(correction=0)) / mean,
    )


# --------------------------------------------------------------------------------------------------------
# exact quantile balancing (one process)


def _margins(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """s_ij − c_i, with c_i the (top_k+1)-th largest biased score of token i. fp32 [m, n]."""
    s = scores.float()
    cutoff = torch.topk(s + bias.float(), top_k + 1, dim=1).values[:, top_k]
    return s - cutoff[:, None]


def quantile_thresholds(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per-expert threshold t_j = (q+1)-th largest margin (s_ij − c_i) over the batch's tokens. fp32 [n].

    Holding the cutoffs c_i, exactly q tokens have a margin above t_j (the defining property), unless t_j
    is the tied margin −b_j of the tokens whose (k+1)-th choice is j (see the module docstring); then at
    most q are strictly above and at least q + 1 at or above.
    """
    top_k = _check_inputs(scores, bias, top_k)
    m, n = scores.shape
    q = target_load(m, n, top_k)
    # The (q+1)-th largest of m values is the (m−q)-th smallest; kthvalue avoids sorting q+1 values per
    # expert, which matters when q is large (it is m·k/n).
    return torch.kthvalue(_margins(scores, bias, top_k), m - q, dim=0).values


def _centred_bias(thresholds: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    new_bias = -thresholds
    return (new_bias - new_bias.mean()).to(like.dtype)


def quantile_balance_bias(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """New router bias from one batch: b̂_j = −t_j (see :func:`quantile_thresholds`), minus its mean.

    Args:
        scores: [m, n] router probabilities (sigmoid outputs) of this batch.
        bias: [n] the bias the batch was routed with (it sets the cutoffs).
        top_k: experts per token, 1 ≤ top_k < n.

    Returns:
        [n] bias to use from the next batch on (same dtype as ``bias``), zero mean.
    """
    return _centred_bias(quantile_thresholds(scores, bias, top_k), bias)


# --------------------------------------------------------------------------------------------------------
# histogram estimator across data-parallel ranks


def _check_bins(num_bins: object, value_range: object) -> tuple[int, float, float]:
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be a positive int, got {num_bins!r}")
    try:
        lo, hi = (float(v) for v in value_range)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"value_range must be a pair (low, high) of numbers, got {value_range!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValueError(f"value_range must be finite with low < high, got {value_range!r}")
    return num_bins, lo, hi


def margin_histogram(
    scores: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    *,
    num_bins: int = 2048,
    value_range: tuple[float, float] = (-1.0, 1.0),
) -> torch.Tensor:
    """Per-expert histogram of the margins (s_ij − c_i) of this rank's tokens. int64 [n, num_bins].

    Bin b covers [low + b·w, low + (b+1)·w) with w = (high − low)/num_bins. Margins outside the range are
    counted in the first or last bin, so every token is counted once per expert and the row sums equal m;
    the error bound of :func:`thresholds_from_histogram` needs the true threshold inside the range. With
    sigmoid scores and a zero-mean bias of moderate size the margins lie in (−1, 1), the default range.
    """
    top_k = _check_inputs(scores, bias, top_k)
    num_bins, lo, hi = _check_bins(num_bins, value_range)
    n = scores.shape[1]
    # Bin in float64 so the bin of a margin is exact up to fp32 input precision, and identical on every
    # rank (the summed histogram must be the histogram of the union).
    margins = _margins(scores, bias, top_k).double()
    idx = torch.floor((margins - lo) * (num_bins / (hi - lo))).clamp_(0, num_bins - 1).long()
    flat = idx + torch.arange(n, device=idx.device)[None, :] * num_bins
    return torch.bincount(flat.reshape(-1), minlength=n * num_bins).view(n, num_bins)


def thresholds_from_histogram(
    counts: torch.Tensor, top_k: int, *, value_range: tuple[float, float] = (-1.0, 1.0)
) -> torch.Tensor:
    """Threshold estimate per expert from (summed) margin histograms ``counts`` [n, num_bins]. fp32 [n].

    The total token count M is the row sum (every token is counted once per expert), q = floor(M·k/n).
    The exact threshold is the (q+1)-th largest margin; it lies in the first bin, scanning from the top,
    whose cumulative count (that bin included) reaches q + 1. The estimate is that bin's right edge, so
    it is never below the exact threshold and exceeds it by at most one bin width (when the exact value is
    inside ``value_range``). At most q tokens have a margin above the estimate.
    """
    if counts.dim() != 2 or counts.is_floating_point() or counts.dtype == torch.bool:
        raise ValueError(
            f"counts must be an integer tensor [experts, bins], got {counts.dtype} {tuple(counts.shape)}"
        )
    n, num_bins = counts.shape
    num_bins, lo, hi = _check_bins(num_bins, value_range)
    top_k = _check_top_k(top_k, n)
    totals = counts.sum(dim=1)
    if bool((totals != totals[0]).any()):
        raise ValueError("counts rows must all sum to the same token count (one entry per token and expert)")
    total = int(totals[0])
    if total < 1:
        raise ValueError("counts hold no tokens")
    q = target_load(total, n, top_k)
    from_top = counts.flip(1).cumsum(dim=1)  # from_top[:, r] = tokens in the r+1 highest bins
    # First position (from the top) where the cumulative count reaches q+1; exists since total ≥ q+1.
    r = (from_top >= q + 1).int().argmax(dim=1)
    bin_index = (num_bins - 1 - r).double()
    width = (hi - lo) / num_bins
    return (lo + (bin_index + 1.0) * width).float()


def quantile_balance_bias_distributed(
    scores: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    *,
    num_bins: int = 2048,
    value_range: tuple[float, float] = (-1.0, 1.0),
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Quantile Balancing over the union of every rank's tokens, through one all-reduce of histograms.

    Each rank passes its own batch (``scores`` [m_r, n], any m_r) and the common ``bias``. The histograms
    are summed (int64, SUM) over ``group`` (default: the world), and every rank gets the same new bias:
    −(threshold estimate), minus its mean. Its thresholds are within one bin width,
    (high − low)/num_bins, of the exact quantile over the union. Works with gloo and NCCL (the counts are
    on the scores' device).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "quantile_balance_bias_distributed needs an initialised torch.distributed process group; "
            "use quantile_balance_bias for a single process"
        )
    counts = margin_histogram(scores, bias, top_k, num_bins=num_bins, value_range=value_range)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    thresholds = thresholds_from_histogram(counts, top_k, value_range=value_range)
    return _centred_bias(thresholds.to(bias.device), bias)


# --------------------------------------------------------------------------------------------------------
# baseline and synthetic router


def deepseek_sign_update(
    scores: torch.Tensor, bias: torch.Tensor, top_k: int, gamma: float = 0.001
) -> torch.Tensor:
    """DeepSeek-V3's loss-free balancing step: b_j ← b_j + γ·sign(mean load − load_j).

    Overloaded experts lose γ, underloaded ones gain γ, experts exactly at the mean keep their bias. The
    fixed step γ is the hyper-parameter Quantile Balancing does without.
    """
    top_k = _check_inputs(scores, bias, top_k)
    if not (isinstance(gamma, (int, float)) and not isinstance(gamma, bool) and gamma > 0):
        raise ValueError(f"gamma must be a positive number, got {gamma!r}")
    n = scores.shape[1]
    load = torch.bincount(route_top_k(scores, bias, top_k).reshape(-1), minlength=n).float()
    return (bias.float() + gamma * torch.sign(load.mean() - load)).to(bias.dtype)


def skewed_router_scores(m: int, n: int, generator: torch.Generator, skew: float) -> torch.Tensor:
    """A synthetic sigmoid router with a fixed popularity skew, for tests and benchmarks. fp32 [m, n].

    logit_ij = z_ij + skew · (1 − 2j/(n−1)), z_ij ~ N(0, 1) drawn from ``generator``: expert 0 is the most
    popular, expert n−1 the least. The skew profile is deterministic, so successive calls with one
    generator are fresh batches from one distribution, which is what a bias learnt on one batch must
    balance on the next. With n = 64, top-4 and skew = 2 the unbiased top-k has max/mean load ≈ 6.
    """
    for name, value in (("m", m), ("n", n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if n < 2:
        raise ValueError(f"n must be at least 2 experts, got {n}")
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if not math.isfinite(float(skew)):
        raise ValueError(f"skew must be finite, got {skew!r}")
    profile = torch.linspace(1.0, -1.0, n)
    noise = torch.randn(m, n, generator=generator, device=generator.device)
    return torch.sigmoid(noise + float(skew) * profile.to(noise.device))
