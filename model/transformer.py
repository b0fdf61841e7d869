"""``K3Model``: the full Kimi K3 architecture, from token ids to logits, plus its inference interface.

Layer i (0-based) is a token mixer (KDA or gated MLA, ``cfg.layer_kind(i)``) followed by a feed-forward block
(dense SiTU-GLU for the first ``first_dense_layers`` layers, LatentMoE after). The residual stream is AttnRes
(see ``k3.model.attnres``), exactly:

    p = embed(ids); bank = []
    for layer i:
        a = mixer_i(attn_norm_i(aggregate(p, bank; w_attn_i)))     # aggregate(p, []) == p
        if i % attnres_block_size == 0: bank.append(p); p = a      # close the block, start a new partial sum
        else:                            p = p + a
        p = p + ffn_i(ffn_norm_i(aggregate(p, bank; w_ffn_i)))
    logits = lm_head(final_norm(aggregate(p, bank; w_final)))

Four ways to run it, sharing the layer code and differing only in how the token mixers are called:

- ``forward(input_ids, cu_seqlens=None, visual=None)``: training; [B, T] or packed [1, N] with ``cu_seqlens``.
- ``prefill(input_ids, state=None, visual=None)``: one sequence, continuing from a ``SequenceState``; returns the
  new state.
- ``decode(token_ids, states)``: one token for each of B independent sequences.
- ``decode_paged(token_ids, slots, block_table, seq_lens, kda_pools, kv_pages)``: the same step for a server's
  preallocated state pools and latent pages, advanced in place.

``visual`` (``k3.model.multimodal.VisualEmbeds``) replaces the embeddings at the image placeholder positions by
visual tokens; without it the embedding lookup is exactly the text-only one.

``prefill``/``decode`` run under ``torch.no_grad`` and never modify the states passed in; ``decode_paged`` (also
no-grad) advances its pools in place, which is its purpose.

Initialisation: projections normal(0, 0.02), norms ones, AttnRes queries zeros; the embedding normal(0, 1)
(normal(0, d^-1/2) when tied to the LM head, so the first logits stay O(1)). The KDA layer initialises itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3.model.attnres import AttnResMixer
from k3.model.config import K3Config
from k3.model.kda import KDAState, KimiDeltaAttention
from k3.model.mla import GatedMLA, check_cu_seqlens
from k3.model.moe import LatentMoE
from k3.model.multimodal import VisualEmbeds, insert_visual
from k3.model.norm import RMSNorm
from k3.model.params import init_normal_
from k3.model.situ import SiTUGLU
from k3.model.state import SequenceState, split_kda_state, stack_kda_states

IGNORE_INDEX = -100
"""Label value excluded from the loss (positions with no next token in their own sequence)."""

INIT_STD = 0.02

TokenMixerCall = Callable[["K3Layer", Tensor], Tensor]
"""How one path calls a layer's token mixer: (layer, normed input [B, T, d]) -> output [B, T, d]."""


class K3Layer(nn.Module):
    """One layer: AttnRes read -> norm -> token mixer, AttnRes read -> norm -> feed-forward."""

    def __init__(self, cfg: K3Config, layer_idx: int):
        super().__init__()
        d = cfg.hidden_size
        self.layer_idx = layer_idx
        self.kind = cfg.layer_kind(layer_idx)
        self.is_moe = cfg.is_moe(layer_idx)
        self.starts_block = layer_idx % cfg.attnres_block_size == 0
        # Layer 0 reads the embedding alone (the bank is still empty): no mixer, so no parameter without a use.
        self.attn_res = AttnResMixer(d, cfg.rms_eps) if layer_idx > 0 else None
        self.attn_norm = RMSNorm(d, cfg.rms_eps)
        self.attn: nn.Module = (
            KimiDeltaAttention(cfg, layer_idx) if self.kind == "kda" else GatedMLA(cfg, layer_idx)
        )
        self.ffn_res = AttnResMixer(d, cfg.rms_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_eps)
        self.ffn: nn.Module = (
            LatentMoE(cfg, layer_idx) if self.is_moe
            else SiTUGLU(d, cfg.dense_intermediate_size, cfg.situ_beta1, cfg.situ_beta2)
        )
        if not self.is_moe:
            init_normal_(self.ffn.w_in.weight, std=INIT_STD)
            init_normal_(self.ffn.w_out.weight, std=INIT_STD)

    def forward(self, p: Tensor, bank: list[Tensor], mix: TokenMixerCall) -> tuple[Tensor, list[Tensor]]:
        """Advance the AttnRes stream (partial sum ``p``, block ``bank``) through this layer."""
        stream = p if self.attn_res is None else self.attn_res(p, bank)
        a = mix(self, self.attn_norm(stream))
        if self.starts_block:
            bank = [*bank, p]
            p = a
        else:
            p = p + a
        p = p + self.ffn(self.ffn_norm(self.ffn_res(p, bank)))
        return p, bank


class K3Model(nn.Module):
    """Kimi K3 language model (KDA + gated MLA hybrid, AttnRes, LatentMoE with SiTU-GLU experts)."""

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        # from_pretrained skips nn.Embedding's own normal_ init (slow on the meta device); init_normal_ below.
        self.embed = nn.Embedding.from_pretrained(torch.empty(cfg.vocab_size, d), freeze=False)
        self.layers = nn.ModuleList(K3Layer(cfg, i) for i in range(cfg.num_layers))
        self.final_res = AttnResMixer(d, cfg.rms_eps)
        self.final_norm = RMSNorm(d, cfg.rms_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        init_normal_(self.lm_head.weight, std=INIT_STD)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
            init_normal_(self.embed.weight, std=d ** -0.5)
        else:
            init_normal_(self.embed.weight, std=1.0)
        self._config_hash = cfg.config_hash()

    # -- shared trunk --------------------------------------------------------------------------------------------
    def _trunk(self, x: Tensor, mix: TokenMixerCall) -> Tensor:
        p, bank = x, []
        for layer in self.layers:
            p, bank = layer(p, bank, mix)
        return self.final_norm(self.final_res(p, bank))

    def _embed(self, ids: Tensor, visual: VisualEmbeds | None) -> Tensor:
        x = self.embed(ids)
        return x if visual is None else insert_visual(x, ids, visual)

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        return self.embed.weight.device, self.embed.weight.dtype

    def _check_ids(self, ids: Tensor, name: str) -> None:
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer tensor, got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"{name} must lie in [0, {self.cfg.vocab_size}), got values in "
                             f"[{int(ids.min())}, {int(ids.max())}]")

    # -- training path -------------------------------------------------------------------------------------------
    def forward(self, input_ids: Tensor, cu_seqlens: Tensor | None = None,
                visual: VisualEmbeds | None = None) -> Tensor:
        """input_ids [B, T] (or packed [1, N] with ``cu_seqlens`` [num_seqs + 1]) -> logits [B, T, vocab].
        ``visual`` positions index the flattened input_ids."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if cu_seqlens is not None:
            if input_ids.shape[0] != 1:
                raise ValueError(f"packed sequences (cu_seqlens) need batch size 1, got {input_ids.shape[0]}")
            check_cu_seqlens(cu_seqlens, input_ids.shape[1])
            cu_seqlens = cu_seqlens.to(device=input_ids.device, dtype=torch.int64)

        def mix(layer: K3Layer, h: Tensor) -> Tensor:
            if layer.kind == "kda":
                return layer.attn(h, cu_seqlens=cu_seqlens)[0]
            return layer.attn(h, cu_seqlens=cu_seqlens)

        return self.lm_head(self._trunk(self._embed(input_ids, visual), mix))

    def loss(self, input_ids: Tensor, labels: Tensor | None = None, cu_seqlens: Tensor | None = None,
             visual: VisualEmbeds | None = None) -> Tensor:
        """Mean next-token cross-entropy. ``labels`` are aligned with positions (labels[t] is the target of
        position t, ``IGNORE_INDEX`` to skip); by default ``next_token_labels(input_ids, cu_seqlens)``."""
        if labels is None:
            labels = next_token_labels(input_ids, cu_seqlens)
        return lm_loss(self(input_ids, cu_seqlens, visual), labels)

    # -- inference path ------------------------------------------------------------------------------------------
    @property
    def config_hash(self) -> str:
        return self._config_hash

    def new_state(self) -> SequenceState:
        """An empty state on the model's device (MLA caches in the model's dtype)."""
        device, dtype = self._device_dtype()
        return SequenceState.fresh(self.cfg, device, dtype)

    def _check_state(self, state: SequenceState, extra_tokens: int, name: str) -> None:
        if not isinstance(state, SequenceState):
            raise ValueError(f"{name} must be a SequenceState, got {type(state).__name__}")
        if state.config_hash != self._config_hash:
            raise ValueError(f"{name} was produced by a model with config hash {state.config_hash}, "
                             f"this model's is {self._config_hash}")
        if state.num_tokens + extra_tokens > self.cfg.max_seq_len:
            raise ValueError(f"{name} would hold {state.num_tokens + extra_tokens} tokens, more than "
                             f"max_seq_len {self.cfg.max_seq_len}")

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, state: SequenceState | None = None,
                visual: VisualEmbeds | None = None) -> tuple[Tensor, SequenceState]:
        """Run the tokens of one sequence ([T] or [1, T]) after ``state`` (a fresh state if None).
        ``visual`` positions index these T tokens (``k3.model.multimodal.slice_visual`` cuts a chunk's).

        Returns logits [T, vocab] for every new position and the state after the last token.
        """
        ids = input_ids[0] if input_ids.dim() == 2 and input_ids.shape[0] == 1 else input_ids
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"prefill takes one non-empty sequence [T] or [1, T], got shape {tuple(input_ids.shape)}")
        self._check_ids(ids, "input_ids")
        state = self.new_state() if state is None else state
        self._check_state(state, ids.numel(), "state")
        kda_states, mla_caches = {}, {}

        def mix(layer: K3Layer, h: Tensor) -> Tensor:
            i = layer.layer_idx
            if layer.kind == "kda":
                out, kda_states[i] = layer.attn(h, state=state.kda[i])
                return out
            out, mla_caches[i] = layer.attn.prefill(h[0], state.mla[i])
            return out[None]

        ids = ids.to(self.embed.weight.device)
        logits = self.lm_head(self._trunk(self._embed(ids, visual)[None], mix))[0]
        return logits, SequenceState(self._config_hash, state.num_tokens + ids.numel(), kda_states, mla_caches)

    def prefill_with_checkpoints(
        self, input_ids: Tensor, state: SequenceState | None = None, block_size: int = 512
    ) -> tuple[Tensor, SequenceState, list[SequenceState]]:
        """``prefill`` in pieces cut at every multiple of ``block_size`` tokens (counted from the start of the
        sequence), also returning the state at each boundary crossed (the checkpoints a cache store keeps)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        ids = input_ids[0] if input_ids.dim() == 2 and input_ids.shape[0] == 1 else input_ids
        state = self.new_state() if state is None else state
        logits, checkpoints, pos = [], [], 0
        while pos < ids.numel():
            room = block_size - state.num_tokens % block_size
            piece = ids[pos:pos + room]
            out, state = self.prefill(piece, state)
            logits.append(out)
            pos += piece.numel()
            if state.num_tokens % block_size == 0:
                checkpoints.append(state)
        if not logits:
            raise ValueError("prefill_with_checkpoints needs at least one token")
        return torch.cat(logits, dim=0), state, checkpoints

    @torch.no_grad()
    def decode(self, token_ids: Tensor, states: Sequence[SequenceState]) -> tuple[Tensor, list[SequenceState]]:
        """One new token per sequence: token_ids [B] with B states -> (logits [B, vocab], B new states)."""
        if token_ids.dim() != 1 or token_ids.numel() != len(states) or not states:
            raise ValueError(f"decode takes token_ids [B] and B states, got shape {tuple(token_ids.shape)} "
                             f"and {len(states)} states")
        self._check_ids(token_ids, "token_ids")
        for b, state in enumerate(states):
            self._check_state(state, 1, f"states[{b}]")
        batch = len(states)
        kda_states: dict[int, list] = {}
        mla_caches: dict[int, list] = {}

        def mix(layer: K3Layer, h: Tensor) -> Tensor:
            i = layer.layer_idx
            if layer.kind == "kda":
                out, new = layer.attn(h, state=stack_kda_states([s.kda[i] for s in states]))
                kda_states[i] = split_kda_state(new)
                return out
            out, mla_caches[i] = layer.attn.decode(h[:, 0], [s.mla[i] for s in states])
            return out[:, None]

        x = self.embed(token_ids.to(self.embed.weight.device))[:, None]  # [B, 1, d]
        logits = self.lm_head(self._trunk(x, mix))[:, 0]
        new_states = [
            SequenceState(
                self._config_hash,
                states[b].num_tokens + 1,
                {i: v[b] for i, v in kda_states.items()},
                {i: v[b] for i, v in mla_caches.items()},
            )
            for b in range(batch)
        ]
        return logits, new_states

    @torch.no_grad()
    def decode_paged(self, token_ids: Tensor, slots: Tensor, block_table: Tensor, seq_lens: Tensor,
                     kda_pools: Mapping[int, KDAState], kv_pages: Mapping[int, Tensor], *,
                     validate: bool = True) -> Tensor:
        """``decode`` for a server's preallocated memory: one token per sequence, states read and advanced in place.

        Sequence ``b`` owns row ``slots[b]`` of every KDA layer's state pool (``kda_pools[i]``, a ``KDAState`` of
        ``num_slots`` rows) and the pages ``block_table[b]`` (int32 ``[B, W]``) of every MLA layer's page pool
        (``kv_pages[i]``, ``[num_pages, page_size, R + e]``, the layout of ``k3.kernels.mla.reference``), where
        ``seq_lens[b]`` tokens are cached. The step writes the new token's latents at position ``seq_lens[b]``
        and advances the KDA rows; the caller counts the token (``seq_lens[b] + 1`` next time).

        Unlike ``decode`` nothing is gathered, stacked or copied per sequence, so a step costs what its kernels
        read and its tensors keep their addresses (capturable in a CUDA graph). Per row it computes the same
        function as ``decode`` (tested). ``validate=False`` skips the checks of the index values (each is a
        device synchronisation on a GPU) for a caller that built them itself; shapes are always checked. If a
        step raises part-way (e.g. a remote expert pool fails), the rows of that batch may be half-advanced.

        Returns logits [B, vocab].
        """
        batch = token_ids.shape[0] if token_ids.dim() == 1 else 0
        self._check_paged(batch, token_ids, slots, block_table, seq_lens, kda_pools, kv_pages, validate)

        def mix(layer: K3Layer, h: Tensor) -> Tensor:
            i = layer.layer_idx
            if layer.kind == "kda":
                return layer.attn.decode_in_place(h[:, 0], kda_pools[i], slots)[:, None]
            return layer.attn.decode_paged(h[:, 0], kv_pages[i], block_table, seq_lens)[:, None]

        x = self.embed(token_ids.to(self.embed.weight.device))[:, None]  # [B, 1, d]
        return self.lm_head(self._trunk(x, mix))[:, 0]

    def _check_paged(self, batch: int, token_ids: Tensor, slots: Tensor, block_table: Tensor, seq_lens: Tensor,
                     kda_pools: Mapping[int, KDAState], kv_pages: Mapping[int, Tensor], validate: bool) -> None:
        """Shapes, dtypes and layer sets of ``decode_paged``'s arguments; index values when ``validate``."""
        if batch == 0:
            raise ValueError(f"token_ids must be a non-empty [B], got shape {tuple(token_ids.shape)}")
        for name, t, dtypes in (("token_ids", token_ids, (torch.int32, torch.int64)),
                                ("slots", slots, (torch.int32, torch.int64)),
                                ("seq_lens", seq_lens, (torch.int32, torch.int64))):
            if t.shape != (batch,) or t.dtype not in dtypes:
                raise ValueError(f"{name} must be an int32/int64 tensor [B={batch}], got {tuple(t.shape)} {t.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.dtype != torch.int32:
            raise ValueError(f"block_table must be int32 [B={batch}, W], got {tuple(block_table.shape)} "
                             f"{block_table.dtype}")
        kda_layers = [layer.layer_idx for layer in self.layers if layer.kind == "kda"]
        mla_layers = [layer.layer_idx for layer in self.layers if layer.kind == "mla"]
        if sorted(kda_pools) != kda_layers or sorted(kv_pages) != mla_layers:
            raise ValueError(f"kda_pools must hold layers {kda_layers} and kv_pages layers {mla_layers}, got "
                             f"{sorted(kda_pools)} and {sorted(kv_pages)}")
        num_slots = {pool.batch_size for pool in kda_pools.values()}
        for pool in kda_pools.values():
            pool.check(pool.batch_size, self.cfg)
        width = self.cfg.kv_lora_rank + self.cfg.qk_extra_dim
        shapes = {tuple(pages.shape) for pages in kv_pages.values()}
        if len(num_slots) > 1 or len(shapes) > 1:
            raise ValueError(f"every layer's pool must have the same rows: slots {sorted(num_slots)}, "
                             f"pages {sorted(shapes)}")
        if any(pages.dim() != 3 or pages.shape[2] != width for pages in kv_pages.values()):
            raise ValueError(f"kv_pages must be [num_pages, page_size, R + e = {width}], got {sorted(shapes)}")
        if not validate:
            return
        self._check_ids(token_ids, "token_ids")
        if num_slots:
            (rows,) = num_slots
            if int(slots.min()) < 0 or int(slots.max()) >= rows or slots.unique().numel() != batch:
                raise ValueError(f"slots must be distinct and lie in [0, {rows}), got {slots.tolist()}")
        if int(seq_lens.min()) < 0 or int(seq_lens.max()) >= self.cfg.max_seq_len:
            raise ValueError(f"seq_lens must lie in [0, max_seq_len={self.cfg.max_seq_len}), got {seq_lens.tolist()}")
        if shapes:
            ((num_pages, page_size, _),) = shapes
            if int(seq_lens.max()) >= block_table.shape[1] * page_size:
                raise ValueError(f"block_table's {block_table.shape[1]} pages of {page_size} tokens cannot hold "
                                 f"token {int(seq_lens.max())}")
            used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] <= (
                seq_lens.to(block_table.device)[:, None] // page_size)
            ids = block_table[used]
            if int(ids.min()) < 0 or int(ids.max()) >= num_pages:
                raise ValueError(f"block_table entries in use must lie in [0, num_pages={num_pages})")

    # -- optimizer -----------------------------------------------------------------------------------------------
    def optimizer_groups(self) -> list[dict]:
        """Parameter groups for ``PerHeadMuon``:

        - ``muon_per_head``: q/k/v/o projections of MLA and KDA, split into heads along ``head_axis`` (0 for
          d -> H*K weights stored [H*K, d], 1 for output projections stored [d, H*K]); one group per
          (num_heads, head_axis) pair. MLA's q is W_qb, its k/v is W_kvb (per head [k_nope | v] rows), o is W_o.
        - ``muon``: every other 2-D matrix (low-rank projections, gates, router, latent projections, shared and
          dense experts); routed experts' stacked [E, out, in] weights as a separate ``batched`` group.
        - ``adamw``: embedding, LM head, norms, AttnRes vectors, KDA's conv filters, decay and bias vectors.
        """
        per_head: dict[tuple[int, int], list[nn.Parameter]] = {}
        muon, batched, adamw = [], [], []
        claimed: set[int] = set()
        for layer in self.layers:
            attn = layer.attn
            if layer.kind == "mla":
                heads = self.cfg.mla_heads
                specs = [(attn.wq_b.weight, 0), (attn.wkv_b.weight, 0), (attn.wo.weight, 1)]
            else:
                heads = self.cfg.kda_heads
                specs = [(w, 0) for w in kda_qkv_weights(attn)] + [(kda_output_weight(attn), 1)]
            for weight, axis in specs:
                per_head.setdefault((heads, axis), []).append(weight)
                claimed.add(id(weight))
            if layer.is_moe:
                batched += [layer.ffn.w_in, layer.ffn.w_out]
                claimed.update({id(layer.ffn.w_in), id(layer.ffn.w_out)})
        claimed.update({id(self.embed.weight), id(self.lm_head.weight)})
        adamw += [self.embed.weight] + ([] if self.cfg.tie_embeddings else [self.lm_head.weight])
        for param in self.parameters():
            if id(param) in claimed:
                continue
            (muon if param.dim() == 2 else adamw).append(param)
        groups: list[dict] = [
            {"params": params, "kind": "muon_per_head", "num_heads": heads, "head_axis": axis}
            for (heads, axis), params in per_head.items()
        ]
        if muon:
            groups.append({"params": muon, "kind": "muon"})
        if batched:
            groups.append({"params": batched, "kind": "muon", "batched": True})
        groups.append({"params": adamw, "kind": "adamw"})
        return groups


# -- KDA projection lookup (names follow k3.model.kda) ---------------------------------------------------------------
def kda_qkv_weights(attn: nn.Module) -> list[nn.Parameter]:
    """The d -> H*K query, key and value projection weights of a KDA layer."""
    return [attn.w_q.weight, attn.w_k.weight, attn.w_v.weight]


def kda_output_weight(attn: nn.Module) -> nn.Parameter:
    """The H*K -> d output projection weight of a KDA layer."""
    return attn.w_o.weight


# -- loss helpers ------------------------------------------------------------------------------------------------
def next_token_labels(input_ids: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """labels[b, t] = input_ids[b, t + 1]; ``IGNORE_INDEX`` at each sequence's last position (packed sequences
    never predict across a boundary)."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, :-1] = input_ids[:, 1:]
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, input_ids.shape[1])
        labels[:, cu_seqlens[1:].to(input_ids.device) - 1] = IGNORE_INDEX
    return labels


def lm_loss(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy in fp32 over positions whose label is not ``ignore_index``."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits {tuple(logits.shape[:-1])}")
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=ignore_index)
