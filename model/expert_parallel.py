"""Expert parallelism for the LatentMoE: MoonEP-balanced dispatch and combine over ``torch.distributed``.

The model code (``moe.py``) knows nothing about ranks; this module wraps a :class:`LatentMoE` so that its
routed experts are sharded over a process group, E/R experts per rank, while the router, W_down, the latent
RMSNorm, W_up and the shared experts stay replicated (data-parallel).

One forward step of :func:`expert_parallel_experts` (every rank runs the same sequence of collectives):

1. **Header.** One ``all_gather`` of a small fixed-size integer vector per rank: the shapes and dtypes of its
   inputs and the range of its expert ids. Every rank runs every validation on the gathered headers, so a bad
   input on one rank (ids ≥ E, a different token count, a wrong expert shard) raises the same ``ValueError``
   on every rank and no rank is left waiting in a later collective.
2. **Counts.** One ``all_gather`` of each rank's per-expert entry counts gives every rank the same [R, E]
   matrix, from which every rank computes the same plan (:func:`k3.model.moonep.moonep_plan`, or
   :func:`~k3.model.moonep.home_plan` for plain expert parallelism). The plan is never sent.
3. **Dispatch.** One ``all_to_all_single``. The message from rank h to rank d holds the latent rows of the
   entries h routes to d (grouped by expert) followed by the flattened weights (w_in, w_out) of h's experts
   that d replicates. Packing both into one message keeps a single collective per direction, which also
   fixes the order of the collectives in the backward pass (see below).
4. **Compute.** Rank d runs SiTU-GLU on its received rows, grouped by expert, with its own experts' weights
   or the fetched replica weights. Under MoonEP it always processes exactly CAP rows.
5. **Combine.** One ``all_to_all_single`` returns the outputs to their source ranks, which weight them by the
   router probabilities and sum over the top-k slots.

Backward. Both all_to_alls are autograd Functions whose backward is the reverse all_to_all. The combine's
backward necessarily runs before the dispatch's (the dispatch's gradient is computed from it), so every rank
issues the two backward collectives in the same order. The dispatch's backward carries the gradients of the
received rows back to their sources and the gradients of the replica weights back to their home rank, where
autograd adds them into the home expert's gradient (the packing was an index_select of the home weights).
A rank that receives nothing still has to take part in the backward all_to_alls, so its (empty) output is
tied to its received buffer (:class:`_KeepInGraph`).

Design decisions:

- Split sizes of ``all_to_all_single`` are host integers, so the counts are read on the host once per step;
  under MoonEP the receive sizes (CAP) are the same every step, only the send splits vary.
- Each entry carries its token's latent row (K copies of a token that picks K experts): the simplest correct
  scheme; deduplicating rows per destination is left to a fused kernel.
- Replica weights travel in the activation dtype (they are cast before packing).
- Replicated parameters get per-rank gradients from the rank's own tokens;
  :meth:`ExpertParallelLatentMoE.all_reduce_replicated_grads` sums them over the group (what data-parallel
  training does anyway), after which every gradient equals the single-process layer's on the union of the
  ranks' tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from k3.model.moe import LatentMoE
from k3.model.moonep import MoonEPPlan, home_plan, moonep_plan
from k3.model.situ import situ_glu

__all__ = ["PLANNERS", "ExpertParallelLatentMoE", "all_to_all", "expert_parallel_experts"]

PLANNERS: dict[str, Callable[[Tensor, int], MoonEPPlan]] = {"moonep": moonep_plan, "home": home_plan}
"""Planner names accepted by :class:`ExpertParallelLatentMoE`: MoonEP, or plain expert parallelism."""

_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.bfloat16: 3, torch.float16: 4}


# --------------------------------------------------------------------------------------------------------
# differentiable all_to_all


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send_splits`` go to the ranks in order; the result holds ``recv_splits`` rows
    from each rank. The gradient goes back by the reverse all_to_all."""

    @staticmethod
    def forward(ctx, x: Tensor, send_splits: list[int], recv_splits: list[int], group) -> Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        out = grad.new_empty((sum(ctx.send_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return out, None, None, None


def all_to_all(x: Tensor, send_splits: list[int], recv_splits: list[int], group=None) -> Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 (split sizes are row counts, one per rank)."""
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group)


class _KeepInGraph(torch.autograd.Function):
    """Returns ``x``; its backward gives ``anchor`` a zero gradient, so the node that produced ``anchor`` (a
    collective) runs in the backward pass even when ``x`` does not depend on it."""

    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor) -> Tensor:
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad.new_zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype)


# --------------------------------------------------------------------------------------------------------
# header exchange and validation

_FIELDS = (
    "z_dim", "tokens", "latent", "ids_dim", "ids_rows", "top_k", "ids_integer", "weights_dim", "weights_rows",
    "weights_cols", "w_in_dim", "experts_per_rank", "w_in_rows", "w_in_cols", "w_out_dim", "w_out_0",
    "w_out_rows", "inter", "z_dtype", "weights_dtype", "w_dtype", "num_experts",
)
"""Header fields every rank must agree on (then the id range, which is checked, not compared)."""


def _dims(t: Tensor, n: int) -> list[int]:
    """``[t.dim(), size_0, ..., size_{n-1}]``, padded with -1 (the header has a fixed length)."""
    shape = list(t.shape[:n])
    return [t.dim(), *shape, *([-1] * (n - len(shape)))]


def _header(z: Tensor, ids: Tensor, weights: Tensor, w_in: Tensor, w_out: Tensor, num_experts: int) -> list[int]:
    integer = not (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool)
    if integer and ids.numel():
        id_min, id_max = int(ids.min()), int(ids.max())
    else:
        id_min, id_max = 0, -1
    w_dtype = _DTYPE_CODES.get(w_in.dtype, 0) if w_in.dtype == w_out.dtype else -1
    values = [
        *_dims(z, 2), *_dims(ids, 2), int(integer), *_dims(weights, 2), *_dims(w_in, 3), *_dims(w_out, 3),
        _DTYPE_CODES.get(z.dtype, 0), _DTYPE_CODES.get(weights.dtype, 0), w_dtype, num_experts,
    ]
    return values + [id_min, id_max]


def _first_error(headers: list[dict[str, int]], num_ranks: int) -> str | None:
    """The first problem found in the gathered headers, as the message every rank raises (or None)."""
    for rank, h in enumerate(headers):
        where = f"rank {rank}"
        if h["z_dim"] != 2:
            return f"{where}: z must be [tokens, latent], got a {h['z_dim']}-D tensor"
        if h["ids_dim"] != 2 or not h["ids_integer"] or h["ids_rows"] != h["tokens"]:
            return (
                f"{where}: expert ids must be an integer tensor [tokens, top_k] with tokens = {h['tokens']} "
                f"(rows of z), got {h['ids_dim']}-D with {h['ids_rows']} rows (integer: {bool(h['ids_integer'])})"
            )
        if (h["weights_dim"], h["weights_rows"], h["weights_cols"]) != (2, h["tokens"], h["top_k"]):
            return f"{where}: router weights must have the shape of the expert ids ({h['tokens']}, {h['top_k']})"
        if h["w_in_dim"] != 3 or h["w_out_dim"] != 3 or h["w_in_cols"] != h["latent"] \
                or h["w_out_0"] != h["experts_per_rank"] or h["w_out_rows"] != h["latent"] \
                or h["w_in_rows"] != 2 * h["inter"]:
            return (
                f"{where}: expert shards must be w_in [experts_per_rank, 2*inter, latent] and "
                f"w_out [experts_per_rank, latent, inter] with latent = {h['latent']} (columns of z)"
            )
        for name, what in (("z_dtype", "z must have a"), ("weights_dtype", "router weights must have a"),
                           ("w_dtype", "w_in and w_out must share one")):
            if h[name] <= 0:
                return f"{where}: {what} floating dtype (float32, float64, bfloat16, float16)"
    for field in _FIELDS:
        values = [h[field] for h in headers]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            return f"expert-parallel inputs must agree on every rank, but {field} differs ({per_rank})"
    first = headers[0]
    num_experts = first["num_experts"]
    if num_experts % num_ranks:
        return f"num_experts E={num_experts} is not divisible by the number of ranks R={num_ranks}"
    if first["experts_per_rank"] * num_ranks != num_experts:
        return (
            f"each rank holds {first['experts_per_rank']} experts, but num_experts E={num_experts} over "
            f"R={num_ranks} ranks needs {num_experts // num_ranks} per rank"
        )
    for rank, h in enumerate(headers):
        if h["id_min"] < 0 or h["id_max"] >= num_experts:
            bad = h["id_min"] if h["id_min"] < 0 else h["id_max"]
            return f"expert ids must be in [0, {num_experts}): rank {rank} routes to expert {bad}"
    return None


def _gather_counts(z: Tensor, ids: Tensor, weights: Tensor, w_in: Tensor, w_out: Tensor, num_experts: int,
                   group) -> Tensor:
    """Validate the inputs of every rank (same error everywhere), then all-gather the [R, E] entry counts."""
    num_ranks = dist.get_world_size(group)
    header = torch.tensor(_header(z, ids, weights, w_in, w_out, num_experts), dtype=torch.int64, device=z.device)
    gathered = [torch.empty_like(header) for _ in range(num_ranks)]
    dist.all_gather(gathered, header, group=group)
    names = (*_FIELDS, "id_min", "id_max")
    headers = [dict(zip(names, h.tolist(), strict=True)) for h in gathered]
    error = _first_error(headers, num_ranks)
    if error is not None:
        raise ValueError(error)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts).to(torch.int64)
    rows = [torch.empty_like(counts) for _ in range(num_ranks)]
    dist.all_gather(rows, counts, group=group)
    return torch.stack(rows).cpu()


# --------------------------------------------------------------------------------------------------------
# dispatch, compute, combine


def expert_parallel_experts(
    z: Tensor,
    ids: Tensor,
    weights: Tensor,
    w_in: Tensor,
    w_out: Tensor,
    *,
    num_experts: int,
    beta1: float = 4.0,
    beta2: float = 25.0,
    planner: Callable[[Tensor, int], MoonEPPlan] = moonep_plan,
    group=None,
) -> tuple[Tensor, MoonEPPlan]:
    """The routed-expert sum u = Σ_k weights[:, k] · Expert_{ids[:, k]}(z), computed expert-parallel.

    ``z`` [S, latent] (this rank's tokens' latent rows), ``ids`` [S, K] global expert ids, ``weights`` [S, K]
    router weights, ``w_in`` [E/R, 2·inter, latent] / ``w_out`` [E/R, latent, inter] this rank's experts
    (rank h holds experts [h·E/R, (h+1)·E/R)). Returns (u [S, latent] fp32, the step's plan). Collective:
    every rank of ``group`` must call it with the same shapes; invalid inputs on any rank raise the same
    ``ValueError`` on every rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("expert_parallel_experts needs an initialised torch.distributed process group")
    num_ranks, me = dist.get_world_size(group), dist.get_rank(group)
    counts = _gather_counts(z, ids, weights, w_in, w_out, num_experts, group)
    epr = num_experts // num_ranks
    plan = planner(counts, epr)
    device, latent, top_k = z.device, z.shape[1], ids.shape[1]
    inter = w_out.shape[2]
    width = 3 * inter * latent  # one expert's flattened (w_in, w_out)

    # ---- dispatch: entries sorted by (destination, expert), each destination's replica weights after them
    route = plan.route
    flat_ids = ids.reshape(-1)
    by_expert = torch.argsort(flat_ids, stable=True)
    bounds = route[me].reshape(-1).cumsum(0).to(device)  # over (expert, destination) pairs, expert-major
    slot = torch.searchsorted(bounds, torch.arange(flat_ids.numel(), device=device), right=True)
    send_order = by_expert[torch.argsort((slot % num_ranks) * num_experts + slot // num_ranks, stable=True)]
    rows_to = route[me].sum(0).tolist()
    rows_from = route[:, :, me].sum(1).tolist()
    homed = [[e - me * epr for e in plan.replicas[d] if plan.home_rank(e) == me] for d in range(num_ranks)]
    replicas_from = [sum(1 for e in plan.replicas[me] if plan.home_rank(e) == r) for r in range(num_ranks)]

    stacked = torch.cat([w_in.reshape(epr, -1), w_out.reshape(epr, -1)], dim=1).to(z.dtype)
    z_send = z.index_select(0, send_order // top_k)
    w_send = stacked.index_select(0, torch.tensor([i for d in homed for i in d], dtype=torch.long, device=device))
    pieces: list[Tensor] = []
    for z_part, w_part in zip(z_send.split(rows_to), w_send.split([len(d) for d in homed]), strict=True):
        pieces += [z_part.reshape(-1), w_part.reshape(-1)]
    received = all_to_all(
        torch.cat(pieces),
        [n * latent + len(d) * width for n, d in zip(rows_to, homed, strict=True)],
        [n * latent + m * width for n, m in zip(rows_from, replicas_from, strict=True)],
        group,
    )
    parts = received.split([s for n, m in zip(rows_from, replicas_from, strict=True)
                            for s in (n * latent, m * width)])
    z_recv = torch.cat(parts[0::2]).view(-1, latent)
    table = torch.cat(parts[1::2]).view(-1, width)

    # ---- compute: SiTU-GLU per expert over the received rows (source-major, expert-minor)
    recv_ids = torch.repeat_interleave(
        torch.arange(num_experts).repeat(num_ranks), route[:, :, me].reshape(-1)
    ).to(device)
    order = torch.argsort(recv_ids, stable=True)
    replica_row = {e: i for i, e in enumerate(plan.replicas[me])}
    outs: list[Tensor] = []
    start = 0
    for expert, count in enumerate(plan.alloc[:, me].tolist()):
        if count == 0:
            continue
        if expert // epr == me:
            e_in, e_out = w_in[expert - me * epr].to(z.dtype), w_out[expert - me * epr].to(z.dtype)
        else:
            row = table[replica_row[expert]]
            e_in = row[: 2 * inter * latent].view(2 * inter, latent)
            e_out = row[2 * inter * latent:].view(latent, inter)
        gate, linear = (z_recv[order[start:start + count]] @ e_in.t()).split(inter, dim=-1)
        outs.append(situ_glu(gate, linear, beta1, beta2) @ e_out.t())
        start += count
    if outs:
        out_recv = torch.cat(outs).index_select(0, torch.argsort(order))
    else:  # nothing received: keep the dispatch in this rank's backward graph
        out_recv = _KeepInGraph.apply(z_recv.new_zeros(0, latent), received)

    # ---- combine: outputs back to their sources, weighted sum over the top-k slots
    back = all_to_all(out_recv, rows_from, rows_to, group)
    out_entries = back.index_select(0, torch.argsort(send_order))
    u = (out_entries.float().view(-1, top_k, latent) * weights.float().unsqueeze(-1)).sum(dim=1)
    return u, plan


# --------------------------------------------------------------------------------------------------------
# the layer


class ExpertParallelLatentMoE(nn.Module):
    """A :class:`LatentMoE` with its routed experts sharded over ``group`` (E/R per rank, contiguous).

    Built from a full ``LatentMoE`` that is identical on every rank (same seed or same checkpoint): the
    router, W_down, latent norm, W_up and shared experts are taken over as they are (the same module objects),
    the rank's expert rows of ``w_in``/``w_out`` are copied into new parameters, and the full module can then
    be dropped. ``planner`` is ``"moonep"`` (exactly balanced) or ``"home"`` (plain expert parallelism).

    ``tokens_per_expert`` counts this rank's selections, as the single-process layer would on this rank's
    tokens; ``last_plan`` is the latest step's plan.
    """

    def __init__(self, moe: LatentMoE, group=None, planner: str = "moonep"):
        super().__init__()
        if not isinstance(moe, LatentMoE):
            raise ValueError(f"moe must be a LatentMoE, got {type(moe).__name__}")
        if planner not in PLANNERS:
            raise ValueError(f"planner must be one of {sorted(PLANNERS)}, got {planner!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ExpertParallelLatentMoE needs an initialised torch.distributed process group")
        num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)
        if moe.num_experts % num_ranks:
            raise ValueError(
                f"LatentMoE.num_experts E={moe.num_experts} is not divisible by the expert-parallel world "
                f"size R={num_ranks}"
            )
        self.group, self.planner = group, planner
        self.layer_idx, self.num_experts, self.top_k = moe.layer_idx, moe.num_experts, moe.top_k
        self.routed_scaling, self.beta1, self.beta2, self.inter = moe.routed_scaling, moe.beta1, moe.beta2, moe.inter
        self.num_ranks, self.rank = num_ranks, rank
        self.experts_per_rank = epr = moe.num_experts // num_ranks
        self.router, self.w_down, self.latent_norm, self.w_up = moe.router, moe.w_down, moe.latent_norm, moe.w_up
        self.shared_experts = moe.shared_experts
        self.w_in = nn.Parameter(moe.w_in.detach()[rank * epr:(rank + 1) * epr].clone())
        self.w_out = nn.Parameter(moe.w_out.detach()[rank * epr:(rank + 1) * epr].clone())
        self.register_buffer("expert_bias", moe.expert_bias.detach().clone())
        self.register_buffer("tokens_per_expert", torch.zeros_like(moe.tokens_per_expert), persistent=False)
        self.last_plan: MoonEPPlan | None = None

    @property
    def expert_range(self) -> range:
        """Global ids of the experts homed on this rank."""
        return range(self.rank * self.experts_per_rank, (self.rank + 1) * self.experts_per_rank)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        # The single-process layer's routing code, so both select and weight experts identically
        # (it only reads router, expert_bias and top_k, which this module has).
        return LatentMoE.route(self, x)  # type: ignore[arg-type]

    def reset_router_stats(self) -> None:
        self.tokens_per_expert.zero_()

    def forward(self, x: Tensor) -> Tensor:
        """x [..., d] -> [..., d]. Collective: every rank of the group calls it with the same shape."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids, _ = self.route(flat)
        u, plan = expert_parallel_experts(
            self.w_down(flat), ids, weights, self.w_in, self.w_out, num_experts=self.num_experts,
            beta1=self.beta1, beta2=self.beta2, planner=PLANNERS[self.planner], group=self.group,
        )
        with torch.no_grad():
            self.tokens_per_expert += plan.tokens[self.rank].to(self.tokens_per_expert.device)
        self.last_plan = plan
        y = self.w_up(self.latent_norm(u.to(x.dtype)))
        if self.routed_scaling != 1.0:
            y = y * self.routed_scaling
        for expert in self.shared_experts:
            y = y + expert(flat)
        return y.reshape(shape)

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The data-parallel parameters (everything but this rank's expert shard), in a fixed order."""
        return [p for name, p in self.named_parameters() if name not in ("w_in", "w_out")]

    def all_reduce_replicated_grads(self) -> None:
        """Sum the replicated parameters' gradients over the group (one all-reduce of a flat buffer).

        Missing gradients count as zero, so every rank contributes the same buffer size.
        """
        params = self.replicated_parameters()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        for p, g in zip(params, flat.split([g.numel() for g in grads]), strict=True):
            p.grad = g.view_as(p).clone()
