"""The Kimi Delta Attention (KDA) token mixer: a linear-attention layer with a fixed-size per-head memory.

For x [B, T, d], with H heads of width K (= V):

    q, k, v = SiLU(ShortConv(W_q x)), SiLU(ShortConv(W_k x)), SiLU(ShortConv(W_v x))   # depthwise, causal
    q, k    = L2-normalised per head
    g       = kda_gate(W_fb(W_fa x), A_log, dt_bias)      # per-channel log decay in [lower_bound, 0)
    beta    = sigmoid(W_b x)                              # write strength, one per head
    o       = KDA(q, k, v, g, beta)                       # the delta-rule recurrence of k3.kernels.kda
    y       = W_o( RMSNorm_head(o) * sigmoid(W_g x) )

Design decisions:

- The layer carries everything decoding needs in a :class:`KDAState`: the last ``kernel - 1`` inputs of each
  short convolution and the fp32 recurrent state. A call with ``state`` continues from it and returns the new
  one, so prefill (many tokens) and decode (one token) are the same call; ``T == 1`` always takes the
  token recurrence, longer inputs the chunked form (or the recurrence with ``use_chunk=False``).
- Packed batches (``cu_seqlens``, B == 1) are handled per sequence: every sequence's convolutions start from
  zeros (or from its own state row) and so does its memory, so nothing leaks across a boundary.
- Initialisation: ``A_log = log(U(1, 16))`` per head, and ``dt_bias`` is solved so that at ``g_raw = 0`` the
  per-step log decay ``g0`` is ``-U_log(1e-3, 1e-1)`` per channel, i.e. retention 0.905 .. 0.999 per token:
  memories with horizons of ~10 to ~1000 tokens from the start, none saturated at the lower bound (where the
  gate's gradient vanishes) or at 0. ``W_fb`` starts at zero (as the second factor of a low-rank adapter
  would) so that ``g_raw = 0`` really holds at the start: with a random ``W_fb`` the data-dependent part,
  amplified by ``exp(A_log)`` up to 16, would push most channels to either end of the sigmoid. The other
  projections keep ``nn.Linear``'s default initialisation.
- Kernels: the layer asks :func:`k3.kernels.dispatch.select_backend` which implementation to run. On the
  reference backend (CPU by default) it runs exactly the readable reference ops written out below. On the
  Triton backend (CUDA by default) a multi-token call hands the raw projections to the fused chunked kernel
  (gate, q/k L2 norm and beta sigmoid inside, autograd included), and a one-token call without gradients (a
  decode step) runs the fused short-convolution and recurrent decode kernels on copies of the state, advanced
  in place. ``use_chunk=False`` always runs the reference token recurrence (it is the explicit request for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from k3.kernels import dispatch
from k3.kernels.kda import kda_chunk, kda_gate, kda_recurrent
from k3.kernels.kda.reference import sequence_bounds
from k3.model.config import K3Config
from k3.model.norm import RMSNorm

INIT_LOG_DECAY_RANGE = (1e-3, 1e-1)
"""Range (log-uniform) of the magnitude of the initial per-step log decay ``-g0`` at ``g_raw = 0``."""
INIT_A_RANGE = (1.0, 16.0)
"""Range (uniform) of the initial per-head decay rate ``exp(A_log)``."""

_STATE_FIELDS = ("conv_q", "conv_k", "conv_v", "recurrent")


class ShortConv(nn.Module):
    """Depthwise causal 1-D convolution over time (no bias) followed by SiLU, with a decoding state.

    The state is the last ``kernel_size - 1`` inputs ``[B, channels, kernel_size - 1]``, oldest first; a
    missing state means zeros (the start of a sequence).
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        self.channels, self.kernel_size = channels, kernel_size
        # Padding is done by hand (state or zeros on the left), never by the convolution itself.
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False)

    def _run(self, x: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
        """x [b, t, C], state [b, C, kernel-1] | None -> (y [b, t, C], new state)."""
        xt = x.transpose(1, 2)  # [b, C, t]
        if state is None:
            state = xt.new_zeros(xt.shape[0], self.channels, self.kernel_size - 1)
        padded = torch.cat([state.to(xt.dtype), xt], dim=-1)
        y = F.silu(self.conv(padded)).transpose(1, 2)
        return y, padded[..., padded.shape[-1] - (self.kernel_size - 1) :]

    def forward(
        self, x: Tensor, state: Tensor | None = None, cu_seqlens: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """x [B, T, C] -> (y [B, T, C], new state [B, C, kernel-1]); with ``cu_seqlens`` (B == 1) the
        sequences are convolved separately and the state has one row per sequence."""
        if x.dim() != 3 or x.shape[-1] != self.channels:
            raise ValueError(f"ShortConv expects x [B, T, {self.channels}], got shape {tuple(x.shape)}")
        rows = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        expected = (rows, self.channels, self.kernel_size - 1)
        if state is not None and tuple(state.shape) != expected:
            raise ValueError(f"ShortConv state must be {expected}, got {tuple(state.shape)}")
        if cu_seqlens is None:
            return self._run(x, state)
        if x.shape[0] != 1:
            raise ValueError(f"cu_seqlens requires a packed batch with B == 1, got B = {x.shape[0]}")
        outs, states = [], []
        for n, (s, e) in enumerate(sequence_bounds(cu_seqlens, x.shape[1])):
            y, st = self._run(x[:, s:e], None if state is None else state[n : n + 1])
            outs.append(y)
            states.append(st)
        return torch.cat(outs, dim=1), torch.cat(states, dim=0)


@dataclass
class KDAState:
    """Decoding state of one KDA layer for a batch of sequences.

    Fields:
        conv_q, conv_k, conv_v: last ``kernel - 1`` inputs of each short convolution, ``[B, H*K, kernel-1]``,
            in the activation dtype.
        recurrent: the delta-rule memory ``[B, H, K, V]``, fp32.
    """

    conv_q: Tensor
    conv_k: Tensor
    conv_v: Tensor
    recurrent: Tensor

    @classmethod
    def zeros(
        cls, batch: int, cfg: K3Config, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
    ) -> KDAState:
        """The state of ``batch`` empty sequences (conv states in ``dtype``, the memory in fp32)."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive integer, got {batch!r}")
        H, K = cfg.kda_heads, cfg.kda_head_dim
        conv = (batch, H * K, cfg.kda_conv_kernel - 1)
        return cls(
            conv_q=torch.zeros(conv, device=device, dtype=dtype),
            conv_k=torch.zeros(conv, device=device, dtype=dtype),
            conv_v=torch.zeros(conv, device=device, dtype=dtype),
            recurrent=torch.zeros(batch, H, K, K, device=device, dtype=torch.float32),
        )

    @property
    def batch_size(self) -> int:
        return self.recurrent.shape[0]

    def check(self, batch: int, cfg: K3Config) -> None:
        """Raise ``ValueError`` naming the field unless every tensor has the shape for ``batch`` rows of ``cfg``."""
        H, K = cfg.kda_heads, cfg.kda_head_dim
        conv = (batch, H * K, cfg.kda_conv_kernel - 1)
        for name, expected in (("conv_q", conv), ("conv_k", conv), ("conv_v", conv), ("recurrent", (batch, H, K, K))):
            got = tuple(getattr(self, name).shape)
            if got != expected:
                raise ValueError(f"KDAState.{name} must have shape {expected}, got {got}")

    def to_dict(self) -> dict[str, Tensor]:
        """Flat name -> tensor dict (contiguous), ready for ``safetensors.torch.save``."""
        return {name: getattr(self, name).contiguous() for name in _STATE_FIELDS}

    @classmethod
    def from_dict(cls, tensors: dict[str, Tensor]) -> KDAState:
        """Inverse of :meth:`to_dict`; the key set must match exactly and the rows must agree."""
        keys = set(tensors)
        if keys != set(_STATE_FIELDS):
            missing, unknown = sorted(set(_STATE_FIELDS) - keys), sorted(keys - set(_STATE_FIELDS))
            raise ValueError(f"KDAState.from_dict: missing keys {missing}, unknown keys {unknown}")
        state = cls(**{name: tensors[name] for name in _STATE_FIELDS})
        if state.recurrent.dim() != 4:
            raise ValueError(f"KDAState.recurrent must be [B, H, K, V], got shape {tuple(state.recurrent.shape)}")
        if state.recurrent.dtype != torch.float32:
            raise ValueError(f"KDAState.recurrent must be float32, got {state.recurrent.dtype}")
        for name in ("conv_q", "conv_k", "conv_v"):
            t = getattr(state, name)
            if t.dim() != 3 or t.shape[0] != state.batch_size:
                raise ValueError(
                    f"KDAState.{name} must be [B={state.batch_size}, channels, kernel-1], got shape {tuple(t.shape)}"
                )
        return state


class KimiDeltaAttention(nn.Module):
    """One KDA token-mixing layer (see the module docstring)."""

    def __init__(self, cfg: K3Config, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        d, H, K = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim
        self.num_heads, self.head_dim = H, K
        self.lower_bound = cfg.kda_lower_bound
        self.w_q = nn.Linear(d, H * K, bias=False)
        self.w_k = nn.Linear(d, H * K, bias=False)
        self.w_v = nn.Linear(d, H * K, bias=False)
        self.conv_q = ShortConv(H * K, cfg.kda_conv_kernel)
        self.conv_k = ShortConv(H * K, cfg.kda_conv_kernel)
        self.conv_v = ShortConv(H * K, cfg.kda_conv_kernel)
        self.w_fa = nn.Linear(d, cfg.kda_gate_rank, bias=False)
        self.w_fb = nn.Linear(cfg.kda_gate_rank, H * K, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * K))
        self.w_b = nn.Linear(d, H, bias=False)
        self.o_norm = RMSNorm(K, cfg.rms_eps)
        self.w_g = nn.Linear(d, H * K, bias=False)
        self.w_o = nn.Linear(H * K, d, bias=False)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """Initialise ``W_fb``, ``A_log`` and ``dt_bias`` as described in the module docstring."""
        H, K = self.num_heads, self.head_dim
        self.w_fb.weight.zero_()
        if self.A_log.device.type == "meta":
            return  # nothing to initialise (parameter counting); meta math would pull in torch._dynamo
        self.A_log.copy_(torch.empty(H).uniform_(*INIT_A_RANGE).log())
        lo, hi = (math.log(x) for x in INIT_LOG_DECAY_RANGE)
        g0 = torch.empty(H, K).uniform_(lo, hi).exp()  # |initial log decay|
        # Solve lower_bound * sigmoid(exp(A_log) * dt_bias) = -g0 for dt_bias.
        dt = torch.logit(g0 / abs(self.lower_bound)) / self.A_log.exp()[:, None]
        self.dt_bias.copy_(dt.flatten())

    def forward(
        self,
        x: Tensor,
        *,
        cu_seqlens: Tensor | None = None,
        state: KDAState | None = None,
        use_chunk: bool = True,
        return_state: bool = False,
    ) -> tuple[Tensor, KDAState | None]:
        """x [B, T, d] -> (y [B, T, d], new state or None).

        ``state`` (rows: B, or N sequences with ``cu_seqlens``) continues earlier tokens; the new state is
        returned whenever ``state`` is given or ``return_state`` is set, else ``None``.
        """
        if x.dim() != 3 or x.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"x must be [B, T, hidden_size={self.cfg.hidden_size}], got shape {tuple(x.shape)}")
        B, T, _ = x.shape
        if T == 0:
            raise ValueError("x must hold at least one token (T >= 1)")
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"cu_seqlens requires a packed batch with B == 1, got B = {B}")
            sequence_bounds(cu_seqlens, T)
        rows = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if state is not None:
            state.check(rows, self.cfg)
        H, K = self.num_heads, self.head_dim
        want_state = state is not None or return_state
        if use_chunk and dispatch.select_backend(x) == "triton":
            if T == 1 and cu_seqlens is None and not (torch.is_grad_enabled() and x.requires_grad):
                return self._decode_step_kernels(x, state, want_state)
            return self._chunk_kernels(x, state, cu_seqlens, want_state)

        q, conv_q = self.conv_q(self.w_q(x), None if state is None else state.conv_q, cu_seqlens)
        k, conv_k = self.conv_k(self.w_k(x), None if state is None else state.conv_k, cu_seqlens)
        v, conv_v = self.conv_v(self.w_v(x), None if state is None else state.conv_v, cu_seqlens)
        q = F.normalize(q.view(B, T, H, K).float(), dim=-1, eps=1e-6)
        k = F.normalize(k.view(B, T, H, K).float(), dim=-1, eps=1e-6)
        v = v.view(B, T, H, K)
        g = kda_gate(self.w_fb(self.w_fa(x)).view(B, T, H, K), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.w_b(x).float())

        core = kda_chunk if (use_chunk and T > 1) else kda_recurrent
        o, recurrent = core(
            q, k, v, g, beta,
            initial_state=None if state is None else state.recurrent,
            output_final_state=want_state,
            cu_seqlens=cu_seqlens,
        )
        return self._finish(x, o, want_state, conv_q, conv_k, conv_v, recurrent)

    def _finish(self, x: Tensor, o: Tensor, want_state: bool, conv_q: Tensor, conv_k: Tensor, conv_v: Tensor,
                recurrent: Tensor | None) -> tuple[Tensor, KDAState | None]:
        """Output norm, gate and projection of the core's ``o [B, T, H, V]``; the new state when wanted."""
        y = self._output(x, o)
        if not want_state:
            return y, None
        return y, KDAState(conv_q=conv_q, conv_k=conv_k, conv_v=conv_v, recurrent=recurrent.float())

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        """Output norm, gate and projection: the core's o [..., H, V] with its input x [..., d] -> y [..., d]."""
        o = self.o_norm(o).flatten(-2)
        return self.w_o(o * torch.sigmoid(self.w_g(x)))

    def _chunk_kernels(self, x: Tensor, state: KDAState | None, cu_seqlens: Tensor | None,
                       want_state: bool) -> tuple[Tensor, KDAState | None]:
        """Triton backend, any length: convolutions in torch, then the fused chunked kernel on raw projections."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        q, conv_q = self.conv_q(self.w_q(x), None if state is None else state.conv_q, cu_seqlens)
        k, conv_k = self.conv_k(self.w_k(x), None if state is None else state.conv_k, cu_seqlens)
        v, conv_v = self.conv_v(self.w_v(x), None if state is None else state.conv_v, cu_seqlens)
        o, recurrent = dispatch.kda_chunk_op(
            q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, K),
            self.w_fb(self.w_fa(x)).view(B, T, H, K), self.w_b(x), self.A_log, self.dt_bias,
            lower_bound=self.lower_bound,
            initial_state=None if state is None else state.recurrent,
            output_final_state=want_state,
            cu_seqlens=cu_seqlens,
        )
        return self._finish(x, o, want_state, conv_q, conv_k, conv_v, recurrent)

    def _decode_step_kernels(self, x: Tensor, state: KDAState | None,
                             want_state: bool) -> tuple[Tensor, KDAState | None]:
        """Triton backend, one token per row, no gradients: fused short-conv and recurrent decode kernels.

        The kernels advance state pools in place; the pools here are fresh copies of ``state`` (rows 0..B-1),
        so the state passed in stays untouched, as on the reference path.
        """
        B = x.shape[0]
        fresh = KDAState.zeros(B, self.cfg, x.device, x.dtype) if state is None else state
        pool = KDAState(
            conv_q=fresh.conv_q.to(dtype=x.dtype, copy=True).contiguous(),
            conv_k=fresh.conv_k.to(dtype=x.dtype, copy=True).contiguous(),
            conv_v=fresh.conv_v.to(dtype=x.dtype, copy=True).contiguous(),
            recurrent=fresh.recurrent.to(dtype=torch.float32, copy=True).contiguous(),
        )
        y = self.decode_in_place(x[:, 0], pool, torch.arange(B, device=x.device))
        return y[:, None], (pool if want_state else None)

    def decode_in_place(self, h: Tensor, pool: KDAState, slots: Tensor) -> Tensor:
        """One token for each of B sequences whose states are rows ``slots`` of ``pool``: h [B, d] -> y [B, d].

        ``pool`` holds ``num_slots`` rows of every field (a serving engine's preallocated state pool); the rows
        ``slots`` (distinct, not checked here) are advanced in place by the short-convolution and recurrent
        decode ops, the Triton kernels or their references as :mod:`k3.kernels.dispatch` decides. Nothing is
        gathered or copied, so the step's cost does not depend on the pool's size and its tensors keep their
        addresses (a CUDA graph can replay it).
        """
        B = h.shape[0]
        H, K = self.num_heads, self.head_dim
        q, k, v = (
            dispatch.short_conv_decode_op(proj(h), rows, conv.conv.weight[:, 0], slots, validate=False).view(B, H, K)
            for conv, proj, rows in ((self.conv_q, self.w_q, pool.conv_q), (self.conv_k, self.w_k, pool.conv_k),
                                     (self.conv_v, self.w_v, pool.conv_v))
        )
        o = dispatch.kda_decode_op(
            q, k, v, self.w_fb(self.w_fa(h)).view(B, H, K), self.w_b(h), self.A_log, self.dt_bias,
            pool.recurrent, slots, lower_bound=self.lower_bound, validate=False,
        )
        return self._output(h, o)
