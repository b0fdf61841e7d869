"""MoonEP benchmark: rank load balance on skewed routing traces, and the expert-parallel layer's step time.

    python -m k3.model.moonep_bench [--ranks 8 64] [--batches 4] [--steps 6] [--skip-step-time]

Part 1 (one process) samples routing traces of R ranks × ``--tokens`` tokens × top-8 over E = 8·R experts
and reports max/mean entries per rank for three placements:

- ``none``: plain expert parallelism, every entry on its expert's home rank;
- ``eplb``: replicas by *expected* load in the style of DeepSeek's EPLB: one redundant slot per rank goes to
  the expert with the highest expected load per replica, replicas are packed heaviest first onto the least
  loaded rank (by expected load) with a free slot, and at run time an expert's entries are split evenly over
  its replicas (the most favourable split). The expected load is the previous batch's;
- ``moonep``: :func:`k3.model.moonep.moonep_plan` on the batch itself (exact by construction; the value is
  measured from the plan, not assumed).

Traces: ``hot30`` (one expert picked by 30 % of tokens, the other picks uniform), ``hot30-drift`` (the hot
expert of the previous batch is not this batch's: EPLB plans for the wrong expert), ``zipf1.2`` (expert
popularity ∝ 1/rank^1.2, sampled without replacement per token, experts shuffled over the ranks).

Part 2 runs :class:`k3.model.expert_parallel.ExpertParallelLatentMoE` on 4 CPU processes (gloo, one thread
each) and times forward + backward per step (wall time of the slowest rank, median over steps, and each
rank's CPU time) for MoonEP and for plain expert parallelism, with one expert picked by 60 % of the tokens (30 % of the top-2 entries). The routed
experts dominate this layer's compute on purpose (no shared expert), since they are what the placement
changes. With more processes than cores the ranks share cores, so the wall time understates what balance buys
on dedicated devices; the per-rank CPU time shows the work each rank does.

Prints a table and one JSON document (also written to ``--json`` when given).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from k3.model.moonep import home_plan, moonep_plan

TRACES = ("hot30", "hot30-drift", "zipf1.2")
TOP_K = 8
EXPERTS_PER_RANK = 8


# --------------------------------------------------------------------------------------------------------
# routing traces


def sample_routing(trace: str, num_ranks: int, tokens: int, generator: torch.Generator, hot: int,
                   popularity: torch.Tensor | None = None) -> torch.Tensor:
    """[R, E] entries per (source rank, expert) for one batch of ``tokens`` tokens per rank, top-8."""
    num_experts = num_ranks * EXPERTS_PER_RANK
    rows = []
    for _ in range(num_ranks):
        # Gumbel top-k = sampling k experts without replacement with probabilities ∝ exp(logits).
        gumbel = -torch.log(-torch.log(torch.rand(tokens, num_experts, generator=generator).clamp_min(1e-20)))
        if trace.startswith("hot30"):
            logits = gumbel
            picks_hot = torch.rand(tokens, generator=generator) < 0.3
            logits[:, hot] = torch.where(picks_hot, torch.inf, -torch.inf)
        elif trace == "zipf1.2":
            assert popularity is not None
            logits = popularity.log() + gumbel
        else:
            raise ValueError(f"unknown trace {trace!r}; choose one of {', '.join(TRACES)}")
        ids = torch.topk(logits, TOP_K, dim=-1).indices
        rows.append(torch.bincount(ids.reshape(-1), minlength=num_experts))
    return torch.stack(rows)


def eplb_placement(expected: np.ndarray, num_ranks: int) -> tuple[list[list[int]], np.ndarray]:
    """Experts (with replicas) per rank from expected loads, one redundant slot per rank; and replica counts."""
    num_experts = expected.size
    replicas = np.ones(num_experts, dtype=np.int64)
    for _ in range(num_ranks):
        share = np.where(replicas < num_ranks, expected / replicas, -1.0)
        replicas[int(np.argmax(share))] += 1
    slots = (num_experts + num_ranks) // num_ranks
    items = sorted(((expected[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])),
                   reverse=True)
    placed: list[list[int]] = [[] for _ in range(num_ranks)]
    load = np.zeros(num_ranks)
    for weight, expert in items:
        free = [d for d in range(num_ranks) if len(placed[d]) < slots]
        # A second copy on the same rank would add nothing; only when every free slot is on such a rank.
        distinct = [d for d in free if expert not in placed[d]] or free
        d = min(distinct, key=lambda r: (load[r], r))
        placed[d].append(expert)
        load[d] += weight
    return placed, replicas


def rank_loads(method: str, actual: torch.Tensor, previous: torch.Tensor) -> tuple[np.ndarray, dict]:
    """Entries per rank under ``method`` for the batch ``actual`` [R, E] (``previous`` feeds EPLB)."""
    num_ranks = actual.shape[0]
    if method == "none":
        return home_plan(actual, EXPERTS_PER_RANK).cap.numpy().astype(float), {}
    if method == "eplb":
        placed, replicas = eplb_placement(previous.sum(0).numpy().astype(float), num_ranks)
        per_replica = actual.sum(0).numpy() / replicas
        return np.array([sum(per_replica[e] for e in experts) for experts in placed]), {}
    if method == "moonep":
        start = time.perf_counter()
        plan = moonep_plan(actual, EXPERTS_PER_RANK)
        elapsed = time.perf_counter() - start
        counts = [len(r) for r in plan.replicas]
        return plan.alloc.sum(0).numpy().astype(float), {
            "plan_ms": 1e3 * elapsed, "replicas_max": max(counts), "replicas_mean": float(np.mean(counts)),
            "moves": len(plan.moves),
        }
    raise ValueError(method)


def load_balance(ranks: list[int], batches: int, tokens: int, seed: int) -> list[dict]:
    results = []
    for num_ranks in ranks:
        num_experts = num_ranks * EXPERTS_PER_RANK
        for trace in TRACES:
            generator = torch.Generator().manual_seed(seed + num_ranks)
            popularity = (1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.2)
            popularity = popularity[torch.randperm(num_experts, generator=generator)]
            hot = int(torch.randint(num_experts, (1,), generator=generator))
            ratios: dict[str, list[float]] = {"none": [], "eplb": [], "moonep": []}
            extra: list[dict] = []
            previous = sample_routing(trace, num_ranks, tokens, generator, hot, popularity)
            for _ in range(batches):
                # Drift: the batch's hot expert moves to the next rank; EPLB still expects the old one.
                batch_hot = (hot + EXPERTS_PER_RANK) % num_experts if trace == "hot30-drift" else hot
                actual = sample_routing(trace, num_ranks, tokens, generator, batch_hot, popularity)
                for method in ratios:
                    loads, info = rank_loads(method, actual, previous)
                    ratios[method].append(float(loads.max() / loads.mean()))
                    if info:
                        extra.append(info)
                previous, hot = actual, batch_hot
            results.append({
                "ranks": num_ranks, "experts": num_experts, "trace": trace,
                **{f"{m}_max_over_mean": statistics.mean(v) for m, v in ratios.items()},
                "moonep_replicas_max": max(i["replicas_max"] for i in extra),
                "moonep_replicas_mean": statistics.mean(i["replicas_mean"] for i in extra),
                "moonep_moves_max": max(i["moves"] for i in extra),
                "moonep_plan_ms": statistics.median(i["plan_ms"] for i in extra),
            })
    return results


# --------------------------------------------------------------------------------------------------------
# step time on 4 gloo processes


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The layer and batch of the step-time benchmark."""

    world_size: int = 4
    """Gloo processes (ranks), one CPU thread each."""
    tokens: int = 512
    """Tokens per rank."""
    hot_fraction: float = 0.6
    """Fraction of tokens whose top-2 includes the hot expert (0.6 = 30 % of all routed entries)."""
    steps: int = 6
    """Timed steps (after 2 warm-up steps)."""


def _step_worker(rank: int, cfg: StepConfig, init_file: str, out_file: str) -> None:
    import torch.distributed as dist

    from k3.model.expert_parallel import ExpertParallelLatentMoE
    from k3.model.moe import LatentMoE
    from k3.model.presets import get_preset

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=cfg.world_size,
                            timeout=datetime.timedelta(seconds=300))
    try:
        model_cfg = dataclasses.replace(
            get_preset("small"), hidden_size=256, latent_size=128, expert_intermediate_size=384,
            num_experts=4 * cfg.world_size, top_k=2, num_shared_experts=0,
        )
        torch.manual_seed(0)
        moe = LatentMoE(model_cfg, layer_idx=1)
        x = torch.randn(cfg.world_size, cfg.tokens, model_cfg.hidden_size)
        with torch.no_grad():  # bias the hot expert so that hot_fraction of all tokens pick it
            scores = torch.sigmoid(moe.router(x.reshape(-1, model_cfg.hidden_size)))
            others = torch.cat([scores[:, :1], scores[:, 2:]], dim=1)  # the hot expert is expert 1
            cutoff = others.topk(model_cfg.top_k, dim=-1).values[:, -1]
            moe.expert_bias[1] = torch.quantile(cutoff - scores[:, 1], cfg.hot_fraction)
        result = {}
        for planner in ("home", "moonep"):
            layer = ExpertParallelLatentMoE(moe, planner=planner)
            times, cpu = [], []
            for step in range(cfg.steps + 2):
                xr = x[rank].clone().requires_grad_()
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                layer(xr).square().mean().backward()
                elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - start_cpu])
                per_rank = [torch.zeros(2, dtype=torch.float64) for _ in range(cfg.world_size)]
                dist.all_gather(per_rank, elapsed.double())
                if step >= 2:
                    times.append(max(float(t[0]) for t in per_rank))
                    cpu.append([float(t[1]) for t in per_rank])
            plan = layer.last_plan
            load = plan.cap.double()
            result[planner] = {
                "step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
                "cpu_ms_per_rank_median": [1e3 * statistics.median(c[r] for c in cpu) for r in range(cfg.world_size)],
                "max_over_mean": float(load.max() / load.mean()), "entries_per_rank": plan.cap.tolist(),
                "replicas_per_rank": [len(r) for r in plan.replicas],
                "hot_share_of_entries": float(plan.tokens[:, 1].sum() / plan.tokens.sum()),
            }
        if rank == 0:
            Path(out_file).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def step_time(cfg: StepConfig) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(_step_worker, args=(cfg, os.path.join(tmp, "rendezvous"), out),
                           nprocs=cfg.world_size, join=True, start_method="fork")
        result = json.loads(Path(out).read_text())
    return {"config": dataclasses.asdict(cfg), **result}


# --------------------------------------------------------------------------------------------------------
# entry point


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m k3.model.moonep_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64], help="expert-parallel sizes R")
    parser.add_argument("--batches", type=int, default=4, help="batches per trace (averaged)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank in the load traces")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of the 4-process layer benchmark")
    parser.add_argument("--skip-step-time", action="store_true", help="only the load-balance part")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the JSON document here")
    args = parser.parse_args(argv)
    for name in ("batches", "tokens", "steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive")
    if any(r <= 0 for r in args.ranks):
        parser.error("--ranks must be positive")

    report: dict = {"load_balance": load_balance(args.ranks, args.batches, args.tokens, args.seed)}
    print(f"max/mean entries per rank (top-{TOP_K}, {EXPERTS_PER_RANK} experts per rank, {args.tokens} tokens "
          f"per rank, mean of {args.batches} batches)")
    print(f"{'R':>4} {'E':>5} {'trace':<12} {'none':>7} {'eplb':>7} {'moonep':>7} {'replicas max/mean':>18} "
          f"{'plan ms':>8}")
    for row in report["load_balance"]:
        print(f"{row['ranks']:>4} {row['experts']:>5} {row['trace']:<12} {row['none_max_over_mean']:>7.3f} "
              f"{row['eplb_max_over_mean']:>7.3f} {row['moonep_max_over_mean']:>7.3f} "
              f"{row['moonep_replicas_max']:>9d} / {row['moonep_replicas_mean']:<6.2f} {row['moonep_plan_ms']:>8.1f}")
    if not args.skip_step_time:
        report["step_time"] = step_time(StepConfig(steps=args.steps))
        step = report["step_time"]
        print(f"\nexpert-parallel LatentMoE forward+backward, {step['config']['world_size']} gloo CPU processes, "
              f"{step['config']['tokens']} tokens per rank, hot expert "
              f"{100 * step['moonep']['hot_share_of_entries']:.0f} % of entries")
        print(f"{'placement':<10} {'median ms':>10} {'min ms':>8} {'max/mean':>9} {'entries per rank':<26} "
              f"{'CPU ms per rank':<26} replicas")
        for name in ("home", "moonep"):
            r = step[name]
            cpu = "[" + ", ".join(f"{v:.0f}" for v in r["cpu_ms_per_rank_median"]) + "]"
            print(f"{name:<10} {r['step_ms_median']:>10.1f} {r['step_ms_min']:>8.1f} {r['max_over_mean']:>9.3f} "
                  f"{str(r['entries_per_rank']):<26} {cpu:<26} {r['replicas_per_rank']}")
    document = json.dumps(report, indent=2)
    print(document)
    if args.json:
        args.json.write_text(document + "\n")
    return report


if __name__ == "__main__":
    main()
