"""Gated Multi-head Latent Attention (MLA) without positional encoding: the global-attention layers of K3.

Shapes (per token x of width d; H heads, R = kv_lora_rank, n = qk_nope_dim, e = qk_extra_dim, v = v_head_dim):

    q            = W_qb(RMSNorm(W_qa x))                 -> per head [q_nope (n) | q_extra (e)]
    [c_kv | k_e] = W_kva x                               -> c_kv (R), k_e (e, one vector shared by all heads)
    c            = RMSNorm(c_kv)
    [k_nope | v] = W_kvb c                               -> per head
    score_h(t,s) = (q_nope_h(t) . k_nope_h(s) + q_extra_h(t) . k_e(s)) / sqrt(n + e),   causal (s <= t)
    out          = W_o( concat_h(softmax(score_h) V_h) * sigmoid(W_g x) )

No rotation is applied anywhere: order information comes from the KDA layers. The ``extra`` query/key slot is
the one DeepSeek-V3 uses for rotary dimensions; here it is a plain, head-shared key part.

What is cached (``MLACache``), per token and per MLA layer: ``c`` = RMSNorm(c_kv) **after** the kv-norm
(including its learned weight), R values, and ``k_e`` as produced by W_kva (no norm), e values: R + e = 576
numbers for the released shapes. Caching the normalised latent means a decode step never re-normalises history.

Four paths, all computing the same function:

- ``forward``: training / full-sequence path. Keys and values are expanded from the latent for every token and
  attention is a masked softmax; ``cu_seqlens`` (packed sequences, batch 1) becomes a block-diagonal causal mask.
- ``prefill``: one sequence continuing from a cache; new queries attend to cached + new tokens (expanded path).
- ``decode``: one new token for each of B independent sequences with caches of different lengths. By default
  the "absorbed" form: W_kvb's key half is folded into the query (q_lat = W_uk^T q_nope, scored directly
  against the cached latents) and its value half into the output (attend over latents, then apply W_uv), so
  per-token keys/values are never materialised. ``absorb=False`` runs the expanded path for comparison.
- ``decode_paged``: the absorbed decode for a server whose caches live in a page pool: the new token's
  latents are written into their page and history is read through the page table, nothing gathered.

Kernels: :func:`k3.kernels.dispatch.select_backend` decides per call. On the reference backend (CPU by default)
every path runs the torch code below (``decode_paged`` the paged kernel's readable reference). On the Triton
backend (CUDA by default) both absorbed decodes run the paged Triton kernel
(:func:`k3.kernels.dispatch.mla_decode_op`), ``decode_paged`` on the server's pages; ``decode`` packs the
per-sequence caches into one zero-padded buffer that is viewed as pages of ``DECODE_PAGE`` tokens with a trivial
page table (sequence ``b`` owns pages ``b * P .. b * P + P - 1``), so the kernel reads them where they lie and
its compiled variant does not change as sequences grow. The expanded paths (training, prefill) run
``torch.nn.functional.scaled_dot_product_attention`` with the same mask instead of materialising the scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from k3.kernels import dispatch
from k3.model.config import K3Config
from k3.model.norm import RMSNorm
from k3.model.params import init_normal_

INIT_STD = 0.02
"""Standard deviation of the normal initialisation of every projection in this module."""

DECODE_PAGE = 64
"""Page size (tokens) of the paged view the Triton decode kernel reads the packed decode caches through."""


# ---------------------------------------------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------------------------------------------
def check_cu_seqlens(cu_seqlens: Tensor, total: int) -> None:
    """Validate packed-sequence boundaries: 1-D integer tensor [N+1], 0 first, strictly increasing, ``total`` last."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError("cu_seqlens must be a 1-D integer tensor [num_sequences + 1]")
    if cu_seqlens.numel() < 2:
        raise ValueError("cu_seqlens must hold at least two boundaries (0 and the total length)")
    values = cu_seqlens.tolist()
    if values[0] != 0 or values[-1] != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at the packed length {total}, got {values}")
    if any(b <= a for a, b in zip(values[:-1], values[1:], strict=True)):
        raise ValueError(f"cu_seqlens must be strictly increasing, got {values}")


def causal_mask(num_queries: int, num_keys: int, device: torch.device | None = None) -> Tensor:
    """Bool [Tq, Tk], True where visible: the queries are the last ``num_queries`` of the ``num_keys`` tokens."""
    offset = num_keys - num_queries
    q = torch.arange(num_queries, device=device).unsqueeze(1) + offset
    k = torch.arange(num_keys, device=device).unsqueeze(0)
    return k <= q


def packed_causal_mask(cu_seqlens: Tensor, total: int, device: torch.device | None = None) -> Tensor:
    """Bool [N, N], True where visible: causal within each packed sequence, nothing across sequences."""
    check_cu_seqlens(cu_seqlens, total)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device)
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    same = seq_id.unsqueeze(1) == seq_id.unsqueeze(0)
    return same & causal_mask(total, total, device)


# ---------------------------------------------------------------------------------------------------------------
# cache
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class MLACache:
    """Compressed attention cache of one MLA layer for one sequence (no batch dimension).

    ``c_kv``: [L, kv_lora_rank], RMSNorm(c_kv) after the kv-norm (weight applied);
    ``k_extra``: [L, qk_extra_dim], the head-shared extra key part straight from W_kva.
    The reference grows these tensors by concatenation; a serving engine pages them instead.
    """

    c_kv: Tensor
    k_extra: Tensor

    @classmethod
    def empty(cls, cfg: K3Config, device: torch.device | str | None = None,
              dtype: torch.dtype = torch.float32) -> MLACache:
        return cls(
            c_kv=torch.zeros(0, cfg.kv_lora_rank, device=device, dtype=dtype),
            k_extra=torch.zeros(0, cfg.qk_extra_dim, device=device, dtype=dtype),
        )

    def __len__(self) -> int:
        return self.c_kv.shape[0]

    def append(self, c_kv: Tensor, k_extra: Tensor) -> MLACache:
        """A new cache with [T, R] and [T, e] appended (this one is left untouched)."""
        return MLACache(torch.cat([self.c_kv, c_kv.to(self.c_kv.dtype)], dim=0),
                        torch.cat([self.k_extra, k_extra.to(self.k_extra.dtype)], dim=0))

    def clone(self) -> MLACache:
        return MLACache(self.c_kv.clone(), self.k_extra.clone())


# ---------------------------------------------------------------------------------------------------------------
# layer
# ---------------------------------------------------------------------------------------------------------------
class GatedMLA(nn.Module):
    """Gated NoPE MLA layer. Projections are stored like ``nn.Linear`` weights, [out, in]."""

    def __init__(self, cfg: K3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = h = cfg.mla_heads
        self.nope_dim = cfg.qk_nope_dim
        self.extra_dim = cfg.qk_extra_dim
        self.v_dim = cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.scale = cfg.mla_qk_head_dim ** -0.5
        d = cfg.hidden_size
        self.wq_a = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * cfg.mla_qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_extra_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_dim + cfg.v_head_dim), bias=False)
        self.w_gate = nn.Linear(d, h * cfg.v_head_dim, bias=False)
        self.wo = nn.Linear(h * cfg.v_head_dim, d, bias=False)
        for lin in (self.wq_a, self.wq_b, self.wkv_a, self.wkv_b, self.w_gate, self.wo):
            init_normal_(lin.weight, std=INIT_STD)

    # -- pieces shared by every path -------------------------------------------------------------------------
    def queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., d] -> q_nope [..., H, n], q_extra [..., H, e]."""
        q = self.wq_b(self.q_norm(self.wq_a(x))).unflatten(-1, (self.num_heads, -1))
        return q.split([self.nope_dim, self.extra_dim], dim=-1)

    def latents(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., d] -> what the cache stores: normalised c [..., R] and k_extra [..., e]."""
        c_kv, k_extra = self.wkv_a(x).split([self.kv_rank, self.extra_dim], dim=-1)
        return self.kv_norm(c_kv), k_extra

    def expand(self, c: Tensor) -> tuple[Tensor, Tensor]:
        """Cached latent c [..., R] -> k_nope [..., H, n], v [..., H, v]."""
        kv = self.wkv_b(c).unflatten(-1, (self.num_heads, -1))
        return kv.split([self.nope_dim, self.v_dim], dim=-1)

    def output(self, o: Tensor, x: Tensor) -> Tensor:
        """Per-head attention output o [..., H, v] -> W_o(o * sigmoid(W_g x)) [..., d]."""
        return self.wo(o.flatten(-2) * torch.sigmoid(self.w_gate(x)))

    def attend(self, q_nope: Tensor, q_extra: Tensor, c: Tensor, k_extra: Tensor, mask: Tensor) -> Tensor:
        """Expanded attention. q_* [B, Tq, H, *], c [B, Tk, R], k_extra [B, Tk, e], mask bool [B|1, Tq, Tk]
        (True = visible) -> o [B, Tq, H, v]. Softmax in fp32."""
        k_nope, v = self.expand(c)
        if dispatch.select_backend(q_nope) == "triton":
            return self._sdpa(q_nope, q_extra, k_nope, k_extra, v, mask)
        scores = torch.einsum("bqhn,bkhn->bhqk", q_nope, k_nope) + torch.einsum("bqhe,bke->bhqk", q_extra, k_extra)
        scores = scores.float() * self.scale
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.einsum("bhqk,bkhv->bqhv", probs, v)

    def _sdpa(self, q_nope: Tensor, q_extra: Tensor, k_nope: Tensor, k_extra: Tensor, v: Tensor,
              mask: Tensor) -> Tensor:
        """``attend`` through fused attention: the head-shared extra key is broadcast over the heads and
        concatenated to ``k_nope`` (the same score); a row with no visible key cannot occur (causal masks)."""
        H = self.num_heads
        q = torch.cat([q_nope, q_extra], dim=-1).transpose(1, 2)  # [B, H, Tq, n + e]
        k_e = k_extra[:, :, None, :].expand(-1, -1, H, -1)
        k = torch.cat([k_nope, k_e.to(k_nope.dtype)], dim=-1).transpose(1, 2)  # [B, H, Tk, n + e]
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), attn_mask=mask.unsqueeze(1), scale=self.scale)
        return o.transpose(1, 2)

    # -- paths -----------------------------------------------------------------------------------------------
    def forward(self, x: Tensor, *, cu_seqlens: Tensor | None = None) -> Tensor:
        """Training path. x [B, T, d] (B == 1 with ``cu_seqlens``) -> [B, T, d]."""
        if x.dim() != 3:
            raise ValueError(f"GatedMLA.forward expects x [B, T, d], got shape {tuple(x.shape)}")
        b, t, _ = x.shape
        if cu_seqlens is not None:
            if b != 1:
                raise ValueError(f"packed sequences (cu_seqlens) need batch size 1, got {b}")
            mask = packed_causal_mask(cu_seqlens, t, x.device)
        else:
            mask = causal_mask(t, t, x.device)
        q_nope, q_extra = self.queries(x)
        c, k_extra = self.latents(x)
        o = self.attend(q_nope, q_extra, c, k_extra, mask.unsqueeze(0))
        return self.output(o, x)

    def prefill(self, x: Tensor, cache: MLACache | None) -> tuple[Tensor, MLACache]:
        """One sequence continuing from ``cache``: x [T, d] -> (y [T, d], cache with T more tokens)."""
        if x.dim() != 2:
            raise ValueError(f"GatedMLA.prefill expects x [T, d] of one sequence, got shape {tuple(x.shape)}")
        c_new, e_new = self.latents(x)
        if cache is None:
            cache = MLACache(c_new[:0], e_new[:0])
        cache = cache.append(c_new, e_new)
        q_nope, q_extra = self.queries(x)
        mask = causal_mask(x.shape[0], len(cache), x.device)
        o = self.attend(q_nope[None], q_extra[None], cache.c_kv[None].to(x.dtype),
                        cache.k_extra[None].to(x.dtype), mask[None])
        return self.output(o[0], x), cache

    def decode(self, x: Tensor, caches: Sequence[MLACache], *, absorb: bool = True) -> tuple[Tensor, list[MLACache]]:
        """One token for each of B sequences: x [B, d], B caches (any lengths) -> (y [B, d], grown caches)."""
        if x.dim() != 2 or x.shape[0] != len(caches):
            raise ValueError(
                f"GatedMLA.decode expects x [B, d] and B caches, got shape {tuple(x.shape)} and {len(caches)} caches"
            )
        c_new, e_new = self.latents(x)
        caches = [cache.append(c_new[i:i + 1], e_new[i:i + 1]) for i, cache in enumerate(caches)]
        if absorb and dispatch.select_backend(x) == "triton":
            return self._decode_kernel(x, caches), caches
        # Pad the caches to a common length; padded slots are masked out.
        lengths = [len(cache) for cache in caches]
        c = nn.utils.rnn.pad_sequence([cache.c_kv for cache in caches], batch_first=True).to(x.dtype)
        k_extra = nn.utils.rnn.pad_sequence([cache.k_extra for cache in caches], batch_first=True).to(x.dtype)
        valid = torch.arange(c.shape[1], device=x.device)[None, :] < torch.tensor(lengths, device=x.device)[:, None]
        q_nope, q_extra = self.queries(x)  # [B, H, n], [B, H, e]
        if absorb:
            o = self._absorbed_attend(q_nope, q_extra, c, k_extra, valid)
        else:
            o = self.attend(q_nope[:, None], q_extra[:, None], c, k_extra, valid[:, None, :])[:, 0]
        return self.output(o, x), caches

    def _decode_kernel(self, x: Tensor, caches: list[MLACache]) -> Tensor:
        """Absorbed decode through the paged Triton kernel (see the module docstring): x [B, d] -> [B, d]."""
        B = x.shape[0]
        lengths = [len(cache) for cache in caches]
        pages = -(-max(lengths) // DECODE_PAGE)
        width = self.kv_rank + self.extra_dim
        kv = x.new_zeros(B, pages * DECODE_PAGE, width)
        for b, cache in enumerate(caches):
            kv[b, : lengths[b], : self.kv_rank] = cache.c_kv
            kv[b, : lengths[b], self.kv_rank :] = cache.k_extra
        block_table = torch.arange(B * pages, device=x.device, dtype=torch.int32).view(B, pages)
        seq_lens = torch.tensor(lengths, device=x.device, dtype=torch.int32)
        q_nope, q_extra = self.queries(x[:, None])  # [B, 1, H, n], [B, 1, H, e]
        gated = dispatch.mla_decode_op(
            q_nope, q_extra, kv.view(B * pages, DECODE_PAGE, width), block_table, seq_lens,
            self.wkv_b.weight, self.w_gate(x[:, None]), scale=self.scale, validate=False,
        )
        return self.wo(gated[:, 0])

    def decode_paged(self, x: Tensor, kv_pages: Tensor, block_table: Tensor, seq_lens: Tensor) -> Tensor:
        """One token for each of B sequences whose latents live in a page pool, read and grown in place.

        ``kv_pages [num_pages, page_size, R + e]`` holds every sequence's cached ``[c | k_extra]`` rows (the layout
        of :mod:`k3.kernels.mla.reference`); sequence ``b`` owns pages ``block_table[b]`` (int32 ``[B, W]``) and
        has ``seq_lens[b]`` tokens cached before this one. The new token's latents are written at position
        ``seq_lens[b]`` (its page must be in the table) and the absorbed attention then reads
        ``seq_lens[b] + 1`` tokens through the page table, the Triton kernel or its reference as
        :mod:`k3.kernels.dispatch` decides. Nothing is gathered or repacked: the step costs what it reads, and
        its tensors keep their addresses (a CUDA graph can replay it). x [B, d] -> y [B, d].
        """
        page_size = kv_pages.shape[1]
        c_new, e_new = self.latents(x)
        positions = seq_lens.long()
        pages = block_table.long().gather(1, (positions // page_size)[:, None])[:, 0]
        kv_pages[pages, positions % page_size] = torch.cat([c_new, e_new], dim=-1).to(kv_pages.dtype)
        q_nope, q_extra = self.queries(x[:, None])  # [B, 1, H, n], [B, 1, H, e]
        gated = dispatch.mla_decode_op(
            q_nope, q_extra.to(kv_pages.dtype), kv_pages, block_table, (positions + 1).to(torch.int32),
            self.wkv_b.weight, self.w_gate(x[:, None]), scale=self.scale, validate=False,
        )
        return self.wo(gated[:, 0])

    def _absorbed_attend(self, q_nope: Tensor, q_extra: Tensor, c: Tensor, k_extra: Tensor,
                         valid: Tensor) -> Tensor:
        """Attention straight over cached latents. q_nope [B, H, n], q_extra [B, H, e], c [B, L, R],
        k_extra [B, L, e], valid [B, L] -> o [B, H, v].

        With W_kvb viewed per head as [W_uk (n x R); W_uv (v x R)]:
        q_nope . (W_uk c) = (W_uk^T q_nope) . c, and sum_s p_s W_uv c_s = W_uv (sum_s p_s c_s).
        """
        w = self.wkv_b.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w.split([self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        scores = torch.einsum("bhr,blr->bhl", q_latent, c) + torch.einsum("bhe,ble->bhl", q_extra, k_extra)
        scores = scores.float() * self.scale
        scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(c.dtype)
        context = torch.einsum("bhl,blr->bhr", probs, c)
        return torch.einsum("bhr,hvr->bhv", context, w_uv)


__all__ = ["GatedMLA", "MLACache", "causal_mask", "packed_causal_mask", "check_cu_seqlens"]
