"""Compare router-bias balancing rules on a skewed synthetic router, over several seeds.

Each rule computes its bias update on one batch and is judged (max/mean expert load) on the next, fresh
batch of the same router. Rules: exact Quantile Balancing, its histogram estimate (what the all-reduced
version computes; one process suffices because the summed histogram of the ranks is the histogram of the
union), and DeepSeek's loss-free ±γ sign update.

    .venv/bin/python ops/bench/balancing_compare.py --seeds 20 --updates 8
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from k3.model.balancing import (
    deepseek_sign_update,
    margin_histogram,
    quantile_balance_bias,
    route_top_k,
    routing_stats,
    skewed_router_scores,
    thresholds_from_histogram,
)

Rule = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def _histogram_rule(num_bins: int) -> Rule:
    def rule(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
        counts = margin_histogram(scores, bias, top_k, num_bins=num_bins)
        new = -thresholds_from_histogram(counts, top_k)
        return new - new.mean()

    return rule


def _trace(rule: Rule, seed: int, args: argparse.Namespace) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    bias = torch.zeros(args.experts)
    batch = skewed_router_scores(args.tokens, args.experts, gen, args.skew)
    out = []
    for _ in range(args.updates):
        bias = rule(batch, bias, args.top_k)
        batch = skewed_router_scores(args.tokens, args.experts, gen, args.skew)
        out.append(routing_stats(route_top_k(batch, bias, args.top_k), args.experts).max_over_mean)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--skew", type=float, default=2.0)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--bins", type=int, default=2048)
    args = parser.parse_args()

    rules: dict[str, Rule] = {
        "quantile (exact)": quantile_balance_bias,
        f"quantile (histogram, {args.bins} bins)": _histogram_rule(args.bins),
        "deepseek sign, gamma=0.001": deepseek_sign_update,
        "deepseek sign, gamma=0.01": lambda s, b, k: deepseek_sign_update(s, b, k, gamma=0.01),
    }
    gen = torch.Generator().manual_seed(0)
    first = skewed_router_scores(args.tokens, args.experts, gen, args.skew)
    zero = torch.zeros(args.experts)
    unbalanced = routing_stats(route_top_k(first, zero, args.top_k), args.experts).max_over_mean
    print(
        f"m={args.tokens} n={args.experts} top-{args.top_k} skew={args.skew}: unbalanced max/mean "
        f"{unbalanced:.3f}; max/mean after each update, mean over {args.seeds} seeds [worst seed at the end]"
    )
    for name, rule in rules.items():
        traces = [_trace(rule, seed, args) for seed in range(args.seeds)]
        means = [statistics.mean(t[i] for t in traces) for i in range(args.updates)]
        worst_last = max(t[-1] for t in traces)
        print(f"  {name:34s} " + " ".join(f"{v:6.3f}" for v in means) + f"  [{worst_last:.3f}]")


if __name__ == "__main__":
    main()
