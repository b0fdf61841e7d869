"""Readable absorbed MLA decode over a paged latent cache (plain torch).

The cache holds, per token, exactly what :class:`k3.model.mla.MLACache` holds: ``c`` = RMSNorm(c_kv) *after*
the kv-norm (weight applied), R values, followed by the head-shared ``k_extra`` (e values, straight from W_kva):
``kv_cache [num_pages, page_size, R + e]`` (576 = 512 + 64 for the released shapes). Sequence ``b`` owns the
pages ``block_table[b, 0], block_table[b, 1], ...`` in order; its token ``s`` lives at row ``s % page_size`` of
page ``block_table[b, s // page_size]``. Pages need not be contiguous or ordered; entries past a sequence's
last page are ignored.

Decoding step (``Tq`` new tokens per sequence, 1 for plain decoding, up to a few for speculative
verification). The new tokens are already written to the cache and are the **last** ``Tq`` of the sequence's
``seq_lens[b]`` tokens; query ``t`` sits at position ``seq_lens[b] - Tq + t`` and sees keys ``s <= `` that
position (causal among the new tokens).

With W_kvb viewed per head as ``[W_uk (n x R); W_uv (v x R)]`` (see :mod:`k3.model.mla`):

    q_latent[h] = W_uk[h]^T q_nope[h]                               (absorb the key half into the query)
    score[h, s] = (q_latent[h] . c_s + q_extra[h] . k_extra_s) * scale,       scale = (n + e)^-1/2
    o_latent[h] = sum_s softmax(score[h])_s c_s                      (attend over latents)
    o[h]        = W_uv[h] o_latent[h]                                (absorb the value half into the output)
    out         = concat_h o[h] * sigmoid(gate_logits)               (gate_logits = W_g x; W_o is the caller's)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "check_paged_inputs",
    "gather_pages",
    "absorb_query",
    "absorb_output",
    "mla_decode_attention_reference",
    "mla_decode_reference",
]

DEFAULT_SCALE = 192**-0.5
"""``(qk_nope_dim + qk_extra_dim)^-1/2`` of the released shapes (128 + 64)."""


def check_paged_inputs(
    q_latent: Tensor, q_extra: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
    *, validate: bool = True,
) -> None:
    """Shapes/dtypes/devices always; ``seq_lens`` values (a host synchronisation on GPU) when ``validate``."""
    if q_latent.dim() != 4:
        raise ValueError(f"q_latent must be [B, Tq, H, R], got shape {tuple(q_latent.shape)}")
    B, Tq, H, R = q_latent.shape
    if q_extra.dim() != 4 or q_extra.shape[:3] != (B, Tq, H):
        raise ValueError(f"q_extra must be [B, Tq, H, e] with B, Tq, H = {B}, {Tq}, {H}, got {tuple(q_extra.shape)}")
    E = q_extra.shape[3]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != R + E:
        raise ValueError(f"kv_cache must be [num_pages, page_size, R + e = {R + E}], got {tuple(kv_cache.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be [B={B}, max_pages], got shape {tuple(block_table.shape)}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int32 or int64, got {block_table.dtype}")
    if seq_lens.shape != (B,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be an int32/int64 tensor [B={B}], got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if q_latent.dtype != q_extra.dtype or q_latent.dtype != kv_cache.dtype:
        raise ValueError(
            f"q_latent, q_extra and kv_cache must share one dtype, got {q_latent.dtype}, {q_extra.dtype}, "
            f"{kv_cache.dtype}"
        )
    devices = {t.device for t in (q_latent, q_extra, kv_cache, block_table, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if validate and B > 0:
        capacity = block_table.shape[1] * kv_cache.shape[1]
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < Tq or hi > capacity:
            raise ValueError(
                f"seq_lens must lie in [Tq={Tq}, max_pages * page_size = {capacity}] (the Tq new tokens are in the "
                f"cache), got values in [{lo}, {hi}]"
            )
        pages_used = (seq_lens.long() + kv_cache.shape[1] - 1) // kv_cache.shape[1]
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_used[:, None]
        ids = block_table[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= kv_cache.shape[0]):
            raise ValueError(f"block_table entries in use must lie in [0, num_pages={kv_cache.shape[0]})")


def gather_pages(kv_cache: Tensor, block_table: Tensor, seq_len: int, b: int) -> Tensor:
    """The ``[seq_len, R + e]`` cache rows of sequence ``b`` in token order."""
    page_size = kv_cache.shape[1]
    n_pages = -(-seq_len // page_size)
    pages = kv_cache[block_table[b, :n_pages].long()]  # [n_pages, page_size, R + e]
    return pages.reshape(-1, kv_cache.shape[2])[:seq_len]


def mla_decode_attention_reference(
    q_latent: Tensor, q_extra: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
    *, scale: float = DEFAULT_SCALE,
) -> Tensor:
    """Attention core over latents: ``o_latent [B, Tq, H, R]`` in ``q_latent``'s dtype (softmax in fp32)."""
    check_paged_inputs(q_latent, q_extra, kv_cache, block_table, seq_lens)
    B, Tq, H, R = q_latent.shape
    out = torch.empty_like(q_latent)
    for b, length in enumerate(seq_lens.tolist()):
        rows = gather_pages(kv_cache, block_table, length, b).float()
        c, k_extra = rows[:, :R], rows[:, R:]
        scores = torch.einsum("thr,sr->ths", q_latent[b].float(), c)
        scores = (scores + torch.einsum("the,se->ths", q_extra[b].float(), k_extra)) * scale
        query_pos = torch.arange(length - Tq, length, device=c.device)[:, None, None]
        visible = torch.arange(length, device=c.device)[None, None, :] <= query_pos
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[b] = torch.einsum("ths,sr->thr", probs, c).to(out.dtype)
    return out


def _split_kvb(w_kvb: Tensor, num_heads: int, nope_dim: int, v_dim: int) -> tuple[Tensor, Tensor]:
    if w_kvb.dim() != 2 or w_kvb.shape[0] != num_heads * (nope_dim + v_dim):
        raise ValueError(
            f"w_kvb must be [H * (n + v), R] = [{num_heads * (nope_dim + v_dim)}, R], got {tuple(w_kvb.shape)}"
        )
    w = w_kvb.view(num_heads, nope_dim + v_dim, w_kvb.shape[1])
    w_uk, w_uv = w.split([nope_dim, v_dim], dim=1)
    return w_uk, w_uv


def absorb_query(q_nope: Tensor, w_kvb: Tensor, v_dim: int) -> Tensor:
    """``q_latent = W_uk^T q_nope``: ``[B, Tq, H, n]`` -> ``[B, Tq, H, R]`` (``w_kvb`` is ``GatedMLA.wkv_b.weight``)."""
    H, n = q_nope.shape[-2:]
    w_uk, _ = _split_kvb(w_kvb, H, n, v_dim)
    return torch.einsum("bthn,hnr->bthr", q_nope, w_uk)


def absorb_output(o_latent: Tensor, w_kvb: Tensor, nope_dim: int, gate_logits: Tensor) -> Tensor:
    """``concat_h (W_uv o_latent[h]) * sigmoid(gate_logits)``: ``[B, Tq, H, R]`` -> ``[B, Tq, H * v]`` in
    ``o_latent``'s dtype. ``W_uv`` is taken in ``o_latent``'s dtype (an fp32 ``o_latent`` upcasts only this half
    of ``w_kvb``), and the gate is applied in fp32 (one rounding of the product, not three)."""
    H = o_latent.shape[-2]
    v_dim = w_kvb.shape[0] // H - nope_dim
    _, w_uv = _split_kvb(w_kvb, H, nope_dim, v_dim)
    if gate_logits.shape != (*o_latent.shape[:2], H * v_dim):
        raise ValueError(f"gate_logits must be [B, Tq, H * v] = {(*o_latent.shape[:2], H * v_dim)}, "
                         f"got {tuple(gate_logits.shape)}")
    o = torch.einsum("bthr,hvr->bthv", o_latent, w_uv.to(o_latent.dtype)).flatten(-2)
    gated = o.to(_gate_dtype(o)) * torch.sigmoid(gate_logits.to(_gate_dtype(o)))
    return gated.to(o.dtype)


def _gate_dtype(t: Tensor) -> torch.dtype:
    """fp32 for 16-bit tensors, else the tensor's own dtype (fp64 stays fp64 for ground-truth runs)."""
    return torch.float32 if t.element_size() < 4 else t.dtype


def mla_decode_reference(
    q_nope: Tensor, q_extra: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
    w_kvb: Tensor, gate_logits: Tensor, *, scale: float | None = None,
) -> Tensor:
    """The whole absorbed decode path before W_o: ``[B, Tq, H * v]``.

    ``q_nope [B, Tq, H, n]``, ``q_extra [B, Tq, H, e]`` from ``GatedMLA.queries``; ``w_kvb`` is
    ``GatedMLA.wkv_b.weight`` ``[H * (n + v), R]``; ``gate_logits = GatedMLA.w_gate(x)`` ``[B, Tq, H * v]``;
    ``scale`` defaults to ``(n + e)^-1/2``.
    """
    n, e = q_nope.shape[-1], q_extra.shape[-1]
    scale = (n + e) ** -0.5 if scale is None else scale
    v_dim = w_kvb.shape[0] // q_nope.shape[-2] - n
    q_latent = absorb_query(q_nope, w_kvb, v_dim)
    o_latent = mla_decode_attention_reference(q_latent, q_extra, kv_cache, block_table, seq_lens, scale=scale)
    return absorb_output(o_latent, w_kvb, n, gate_logits)
