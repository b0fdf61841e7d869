"""Where the routed entries of one MoE layer are computed: shards, MoonEP shares over pools, row splits.

A deployment splits the E routed experts of every MoE layer into n contiguous shards (``--shard i/n``: shard
i is the *home* of experts [i·E/n, (i+1)·E/n)). Shards play the role of MoonEP's ranks: the client treats
the n shards as the ranks of :func:`k3.model.moonep.moonep_plan`, fed with the load it observed per expert.

Design decisions:

- The plan is made from *past* load (the counts observed since the previous plan), because a serving step
  cannot wait for a global count exchange the way a training step does. The plan's allocation ``alloc[e, d]``
  becomes *shares*: the current step's rows of expert e are cut into contiguous pieces proportional to the
  shares, in rank order (:meth:`LayerPlacement.split`). Balance is therefore as good as the load is
  stationary, not exact per step; with no observed load the plan is the home plan (no replicas).
- A shard may be served by several pools (replicas of a whole shard, for throughput or rolling restarts) or
  by none (its pools died or were removed). A shard without a live pool is *adopted* by the next shard, in
  cyclic order, that has one: its pools take the orphan's work and replicate its experts on demand.
- Everything here is pure (numpy/torch on the CPU, no I/O, no locks), so it is tested without servers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from k3.model.moonep import moonep_plan


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with 0 <= i < n; ``ValueError`` explains what is wrong."""
    index, sep, count = str(text).partition("/")
    try:
        if not sep:
            raise ValueError
        i, n = int(index), int(count)
    except ValueError:
        raise ValueError(f"shard must look like i/n (e.g. 0/2), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"shard {text!r}: need n >= 1 and 0 <= i < n")
    return i, n


def home_experts(shard_index: int, shard_count: int, num_experts: int) -> range:
    """The experts homed on shard ``shard_index`` of ``shard_count`` (E/n contiguous ids)."""
    if num_experts % shard_count:
        raise ValueError(f"num_experts E={num_experts} is not divisible by the shard count n={shard_count}")
    per = num_experts // shard_count
    return range(shard_index * per, (shard_index + 1) * per)


@dataclass(frozen=True)
class LayerPlacement:
    """How one layer's routed entries are spread over the n shards."""

    shares: np.ndarray
    """[E, n] non-negative integer weights: expert e's rows go to shard d in proportion to shares[e, d]
    (every row has a positive sum)."""

    @property
    def num_experts(self) -> int:
        return int(self.shares.shape[0])

    @property
    def num_shards(self) -> int:
        return int(self.shares.shape[1])

    def home(self, expert: int) -> int:
        return expert // (self.num_experts // self.num_shards)

    def replicas(self, shard: int) -> list[int]:
        """Foreign experts shard ``shard`` computes under this placement."""
        return [e for e in np.flatnonzero(self.shares[:, shard] > 0).tolist() if self.home(e) != shard]

    def split(self, counts: Sequence[int]) -> list[list[tuple[int, int, int]]]:
        """Per shard, the pieces ``(expert, first row within the expert, rows)`` of this step's entries.

        ``counts[e]`` rows of expert e are cut at ⌊count · cumulative share / total share⌋, so the pieces
        of an expert are contiguous, in shard order, and cover its rows exactly once.
        """
        if len(counts) != self.num_experts:
            raise ValueError(f"counts has {len(counts)} entries for {self.num_experts} experts")
        pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(self.num_shards)]
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            row = self.shares[expert]
            cuts = (count * np.cumsum(row)) // int(row.sum())
            start = 0
            for shard, end in enumerate(cuts.tolist()):
                if end > start:
                    pieces[shard].append((expert, start, end - start))
                    start = end
        return pieces


def home_placement(num_experts: int, num_shards: int) -> LayerPlacement:
    """Every expert on its home shard (plain expert parallelism, no replicas)."""
    home_experts(0, num_shards, num_experts)  # validates divisibility
    shares = np.zeros((num_experts, num_shards), dtype=np.int64)
    shares[np.arange(num_experts), np.arange(num_experts) // (num_experts // num_shards)] = 1
    return LayerPlacement(shares)


def plan_placement(load: Sequence[int] | np.ndarray, num_shards: int) -> LayerPlacement:
    """The MoonEP placement for per-expert ``load`` [E] over ``num_shards`` shards (the ranks).

    The load is one source's counts (the client's), so it is given to the planner as rank 0's row; the
    allocation does not depend on which rank the entries come from. Experts with no observed load keep
    a unit share at home, so a newly popular expert always has somewhere to go.
    """
    load = np.asarray(load, dtype=np.int64)
    num_experts = int(load.shape[0])
    base = home_placement(num_experts, num_shards)
    if load.sum() == 0:
        return base
    tokens = torch.zeros((num_shards, num_experts), dtype=torch.int64)
    tokens[0] = torch.from_numpy(load)
    alloc = moonep_plan(tokens, num_experts // num_shards).alloc.numpy()
    idle = load == 0
    alloc[idle] = base.shares[idle]
    return LayerPlacement(alloc)


def adopters(live: Sequence[bool]) -> list[int | None]:
    """For each shard, the shard whose pools compute its work: itself when it has a live pool, else the
    next shard in cyclic order that has one (None when no shard has a live pool)."""
    n = len(live)
    out: list[int | None] = []
    for shard in range(n):
        out.append(next(((shard + k) % n for k in range(n) if live[(shard + k) % n]), None))
    return out
