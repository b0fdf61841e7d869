"""KDA context parallelism over ``torch.distributed``: one long sequence, a contiguous segment per rank.

Rank ``r`` of the group holds tokens ``[t_r, t_r + T_r)`` of every batch row (segments may have any length,
including 0). The forward pass is three steps:

1. **Header.** One ``all_gather`` of a small fixed-size vector per rank: its shapes, dtype, scale, whether an
   initial state is given and whether the call will be differentiated, plus its local validation error (as
   UTF-8 bytes, never pickled). Every rank checks the gathered headers the same way, so a bad input on one
   rank (another H or K, a malformed tensor) raises the same ``ValueError`` on every rank and none is left
   waiting in the next collective.
2. **Transitions.** Each rank computes its segment's affine map ``S -> M S + S_ext``
   (:func:`k3.kernels.kda.context_parallel.kda_segment_transition`); one ``all_gather`` gives every rank all
   ``R`` pairs (and every rank's copy of the initial state, which must agree), and every rank folds them
   (:func:`~k3.kernels.kda.context_parallel.fold_segment_transitions`) into all prefix states.
3. **Outputs.** Each rank runs :func:`k3.kernels.kda.reference.kda_chunk` on its segment from its incoming
   state. Every rank therefore passes over its tokens twice (transition, then outputs); the ranks never wait
   on each other beyond the two gathers.

The final state (after the last token of the last rank) is returned on **every** rank; all ranks compute the
same value from the same gathered pairs.

Gradients
---------
The gather is an autograd function whose backward sums (reduce-scatters) the gradients that every rank's
graph gives the gathered pairs and hands each rank the sum for its own pair; autograd differentiates
everything else locally (the transition, the fold, the chunked pass). The distributed loss is the *sum* of
the ranks' losses, so each rank's own ``(M, S_ext)`` receives exactly the sum of what every rank's loss asks
of it and nothing is counted twice: the local pair enters the graph only through the gather. A gradient
through the returned final state counts once per rank that uses it (put it in one rank's loss to match a
single device).
The initial state is a replicated input, like a data-parallel parameter: its gradient is summed over the
ranks too, so every rank's ``initial_state.grad`` is the full single-device gradient.

The backward pass runs one ``reduce_scatter``: the block sent to rank ``j`` holds the gradient of rank ``j``'s
pair and the initial-state gradient, so rank ``j`` receives the sums it needs and nothing else. Because it is
a collective, **every rank must call backward** on a loss built from the returned tensors. Each rank's output
is tied to the gather, so the gather is in every rank's graph even where the output needs no other rank (an
empty segment), and the gather is recorded whenever the call is differentiated, even where the pair is
constant; a rank without the node would skip the reduce-scatter and leave the others waiting.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from k3.kernels.kda.context_parallel import fold_segment_transitions, kda_segment_transition
from k3.kernels.kda.reference import _check_inputs, _compute_dtype, kda_chunk

__all__ = ["kda_context_parallel"]

_DTYPE_CODES = {torch.float32: 1, torch.float64: 2, torch.bfloat16: 3, torch.float16: 4}
_MESSAGE_BYTES = 512  # room for a local validation error in the header; longer messages are truncated
_FIELDS = ("error", "B", "T", "H", "K", "V", "dtype", "has_initial_state", "differentiable", "scale")
_SAME_ON_EVERY_RANK = ("B", "H", "K", "V", "dtype", "has_initial_state", "differentiable", "scale")


# --------------------------------------------------------------------------------------------------------
# header exchange and validation


def _local_error(q, k, v, g, beta, initial_state, scale, chunk_size) -> str:
    """This rank's validation error, or ``""``: checked locally, reported by every rank after the header."""
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if q.dtype not in _DTYPE_CODES:
        return f"q must be a floating-point tensor of {sorted(str(d) for d in _DTYPE_CODES)}, got {q.dtype}"
    if initial_state is not None and not isinstance(initial_state, Tensor):
        return f"initial_state must be a torch.Tensor or None, got {type(initial_state).__name__}"
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, int | float)):
        return f"scale must be a number or None, got {scale!r}"
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        return f"chunk_size must be a positive int, got {chunk_size!r}"
    try:
        _check_inputs(q, k, v, g, beta, initial_state, None)
    except ValueError as error:
        return str(error)
    return ""


def _header(q, v, initial_state, scale, error: str, differentiable: bool) -> Tensor:
    """The fixed-length float64 header of :data:`_FIELDS` (shapes are -1 when this rank's inputs are bad)."""
    if error:
        shape = [-1] * 5
        dtype_code = -1
        resolved_scale = -1.0
    else:
        shape = [*q.shape, v.shape[-1]]
        dtype_code = _DTYPE_CODES[q.dtype]
        resolved_scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    values = [float(bool(error)), *map(float, shape), float(dtype_code), float(initial_state is not None),
              float(differentiable), resolved_scale]
    return torch.tensor(values, dtype=torch.float64)


def _encode(message: str) -> Tensor:
    data = message.encode("utf-8")[:_MESSAGE_BYTES]
    return torch.tensor(list(data) + [0] * (_MESSAGE_BYTES - len(data)), dtype=torch.uint8)


def _decode(data: Tensor) -> str:
    return bytes(data.tolist()).rstrip(b"\0").decode("utf-8", errors="replace")


def _exchange_headers(header: Tensor, message: Tensor, device, group) -> tuple[list[dict], list[str]]:
    """All-gather headers and error messages (one collective: the message bytes ride in float64 slots)."""
    packed = torch.cat([header, message.to(torch.float64)]).to(device)
    gathered = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, packed, group=group)
    headers, messages = [], []
    for row in gathered:
        row = row.cpu()
        headers.append(dict(zip(_FIELDS, row[: len(_FIELDS)].tolist(), strict=True)))
        messages.append(_decode(row[len(_FIELDS):].to(torch.uint8)))
    return headers, messages


def _check_headers(headers: list[dict], messages: list[str]) -> None:
    """Raise the same ``ValueError`` on every rank if any rank's inputs are bad or the ranks disagree."""
    for rank, (h, message) in enumerate(zip(headers, messages, strict=True)):
        if h["error"]:
            raise ValueError(f"kda_context_parallel: rank {rank}: {message}")
    for field in _SAME_ON_EVERY_RANK:
        values = [h[field] for h in headers]
        if len(set(values)) > 1:
            if field == "dtype":
                names = {code: str(d) for d, code in _DTYPE_CODES.items()}
                values = [names[int(c)] for c in values]
            elif field != "scale":
                values = [int(x) for x in values]
            raise ValueError(
                f"kda_context_parallel: {field} must be the same on every rank, got {values} (by rank)"
            )


# --------------------------------------------------------------------------------------------------------
# differentiable gather of the segment transitions


class _GatherTransitions(torch.autograd.Function):
    """All ranks' ``(M, S_ext)`` stacked ``[R, ...]``, and the initial state (rank 0's copy, checked equal to
    every other rank's). Backward: one reduce-scatter that sums, for each rank, its own pair's gradient and
    the whole initial-state gradient."""

    @staticmethod
    def forward(ctx, M: Tensor, S_ext: Tensor, initial_state: Tensor, replicated: bool, group, record):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [M.reshape(-1), S_ext.reshape(-1)] + ([initial_state.reshape(-1)] if replicated else [])
        flat = torch.cat(parts).contiguous()
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat, group=group)
        n_m, n_s = M.numel(), S_ext.numel()
        M_all = torch.stack([row[:n_m].view(M.shape) for row in gathered])
        S_all = torch.stack([row[n_m : n_m + n_s].view(S_ext.shape) for row in gathered])
        if replicated:
            copies = [row[n_m + n_s :].view(initial_state.shape) for row in gathered]
            differ = [r for r, copy in enumerate(copies) if not torch.equal(copy, copies[0])]
            if differ:  # every rank sees the same copies, so every rank raises
                raise ValueError(
                    f"kda_context_parallel: initial_state must be identical on every rank; ranks {differ} "
                    "differ from rank 0"
                )
            initial_state = copies[0].clone()
        else:
            initial_state = initial_state.clone()
        ctx.group, ctx.rank, ctx.world, ctx.replicated = group, rank, world, replicated
        ctx.shapes = (M.shape, S_ext.shape, initial_state.shape)
        return M_all, S_all, initial_state

    @staticmethod
    def backward(ctx, grad_M_all: Tensor, grad_S_all: Tensor, grad_initial: Tensor):
        # Row j goes to rank j: this rank's gradient for rank j's pair, then (replicated) the initial state's,
        # so the summed row j is everything rank j's pair and initial state receive from all losses.
        parts = [grad_M_all.reshape(ctx.world, -1), grad_S_all.reshape(ctx.world, -1)]
        if ctx.replicated:
            parts.append(grad_initial.reshape(1, -1).expand(ctx.world, -1))
        rows = torch.cat(parts, dim=1).contiguous()
        mine = rows.new_empty(rows.shape[1])
        dist.reduce_scatter_tensor(mine, rows.reshape(-1), group=ctx.group)
        m_shape, s_shape, i_shape = ctx.shapes
        n_m, n_s = m_shape.numel(), s_shape.numel()
        grad_M = mine[:n_m].view(m_shape)
        grad_S = mine[n_m : n_m + n_s].view(s_shape)
        grad_init = mine[n_m + n_s :].view(i_shape) if ctx.replicated else None
        return grad_M, grad_S, grad_init, None, None, None


class _TieToGather(torch.autograd.Function):
    """Returns ``x``; its backward gives ``anchor`` a zero gradient, so the gather (and its reduce-scatter)
    runs in every rank's backward pass even where ``x`` does not depend on it (an empty segment)."""

    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor) -> Tensor:
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return x.clone()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, grad.new_zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype)


# --------------------------------------------------------------------------------------------------------
# the entry point


def kda_context_parallel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    group=None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """KDA over one long sequence split across the ranks of ``group``; a collective (every rank must call it).

    Args:
        q, k, g: ``[B, T_r, H, K]``, this rank's contiguous segment (rank order = token order); ``T_r`` may
            differ between ranks and may be 0. Layout and conventions as :mod:`k3.kernels.kda.reference`.
        v: ``[B, T_r, H, V]``; ``beta``: ``[B, T_r, H]``.
        group: the process group (default: the world); B, H, K, V, dtype and scale must agree on every rank.
        scale: output scale (default ``K ** -0.5``).
        initial_state: ``[B, H, K, V]`` state before the first token of rank 0's segment; given on every rank
            with identical values, or on none (zeros).
        chunk_size: tokens per chunk of the local chunked passes.

    Returns:
        ``(o, final_state)``: this rank's outputs ``[B, T_r, H, V]`` (dtype of ``v``) and, on every rank, the
        state after the whole sequence ``[B, H, K, V]`` (fp32; fp64 for fp64 inputs). Both equal the
        single-device :func:`~k3.kernels.kda.reference.kda_chunk` on the concatenated sequence.

    Raises:
        RuntimeError: without an initialised ``torch.distributed`` process group.
        ValueError: on every rank, if any rank's inputs are malformed or the ranks disagree (the message
            names the rank or the field).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("kda_context_parallel needs an initialised torch.distributed process group")
    grad_inputs = [x for x in (k, v, g, beta, initial_state) if isinstance(x, Tensor)]
    differentiable = torch.is_grad_enabled() and any(x.requires_grad for x in grad_inputs)
    error = _local_error(q, k, v, g, beta, initial_state, scale, chunk_size)
    header = _header(q, v, initial_state, scale, error, differentiable)
    device = q.device if isinstance(q, Tensor) else torch.device("cpu")
    _check_headers(*_exchange_headers(header, _encode(error), device, group))

    rank = dist.get_rank(group)
    B, _, H, K = q.shape
    dtype = _compute_dtype(q)  # the reference computes in q's precision; the pair follows it
    M, S_ext = (x.to(dtype) for x in kda_segment_transition(k, v, g, beta, chunk_size))
    start = (
        initial_state.to(dtype)
        if initial_state is not None
        else torch.zeros(B, H, K, v.shape[-1], dtype=dtype, device=q.device)
    )
    # `record` makes autograd record the gather on every rank of a differentiated call, even where the pair
    # is constant (an empty segment): a rank without the node would skip the backward reduce-scatter and hang
    # the others.
    record = torch.zeros((), dtype=dtype, device=q.device, requires_grad=differentiable)
    M_all, S_all, start = _GatherTransitions.apply(M, S_ext, start, initial_state is not None, group, record)
    states = fold_segment_transitions(M_all, S_all, start)
    o, _ = kda_chunk(q, k, v, g, beta, scale=scale, initial_state=states[rank], chunk_size=chunk_size)
    if differentiable:
        o = _TieToGather.apply(o, M_all)
    return o, states[-1]
