"""MoonEP planner: an exactly balanced assignment of routed entries to expert-parallel ranks.

R ranks hold E experts, ``experts_per_rank`` = E/R each, homed contiguously (rank h owns experts
[h·E/R, (h+1)·E/R)). Source rank r routes ``tokens[r, e]`` entries (token, slot pairs) to expert e. Plain
expert parallelism sends every entry to its expert's home rank, so a popular expert overloads its home.
MoonEP instead lets a rank process entries of *foreign* experts on temporary replicas, chosen so that every
rank processes exactly the same number of entries.

The plan (DESIGN.md §1.7):

- ``total`` = Σ tokens; rank d processes CAP_d entries with CAP_d = ⌊total/R⌋, plus one for the first
  ``total mod R`` ranks (so CAP is the same everywhere when R divides the total, e.g. R ranks × S tokens × K).
- balance[h] = (entries routed to experts homed on h) − CAP_h; it sums to zero.
- Greedy: while max(balance) > 0, take h = argmax(balance) and u = argmin(balance) (lowest rank on ties)
  and move ``min(balance[h], −balance[u])`` entries from h to u. DESIGN.md writes the amount as −balance[u];
  the two agree whenever h has that much excess, and when it has less the cap keeps h from being overdrawn
  (an overdrawn h would have to import foreign work back while its own experts run elsewhere).
- A move is split across h's experts largest *remaining* (not yet moved) count first, taking each expert
  whole before touching the next; only the last expert of a move is split.
- Every rank keeps the entries of its own experts that were not moved. Then, for each expert, the entries of
  the source ranks (in rank order) are laid end to end and cut at the cumulative allocation over the
  destination ranks (in rank order): that gives ``route[r, e, d]``, the entries source r sends to rank d for
  expert e, which is all the dispatch needs.

Guarantees (checked by property tests):

- conservation: Σ_d alloc[e, d] = Σ_r tokens[r, e] for every expert, and Σ_d route[r, e, d] = tokens[r, e];
- exact balance: Σ_e alloc[e, d] = CAP_d for every rank;
- roles: a rank with positive balance (a *donor*) only sends, one with negative balance (a *receiver*) only
  receives; replicas live on receivers only, and each (donor, receiver) pair exchanges at most one move;
- at most R − 1 moves: each move zeroes the balance of h or of u (both on the last move), and a rank at zero
  is never picked again.

Replica bound. Let receiver u receive k_u moves (k_u ≤ number of donors ≤ R − 1) of M_u entries in all
(M_u = CAP_u minus the load of u's own experts), and c = ⌊total/R⌋. Then

    replicas(u) ≤ k_u + ⌈(E/R) · k_u·M_u / (k_u·c + M_u)⌉ − 1  ≤  k_u + E/R − 1  ≤  R + E/R − 2.

Proof. Consider one move of m entries from donor h that touches j experts. Its first j − 1 experts are
drained whole and are the j − 1 largest remaining counts of h, so their sum is at least (j − 1)/(E/R) of h's
remaining total; that total is at least CAP_h + m (h ends with exactly CAP_h entries and this move is still
ahead). They sum to less than m (the j-th expert gets at least one entry), hence
j − 1 < (E/R) · m / (CAP_h + m) ≤ (E/R) · m / (c + m). Summing over u's moves (amounts m_i ≥ 1 adding up
to M_u), concavity of m / (c + m) gives Σ m_i / (c + m_i) ≤ k·M/(k·c + M), so
Σ (j_i − 1) < (E/R) · k·M/(k·c + M), which is the first inequality (an integer below y is at most ⌈y⌉ − 1).
Moves into u come from distinct donors, so their experts are distinct and replicas(u) = Σ j_i. For the
second: k·M/(k·c + M) ≤ 1 iff M·(k − 1) ≤ k·c, true since M ≤ CAP_u ≤ c + 1 and k ≤ M. A single move
(k = 1, M ≤ c + 1) can thus touch at most about half of a donor's experts plus one. The bound is reached,
e.g., with E/R = 1 and R − 1 donors each one entry over CAP all sending to the one rank below CAP: R − 1
moves and R − 1 replicas there. ∎

Summed over ranks, replicas ≤ moves + min(#donors, #receivers)·(E/R − 1) ≤ (R − 1) + ⌊R/2⌋·(E/R − 1); the
donor side of the min holds because a donor drains at most E/R − 1 of its experts (it keeps CAP_h ≥ 1
entries when total ≥ R) and every touched expert but the last of each move is drained.

:func:`home_plan` is the same data structure for plain expert parallelism (no replicas, unequal loads):
the baseline that the benchmark compares against, and the same dispatch code runs either plan.

The greedy is a loop over at most R − 1 moves of at most E/R experts each; the per-rank sums, the home
routes and the interval cuts of the (few) replicated experts are vectorised. ``route`` is kept dense
([R, E, R], 32 MB at R = 64, E = 1024) because the dispatch slices it by source and by destination; such a
plan takes tens of milliseconds on one CPU core, most of it filling ``route``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["MoonEPMove", "MoonEPPlan", "home_plan", "moonep_plan"]


@dataclass(frozen=True)
class MoonEPMove:
    """One greedy step: ``pieces`` = ((expert, entries), ...) moved from donor ``source`` to ``dest``."""

    source: int
    """Donor rank h (the home of every expert in ``pieces``)."""
    dest: int
    """Receiving rank u; it holds a temporary replica of every expert in ``pieces``."""
    pieces: tuple[tuple[int, int], ...]
    """(global expert id, entries moved) in the order taken: largest remaining count first."""

    @property
    def amount(self) -> int:
        return sum(count for _, count in self.pieces)


@dataclass(frozen=True)
class MoonEPPlan:
    """Where every routed entry is processed. All tensors are int64 on the CPU; every rank computes the same
    plan from the same all-gathered counts, so no plan is ever communicated."""

    experts_per_rank: int
    """E/R; rank h is the home of experts [h·experts_per_rank, (h+1)·experts_per_rank)."""
    tokens: torch.Tensor
    """[R, E] input: entries source rank r routes to expert e."""
    cap: torch.Tensor
    """[R] entries rank d processes. MoonEP: ⌊total/R⌋ (+1 on the first total mod R ranks); home plan:
    the load of the rank's own experts."""
    alloc: torch.Tensor
    """[E, R] entries of expert e processed on rank d (Σ_d = the expert's total, Σ_e = cap)."""
    route: torch.Tensor
    """[R, E, R] entries source rank r sends to rank d for expert e (Σ_d = tokens[r, e])."""
    replicas: tuple[tuple[int, ...], ...]
    """Per rank, the sorted foreign experts it processes entries of (and so must fetch weights for)."""
    moves: tuple[MoonEPMove, ...]
    """The greedy steps, in order (empty for the home plan)."""

    @property
    def num_ranks(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.tokens.shape[1])

    def home_rank(self, expert: int) -> int:
        return expert // self.experts_per_rank

    def send_counts(self) -> torch.Tensor:
        """[R, R]: entries source rank r sends to rank d (all experts together)."""
        return self.route.sum(dim=1)

    def moves_into(self, rank: int) -> int:
        """Number of greedy moves that rank ``rank`` received (k_u of the replica bound)."""
        return sum(1 for move in self.moves if move.dest == rank)

    def replica_bound(self, rank: int) -> int:
        """The guaranteed maximum of ``len(replicas[rank])`` (module docstring): with k moves into ``rank``
        carrying M entries in all and c = ⌊total/R⌋, k + ⌈(E/R)·k·M / (k·c + M)⌉ − 1, and 0 without moves."""
        k = self.moves_into(rank)
        if k == 0:
            return 0
        received = sum(move.amount for move in self.moves if move.dest == rank)
        c = int(self.tokens.sum()) // self.num_ranks
        return k - 1 - (-(self.experts_per_rank * k * received) // (k * c + received))


# --------------------------------------------------------------------------------------------------------
# validation


def _check_inputs(tokens_per_expert: object, experts_per_rank: object) -> np.ndarray:
    if isinstance(experts_per_rank, bool) or not isinstance(experts_per_rank, int) or experts_per_rank <= 0:
        raise ValueError(f"experts_per_rank must be a positive integer, got {experts_per_rank!r}")
    if not isinstance(tokens_per_expert, torch.Tensor):
        raise ValueError(f"tokens_per_expert must be a torch.Tensor, got {type(tokens_per_expert).__name__}")
    if tokens_per_expert.dtype.is_floating_point or tokens_per_expert.dtype.is_complex \
            or tokens_per_expert.dtype == torch.bool:
        raise ValueError(f"tokens_per_expert must hold integers, got dtype {tokens_per_expert.dtype}")
    if tokens_per_expert.dim() != 2 or tokens_per_expert.shape[0] == 0:
        raise ValueError(
            f"tokens_per_expert must be [num_ranks, num_experts] with num_ranks >= 1, "
            f"got shape {tuple(tokens_per_expert.shape)}"
        )
    num_ranks, num_experts = tokens_per_expert.shape
    if num_experts % num_ranks:
        raise ValueError(
            f"num_experts E={num_experts} (columns of tokens_per_expert) is not divisible by the number of "
            f"ranks R={num_ranks}"
        )
    if num_experts != num_ranks * experts_per_rank:
        raise ValueError(
            f"experts_per_rank={experts_per_rank} does not match tokens_per_expert: E={num_experts} experts "
            f"over R={num_ranks} ranks is {num_experts // num_ranks} per rank"
        )
    tokens = tokens_per_expert.detach().cpu().to(torch.int64).numpy()
    if (tokens < 0).any():
        r, e = (int(i) for i in np.argwhere(tokens < 0)[0])
        raise ValueError(f"tokens_per_expert must be non-negative, got {int(tokens[r, e])} at rank {r}, expert {e}")
    return tokens


def _replicas(alloc: np.ndarray, experts_per_rank: int) -> tuple[tuple[int, ...], ...]:
    num_experts, num_ranks = alloc.shape
    home = np.arange(num_experts) // experts_per_rank
    foreign = (alloc > 0) & (home[:, None] != np.arange(num_ranks)[None, :])
    return tuple(tuple(int(e) for e in np.flatnonzero(foreign[:, d])) for d in range(num_ranks))


def _route(tokens: np.ndarray, alloc: np.ndarray, experts_per_rank: int) -> np.ndarray:
    """[R, E, R]: each expert's source entries (rank order) cut at its cumulative allocation (rank order)."""
    num_ranks, num_experts = tokens.shape
    home = np.arange(num_experts) // experts_per_rank
    route = np.zeros((num_ranks, num_experts, num_ranks), dtype=np.int64)
    at_home = alloc[np.arange(num_experts), home] == alloc.sum(axis=1)
    # Experts processed entirely on their home rank (all but the few the greedy touched): all entries go home.
    whole = np.flatnonzero(at_home)
    route[:, whole, home[whole]] = tokens[:, whole]
    # The others, including experts drained entirely to foreign ranks, are cut at the cumulative allocation.
    cut = np.flatnonzero(~at_home)
    if cut.size:
        src_hi = np.cumsum(tokens[:, cut].T, axis=1)  # [n, R_src]
        src_lo = src_hi - tokens[:, cut].T
        dst_hi = np.cumsum(alloc[cut], axis=1)  # [n, R_dst]
        dst_lo = dst_hi - alloc[cut]
        overlap = np.minimum(src_hi[:, :, None], dst_hi[:, None, :]) - np.maximum(src_lo[:, :, None], dst_lo[:, None, :])
        route[:, cut, :] = np.clip(overlap, 0, None).transpose(1, 0, 2)
    return route


def _plan(tokens: np.ndarray, experts_per_rank: int, alloc: np.ndarray, cap: np.ndarray,
          moves: tuple[MoonEPMove, ...]) -> MoonEPPlan:
    return MoonEPPlan(
        experts_per_rank=experts_per_rank,
        tokens=torch.from_numpy(tokens.copy()),
        cap=torch.from_numpy(cap),
        alloc=torch.from_numpy(alloc),
        route=torch.from_numpy(_route(tokens, alloc, experts_per_rank)),
        replicas=_replicas(alloc, experts_per_rank),
        moves=moves,
    )


# --------------------------------------------------------------------------------------------------------
# planners


def moonep_plan(tokens_per_expert: torch.Tensor, experts_per_rank: int) -> MoonEPPlan:
    """The exactly balanced MoonEP plan for ``tokens_per_expert`` [R, E] (see the module docstring).

    Raises ``ValueError`` for a non-integer, non-2-D or negative input, for E not divisible by R, and for an
    ``experts_per_rank`` other than E/R.
    """
    tokens = _check_inputs(tokens_per_expert, experts_per_rank)
    num_ranks, num_experts = tokens.shape
    expert_load = tokens.sum(axis=0)
    total = int(expert_load.sum())
    cap = np.full(num_ranks, total // num_ranks, dtype=np.int64)
    cap[: total % num_ranks] += 1

    remaining = expert_load.reshape(num_ranks, experts_per_rank).copy()  # entries still on the home rank
    balance = remaining.sum(axis=1) - cap
    alloc = np.zeros((num_experts, num_ranks), dtype=np.int64)
    moves: list[MoonEPMove] = []
    while balance.max() > 0:
        h, u = int(np.argmax(balance)), int(np.argmin(balance))  # first index on ties: deterministic
        amount = int(min(balance[h], -balance[u]))
        pieces: list[tuple[int, int]] = []
        left = amount
        # Stable sort on the negated counts: largest remaining first, lower expert id on ties.
        for j in np.argsort(-remaining[h], kind="stable"):
            take = int(min(left, remaining[h, j]))
            expert = h * experts_per_rank + int(j)
            remaining[h, j] -= take
            alloc[expert, u] += take
            pieces.append((expert, take))
            left -= take
            if left == 0:
                break
        balance[h] -= amount
        balance[u] += amount
        moves.append(MoonEPMove(source=h, dest=u, pieces=tuple(pieces)))
    # What was not moved stays on the home rank.
    alloc[np.arange(num_experts), np.arange(num_experts) // experts_per_rank] = remaining.reshape(-1)
    return _plan(tokens, experts_per_rank, alloc, cap, tuple(moves))


def home_plan(tokens_per_expert: torch.Tensor, experts_per_rank: int) -> MoonEPPlan:
    """Plain expert parallelism as a plan: every entry goes to its expert's home rank (no replicas), so
    ``cap`` is each rank's own experts' load. Same validation as :func:`moonep_plan`."""
    tokens = _check_inputs(tokens_per_expert, experts_per_rank)
    num_ranks, num_experts = tokens.shape
    expert_load = tokens.sum(axis=0)
    alloc = np.zeros((num_experts, num_ranks), dtype=np.int64)
    alloc[np.arange(num_experts), np.arange(num_experts) // experts_per_rank] = expert_load
    cap = expert_load.reshape(num_ranks, experts_per_rank).sum(axis=1)
    return _plan(tokens, experts_per_rank, alloc, cap, ())
