"""Chunked Kimi Delta Attention in Triton: forward and backward kernels behind a ``torch.autograd.Function``.

Entry point: :func:`chunk_kda` (raw gate and beta in, gate / L2 norm / sigmoid applied inside the kernels).
The maths is the one written out in :mod:`k3.kernels.kda.reference`: per chunk of ``BT`` tokens,
``G = cumsum(g)``, the strictly lower ``A_kk``, the inclusive ``A_qk``, ``T = (I + A_kk)^-1``,
``w = T (beta k exp(G))``, ``u = T (beta v)``, ``v_new = u - w S``, ``O = scale (q exp(G)) S + A_qk v_new``
and ``S' = exp(G_last) S + (k exp(G_last - G))^T v_new``.

Design decisions
----------------
* Stages and launches. Forward: (1) a chunk-parallel gate kernel: the gate, its cumulative sum ``G`` and the last
  row ``G_last`` of every chunk (one program per K tile), and the inverse row norms of q and k (one more program
  per chunk and head); (2) one program per (chunk, head, 16-row sub-chunk): the diagonal blocks of ``A_qk`` and
  ``A_kk``, the latter inverted; (3) one program per (chunk, head): the blocks below the diagonal and ``T`` (the
  "blocks solve" below; ``intra_solve="strips"`` forms whole 16-row strips of both matrices in (2) and assembles
  ``T`` in (3) instead); (4) the WY kernel, one program per (chunk, head, K or V tile): ``w``, ``u`` and the
  operands of stage 5, ``qg = scale q exp(G)`` and ``kd = k exp(G_last - G)``; (5) one program per (sequence,
  head, V tile) carries the fp32 state in registers across the chunks of its sequence and writes every chunk's
  output from the state before it (the chunk states only when they are asked for: a separate output kernel that
  read them back took 0.19 ms of 0.52 at 2·8192·32·128, the fused stage 0.37). Backward recomputes the states and
  ``v_new`` (stage 5 again, without the output) instead of keeping them, then: ``dA_qk``; the reverse state
  recurrence (``dS`` per chunk, ``dv_new``, ``d initial_state``); the WY-transform gradients in two kernels, the V
  side (``dv``, ``du u^T``) and one program per K tile (``dq``, ``dk``, ``dG`` of the inter-chunk terms, ``dw
  w^T``); ``dA_kk = -T^T (du u^T + sum dw w^T)`` (in the WY-K kernel itself where it takes the whole K); the
  intra-chunk gradients through ``A_qk`` / ``A_kk``, one program per 16-row sub-chunk; and a last kernel for the
  reverse cumulative sum of ``dG`` and the gate's backward (one program per chunk, head and K tile) and the
  L2-norm and sigmoid backward (two more per chunk and head). No Python loop runs over chunks: chunk and sequence
  index tables are built on the host (vectorised, cached per layout).
* Grid order. Chunk-parallel kernels run on a 1-D grid in which the parts of one (chunk, head) -- strips,
  sub-chunks, K or V tiles -- are neighbours, then the heads of one chunk: programs that load the same
  tiles run together and share them through L2.
* Registers decide the speed. A kernel that keeps a whole chunk's ``[64, 128]`` fp32 tiles of several
  operands live spills to local memory, and an H200 then runs it several times slower; the stages are cut
  where Triton's resource report showed spills (the fused intra-chunk kernel, the K-tile loop of the WY
  backward), and the state kernels read operands (``qg``, ``kd``, ``w``) with every per-token factor
  already folded in, so their sequential loop holds nothing but the state and one chunk's tiles.
* Varlen. Every sequence (``cu_seqlens``) or batch row is cut into its own chunks, so no chunk straddles
  two sequences; a dense batch is treated as ``B`` sequences of a packed ``[1, B*T]`` row.
* The lower bound and tensor cores. Within a 16-token sub-chunk ``|G_i - G_j| <= 15 |lower_bound|``, so
  with a reference row ``r`` inside the sub-chunk ``exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j)``
  splits into two factors that stay inside fp32 range. For the rows of sub-chunk ``b`` the reference is
  its first row: every column ``j`` before it gets a factor ``<= 1`` and the columns inside it a factor
  ``<= exp(15 |lower_bound|)``. That turns each 16-row strip of ``A_qk`` / ``A_kk`` (and of their
  gradients) into one ``tl.dot``. ``lower_bound`` is therefore limited to ``15 |lower_bound| <= 80``.
  The forward computes each strip transposed, ``A[b rows, :]^T = (column factors) (row factors)^T``: the
  product then has the chunk's ``BT`` rows, which Hopper runs as one warp-group product instead of
  warp-level ones on 16 rows.
* Inverse. Each strip program inverts its 16x16 diagonal block as ``(I - A)(I + A^2)(I + A^4)(I + A^8)``
  (A is nilpotent) in exact fp32. The next kernel then has ``X = D + L`` (D the inverted diagonal blocks, L
  the strictly block-lower part of ``A_kk``): ``I + A_kk = (I + A_diag)(I + D L)`` and ``M = D L`` is
  block-nilpotent (``M^4 = 0`` for four blocks), so ``T = (I - M)(I + M^2) D``, four chunk-sized products.
* Blocks solve (``ChunkKDAConfig.intra_solve="blocks"``, the default; ``"strips"`` runs the two kernels
  above). The same products cut into 16 x 16 blocks: a diagonal kernel, one program per (chunk, head,
  sub-chunk ``b``), forms ``A[b, b]`` and ``D_b`` from one read of the sub-chunk's tiles, with its first row
  as the reference of its rows and its columns; a solve kernel, one program per (chunk, head), forms every
  block below the diagonal in one loop over K tiles with each sub-chunk factored against its own first row
  -- rows ``q exp(G - G_ref_b)`` (<= 1), columns ``k exp(G_ref_c - G)`` (<= exp(15 |lower_bound|)), joined by
  ``exp(G_ref_b - G_ref_c)`` per K column (<= 1) -- so a sub-chunk's exponentials are taken once per K tile
  instead of once per strip, then ``T`` by block forward substitution in registers: no zero block is
  multiplied and ``X`` never goes through memory.
* Precision. Accumulation is fp32 everywhere; the products' operand precision is chosen per stage
  (``ChunkKDAConfig.precision``; ``_dot``). With 16-bit inputs: bf16 operands in the forward state kernel (its
  result is the bf16 output), tf32 in the forward intra-chunk and WY kernels and in most of the backward, and
  split bf16 (``hi + lo``, three bf16 tensor-core products, about 16 significant bits) in the backward
  intra-chunk kernel, where ``dG`` gathers pairwise terms that cancel exactly (each ``A[i, j]`` adds to
  ``dG_i`` what it takes from ``dG_j``) and ``dA_log`` / ``dt_bias`` sum them over all tokens. Without
  autograd (inference, prefill) the product operands that cross kernels (``A_qk``, ``w``, ``u``, ``qg``,
  ``kd``, ``v_new``, the states) are bf16, half the bytes, since the products round them to bf16 or tf32
  anyway; there ``T`` is a bf16 copy and the WY products take bf16 operands, since ``w`` and ``u`` are stored
  in bf16 right after them (inference output error 3.1e-3 -> 3.4e-3 relative RMS against the fp64 reference on
  an H200, tolerance 5e-3; WY 0.46 -> 0.39 ms at 2·8192·32·128). When a backward follows, ``u``, ``v_new`` and
  the states are fp32, ``A_qk``, ``w``, ``qg`` and ``kd`` fp16 where they are bounded by 1
  (``_bounded_operand_dtype``: same 11 significant bits as the tf32 products, half the bytes; fp32 otherwise),
  and the states are recomputed with 11 significant bits (tf32 products; with fp16 ``w`` and ``kd``, fp16
  products on per-column scaled states, see ``_fwd_state_kernel``, which then hand those fp16 states with their
  column factors to the WY-K kernel, as the backward state kernel does the state gradients:
  ``ChunkKDAConfig.f16_states``): ``dA_log`` (and ``dt_bias``) sum ``dG``
  terms over all tokens that largely cancel, so a rounding anywhere upstream shows up there first. Measured
  with the CPU tests' fresh inputs: bf16 ``u`` or ``v_new`` raised ``dA_log``'s error five-fold, bf16 ``kd``
  raised ``dv``'s and ``dbeta``'s, bf16 states or bf16 products in the recomputation pushed ``dA_log`` past
  the tolerance in about one varlen test in 40, and bf16 ``A_qk``, ``w``, ``qg`` did in about one small-tile
  test in 30; fp16 ones did not in 100 runs. With an fp32 input every product is exact fp32
  (``input_precision="ieee"``) and every intermediate fp32.
* The Triton interpreter (``TRITON_INTERPRET=1``, used by the CPU tests) multiplies the raw bit patterns
  of bf16 dot operands and truncates fp32 -> bf16 casts. Under it the kernels round bf16 operands and
  bf16 outputs themselves (round to nearest even, kept in fp32 containers), round tf32 operands as the
  hardware converts them, and evaluate split products as exact fp32 products (they differ by ``lo.lo``,
  about 2^-16 relative): the numbers the GPU path gives.
  The mode is read from how Triton built the kernels, not guessed.
* ``ChunkKDAConfig.poison`` fills every buffer the kernels write with NaN before the launch, so an element
  a kernel forgot to write shows up as NaN (used by the tests).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.errors import OutOfResources

from k3.kernels.kda.reference import sequence_bounds

__all__ = ["ChunkKDAConfig", "ChunkKDAFunction", "chunk_kda"]

_FP32_MAX = tl.constexpr(3.4028234663852886e38)
# Same clamp as the reference gate (see k3.kernels.kda.reference): keeps lower_bound * sigmoid(.) < 0.
_LOGIT_MIN = tl.constexpr(-80.0)
# F.normalize's eps: q / max(||q||, eps), as the model layer normalises.
_L2_EPS = tl.constexpr(1e-6)
_SUB = 16  # sub-chunk length of the intra-chunk blocks (the tensor-core tile height)
_MAX_EXPONENT = 80.0  # largest exp() argument the factorised sub-chunk products may see
_MAX_HEAD_DIM = 256  # the state kernels keep a whole [K, block_v] state tile in registers
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CHUNK_SIZES = (16, 32, 64)
_PRECISIONS = ("auto", "bf16", "tf32", "split", "ieee")
_INTRA_SOLVES = ("strips", "blocks")


@dataclass(frozen=True)
class ChunkKDAConfig:
    """Launch parameters of the chunked KDA kernels. Defaults for K = V = 128 on an H200, picked from
    Triton's resource report (register spills) and per-kernel timings (docs/BENCHMARKS.md).

    Fields:
        block_k: K tile of the forward WY kernel where its ``T`` operand is bf16 (no backward follows,
            16-bit inputs). 32 took the forward from 1.891 to 1.860 ms at 2·8192·32·128 on an H100 (3.915 ->
            3.816 at 1·32768·32·128, 1.851 -> 1.820 at 8·4096·16·128; that kernel 0.480 -> 0.441 ms).
        block_k_fp32: the same where ``T`` and ``u`` are fp32 (a backward follows, or fp32 inputs): there 32
            slowed that kernel from 0.567 to 0.592 ms at 2·8192·32·128 on an H100, so it stays at 64.
        intra_block_k: K tile of the forward strip kernel (rows of ``A_qk`` and ``A_kk``): 32 took it from 0.67
            to 0.63 ms at 2·8192·32·128 on an H200 (0.84 ms at 128; docs/BENCHMARKS.md).
        gate_block_k: K tile of the gate kernel: one program per (chunk, head, K tile) computes the gate and
            its cumulative sum ``G`` on that tile, one more per (chunk, head) the q/k row norms. 32: 0.23 ms
            at 2·8192·32·128 on an H200, 64: 0.29; one program per (chunk, head) looping over the tiles took
            0.28 (docs/BENCHMARKS.md).
        block_v: V tile of the forward WY kernel (power of two >= 16).
        num_warps: warps per program of the forward chunk-parallel kernels (except the inverse kernel).
        inverse_num_warps: warps per program of the forward inverse kernel (``T`` from the strips' output,
            four ``[BT, BT]`` products): 2 took it from 0.164 to 0.140 ms at 2·8192·32·128 on an H200, where
            the other forward kernels were fastest at 4 (docs/BENCHMARKS.md).
        intra_solve: how the forward forms ``A_qk`` and ``T = (I + A_kk)^-1``. ``"blocks"`` (default): a kernel
            per 16-row sub-chunk for the diagonal blocks and their inverses, and one program per (chunk, head)
            for every block below the diagonal and ``T``. ``"strips"``: one program per 16-row strip, then the
            inverse kernel (see the module notes). At 8·4096·16·128 on an H100, in one process, blocks took
            the forward from 1.814 to 1.717 ms and forward + backward from 8.718 to 8.641, with 64 MiB less
            peak memory (docs/BENCHMARKS.md, twentieth pass; not yet timed on an H200).
        diag_num_warps: warps per program of the blocks solve's diagonal kernel (16-row tiles).
        diag_block_k: K tile of that kernel (its tiles are ``[16, diag_block_k]``).
        solve_num_warps: warps per program of its below-diagonal kernel (twelve 16 x 16 accumulators for 64-token
            chunks).
        solve_block_k: K tile of that kernel. In the sm_90 compile 32 sits at 255 registers and 16 at 231,
            neither with spill (with int64 offsets 32 spilled 16 bytes); on a variant of the kernel 16 was no
            faster (docs/BENCHMARKS.md, twentieth and twenty-first passes).
        num_stages: software-pipelining depth of the chunk-parallel kernels' loops (Triton's
            ``num_stages``); each stage holds a copy of the loop's tiles in shared memory.
        state_block_v: V tile of the forward state kernel when its operands are bf16 (inference: no
            backward follows); one program per (sequence, head, V tile) keeps a ``[K, state_block_v]``
            fp32 state in registers (power of two >= 16) and writes the output of every chunk. At 8 warps one
            program fills an SM (registers), so the widest tile that still gives half the SMs a program wins: 128
            took the kernel from 0.505 to 0.339 ms at 8·4096·16·128 on an H200 (128 programs in one wave instead
            of 256 in two); at 2·8192·32·128 the rule in ``_state_launch`` halves it to 64 and runs it on 4
            warps (0.30-0.33 ms; 0.37 at 8 warps, and 32-wide tiles at 4 warps took 0.65; docs/BENCHMARKS.md).
        state_num_warps: warps per program of that kernel.
        state_num_stages: pipelining depth of that kernel's loop over chunks.
        state_num_stages_few_programs: the same when the kernel has fewer programs than the GPU has SMs (a few
            long sequences): each program then has an SM to itself, and only a deeper pipeline hides its
            loads' latency (one sequence of 32768 tokens, 32 heads: 1.07 -> 0.86 ms at 3 stages; with more
            programs than SMs 3 stages were slower than 2).
        state_block_v_fp32: V tile of the forward state kernel when ``u`` and the states are fp32 (a
            backward follows: the training forward and the backward's recomputation of the states; or the
            inputs are fp32). The three state V tiles are the widest used: with few (sequence, head) pairs
            they are halved until at least half the GPU's SMs get a program, and tiles of 32 or less run on at
            most 4 warps.
        state_num_warps_fp32: warps per program of that kernel.
        state_num_stages_fp32: pipelining depth of its loop over chunks.
        bwd_state_block_v: V tile of the backward state kernel (reverse recurrence of ``dS``).
        bwd_state_num_warps: warps per program of that kernel.
        bwd_state_num_stages: pipelining depth of its loop; each stage holds one chunk's ``kd``, ``qg``
            and ``w`` tiles (fp16, fp32 without the in-kernel norm and sigmoid) in shared memory (227 KB on an
            H200).
        bwd_state_f16: fp16 products in that kernel where its tiles are fp16, tf32 products are asked for and
            ``bwd_state_num_stages`` is 1 (``dO``, ``dS`` and ``dv_new`` scaled per column; see the kernel):
            0.927 -> 0.832 ms at 2·8192·32·128 on an H100. Off: tf32 products.
        f16_states: where a state kernel forms fp16 products (the backward's recomputation of the states with
            fp16 tiles, and the backward state kernel under ``bwd_state_f16``), the states / state gradients it
            writes for the WY-K kernel are that fp16 tile with one fp32 factor per column instead of fp32: the
            values the recurrence's products use, half the bytes written there and read by WY-K, and half the
            memory of the two largest backward buffers (``[chunks, H, K, V]`` each). On an H200, fwd+bwd at
            2·8192·32·128 8.35 -> 8.16 ms (backward state kernel 0.86 -> 0.67, WY-K 1.54 -> 1.57), peak memory
            4048 -> 3544 MiB; at 1·32768·32·128 18.44 -> 17.93 ms. ``dv_new``'s gradient in the same form was
            tried and dropped: WY-V 0.40 -> 0.54 ms undid the gain. Off: fp32 states.
        bwd_block_k: K tile of the backward WY kernel (one program per chunk, head and K tile). The whole
            K = 128 (one program per chunk and head) reads each V-side tile (``dO``, ``dv_new``, ``v_new``) once
            instead of once per K tile: on an H200 at 2·8192·32·128 that kernel went from 1.64 to 1.55 ms
            (64-wide tiles, both with a runtime V loop) and ``dA_kk`` from 0.18 to 0.145 ms (one partial
            product fewer).
        bwd_wy_k_num_warps: warps per program of that kernel. Its three ``[BT, bwd_block_k]`` fp32
            accumulators stay live across the V loop; at 8 warps and 128-wide tiles it holds them without
            spill in the sm_90 compile (twenty-first pass; 208 bytes per thread when it was first timed); at 4
            warps it spills 1.9 KB.
        bwd_block_v: V tile of the backward chunk-parallel kernels' loops over V (``dA_qk``, WY-V); not
            WY-K's. 32 -> 64 on an H200 at 2·8192·32·128: ``dA_qk`` 0.176 -> 0.136 ms, WY-V 0.398 -> 0.358.
        bwd_wy_k_block_v: V tile of the WY-K kernel's loop over V. It stays at 32: that kernel slows at 64
            (1.587 -> 1.590 ms at 2·8192·32·128, 3.13 -> 3.17 at 1·32768·32·128 on an H200; 1.94 -> 2.19
            on an older form of it).
        bwd_num_warps: warps per program of the backward chunk-parallel kernels (except the WY-K one above
            and the two below).
        bwd_intra_block_k: K tile of the backward intra-chunk kernel (one program per chunk, head,
            16-row sub-chunk and K tile; its tiles are ``[16, bwd_intra_block_k]``).
        bwd_intra_num_warps: warps per program of the backward intra-chunk kernel (16-row tiles).
        bwd_intra_num_stages: pipelining depth of the backward intra-chunk kernel's loops over the sub-chunks it
            interacts with. On an H100 at 2·8192·32·128 that kernel took 1.88 ms at 3, 1.92 at 2 and 1.91 at 1.
        bwd_finish_block_k: K tile of the last backward kernel's gate part (reverse cumulative sum of ``dG``
            and the gate backward, one program per (chunk, head, K tile) on the whole chunk); two more programs
            per (chunk, head) take the L2-norm backward of ``dq`` and of ``dk`` (with ``dbeta``'s sigmoid
            backward). As one program per (chunk, head) looping over 16-row sub-chunks, the kernel took
            0.60 ms at 2·8192·32·128 on an H200 (0.68 on an H100, against 0.82 at 4 warps and 1.32 at 8);
            split this way, 0.533 against 0.665 ms on an H100 in one process (1.056 against 1.288 at
            1·32768·32·128), and 96 registers instead of 168.
        bwd_finish_num_warps: warps per program of that kernel.
        precision: matrix-product precision. ``"auto"``: exact fp32 products when any of q, k, v is fp32; when
            all are 16-bit, bf16 products in the forward state kernel (the bf16 output is rounded anyway),
            split-bf16 products in the backward intra-chunk kernel (below) and tf32 products everywhere else
            (A, the inverse, the WY factors -- bf16 there without autograd, see the module notes -- the rest
            of the backward). ``"bf16"``, ``"tf32"``, ``"split"`` (three bf16 tensor-core products, about 16
            significant bits), ``"ieee"``: that precision in every kernel. ``"bf16"`` is the fastest; its gate
            gradients carry errors of a few percent, because ``dG`` sums pairwise terms that cancel (each
            ``A[i, j]`` adds to ``dG_i`` what it takes from ``dG_j``) and ``dA_log`` / ``dt_bias`` sum ``dg``
            over all tokens. Those pairs are formed in the backward intra-chunk kernel: with tf32 there,
            ``dt_bias``'s relative error reaches 5.5e-3 (12 seeds of the varlen test), with split products
            6e-4.
        recompute: keep only the inputs for the backward and run the forward's chunk-parallel stages (gate,
            strips, inverse, WY) again there, instead of keeping their outputs: about 2.1 KB less per token
            and head at K = V = 128 (``G``, ``T``, ``u`` in fp32, ``A_qk``, ``w``, ``qg``, ``kd`` in fp16),
            for those stages' time once more. The gradients are the same bits.
        poison: fill every kernel-written buffer with NaN before launching (debugging aid).
    """

    block_k: int = 32
    block_k_fp32: int = 64
    intra_block_k: int = 32
    gate_block_k: int = 32
    block_v: int = 64
    num_warps: int = 4
    inverse_num_warps: int = 2
    intra_solve: str = "blocks"
    diag_num_warps: int = 1
    diag_block_k: int = 32
    solve_num_warps: int = 2
    solve_block_k: int = 32
    num_stages: int = 2
    state_block_v: int = 128
    state_num_warps: int = 8
    state_num_stages: int = 2
    state_num_stages_few_programs: int = 3
    state_block_v_fp32: int = 32
    state_num_warps_fp32: int = 4
    state_num_stages_fp32: int = 2
    bwd_state_block_v: int = 32
    bwd_state_num_warps: int = 4
    bwd_state_num_stages: int = 1
    bwd_state_f16: bool = True
    f16_states: bool = True
    bwd_block_k: int = 128
    bwd_block_v: int = 64
    bwd_wy_k_block_v: int = 32
    bwd_num_warps: int = 4
    bwd_wy_k_num_warps: int = 8
    bwd_intra_block_k: int = 64
    bwd_intra_num_warps: int = 2
    bwd_intra_num_stages: int = 3
    bwd_finish_block_k: int = 32
    bwd_finish_num_warps: int = 2
    precision: str = "auto"
    recompute: bool = False
    poison: bool = False

    def __post_init__(self) -> None:
        for name in (
            "block_k", "block_k_fp32", "intra_block_k", "diag_block_k", "solve_block_k", "gate_block_k",
            "block_v", "state_block_v", "state_block_v_fp32", "bwd_state_block_v", "bwd_block_k", "bwd_block_v",
            "bwd_wy_k_block_v", "bwd_intra_block_k", "bwd_finish_block_k",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"ChunkKDAConfig.{name} must be a power of two >= 16, got {value!r}")
        for name in (
            "num_stages", "state_num_stages", "state_num_stages_few_programs", "state_num_stages_fp32",
            "bwd_state_num_stages", "bwd_intra_num_stages",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4:
                raise ValueError(f"ChunkKDAConfig.{name} must be an int from 1 to 4, got {value!r}")
        for name in (
            "num_warps", "inverse_num_warps", "diag_num_warps", "solve_num_warps", "state_num_warps",
            "state_num_warps_fp32", "bwd_state_num_warps", "bwd_num_warps", "bwd_wy_k_num_warps",
            "bwd_intra_num_warps", "bwd_finish_num_warps",
        ):
            value = getattr(self, name)
            if value not in (1, 2, 4, 8, 16):
                raise ValueError(f"ChunkKDAConfig.{name} must be one of 1, 2, 4, 8, 16, got {value!r}")
        for name in ("bwd_state_f16", "f16_states", "recompute", "poison"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ChunkKDAConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.intra_solve not in _INTRA_SOLVES:
            raise ValueError(f"ChunkKDAConfig.intra_solve must be one of {_INTRA_SOLVES}, got {self.intra_solve!r}")
        if self.precision not in _PRECISIONS:
            raise ValueError(f"ChunkKDAConfig.precision must be one of {_PRECISIONS}, got {self.precision!r}")


# =========================================================================================== jit helpers


def _probe() -> None:
    pass


# Kernels built by the Triton interpreter (TRITON_INTERPRET=1 at import) run as Python on the CPU.
_INTERPRETED = type(triton.jit(_probe)).__name__ == "InterpretedFunction"
# Set only by ops/bench/kda_resources.py, which replaces every kernel launch by a compile for an sm_90 target and
# calls chunk_kda on CPU tensors to find the launches.
_COMPILE_ONLY = False


def _helper(fn):
    """``triton.jit`` for a function called from kernels. Under the interpreter the helper stays a plain
    function: kernels already run with ``triton.language`` patched, and a nested interpreted call would
    patch it again on every call (most of the interpreter's time)."""
    return fn if _INTERPRETED else triton.jit(fn)


if _INTERPRETED:
    # tl.sum / tl.cumsum are themselves jit functions; the interpreter's fast numpy path is reached
    # through tl.reduce / tl.associative_scan with the standard sum combiner.
    def _sum(x, axis):
        return tl.reduce(x, axis, tl.standard._sum_combine)

    def _revcumsum(x, axis):
        return tl.associative_scan(x, axis, tl.standard._sum_combine, reverse=True)

    def _cumsum(x, axis):
        return tl.associative_scan(x, axis, tl.standard._sum_combine)

    def _max(x, axis):
        return tl.reduce(x, axis, tl.standard._elementwise_max)

else:

    @triton.jit
    def _sum(x, axis: tl.constexpr):
        return tl.sum(x, axis)

    @triton.jit
    def _revcumsum(x, axis: tl.constexpr):
        return tl.cumsum(x, axis, reverse=True)

    @triton.jit
    def _cumsum(x, axis: tl.constexpr):
        return tl.cumsum(x, axis)

    @triton.jit
    def _max(x, axis: tl.constexpr):
        return tl.max(x, axis)


@_helper
def _round_bf16(x):
    """fp32 -> nearest bf16 value (ties to even), kept in fp32."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@_helper
def _bf(x, EMU: tl.constexpr):
    """x rounded to bf16 as a dot operand (an fp32 container holding the bf16 value under the interpreter)."""
    if EMU:
        return _round_bf16(x.to(tl.float32))
    else:
        return x.to(tl.bfloat16)


@_helper
def _round_tf32(x):
    """fp32 -> nearest tf32 value (10 mantissa bits, ties away from zero as the hardware converts), in fp32."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x1000) & 0xFFFFE000
    return b.to(tl.float32, bitcast=True)


@_helper
def _dot(a, b, P: tl.constexpr, EMU: tl.constexpr):
    """a @ b with an fp32 result. P = 0: bf16 operands (one tensor-core product); P = 1: split bf16
    (x = hi + lo with hi, lo in bf16; hi.hi + hi.lo + lo.hi, three products, about 16 significant bits);
    P = 2: exact fp32 (``input_precision="ieee"``); P = 3: tf32 operands (one tensor-core product at half
    the bf16 rate, 11 significant bits). Under the interpreter P = 1 is evaluated as the exact product,
    from which the split product differs only by lo.lo (about 2^-16 relative), and P = 0 / 3 round their
    operands as the hardware does."""
    if P == 2 or (P == 1 and EMU):
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif P == 1:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        ah = a.to(tl.bfloat16)
        bh = b.to(tl.bfloat16)
        acc = tl.dot((a - ah.to(tl.float32)).to(tl.bfloat16), bh)
        acc = tl.dot(ah, (b - bh.to(tl.float32)).to(tl.bfloat16), acc)
        return tl.dot(ah, bh, acc)
    elif P == 3:
        if EMU:
            return tl.dot(_round_tf32(a.to(tl.float32)), _round_tf32(b.to(tl.float32)), input_precision="ieee")
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    else:
        if EMU:
            return tl.dot(_bf(a, EMU), _bf(b, EMU), input_precision="ieee")
        else:
            return tl.dot(_bf(a, EMU), _bf(b, EMU))


@_helper
def _out(x, ptr, EMU: tl.constexpr):
    """Value ready for ``tl.store`` to ``ptr``: rounds to nearest bf16 first where the interpreter would truncate."""
    if EMU:
        if ptr.dtype.element_ty == tl.bfloat16:
            x = _round_bf16(x)
    return x


@_helper
def _f16_columns(x):
    """``(x16, unit)``: the fp32 tile ``x`` as fp16 with each column scaled so that its largest magnitude lands in
    [2^14, 2^15), and the factor back, ``x ~= x16 * unit[None, :]``. fp16 keeps the 11 significant bits of tf32,
    and the scale keeps any column's range clear of fp16's overflow and of its subnormals."""
    top = tl.maximum(_max(tl.abs(x), 0), 1e-30)
    return (x * (16384.0 / top)[None, :]).to(tl.float16), top * (1.0 / 16384.0)


@_helper
def _dot16(a, b, EMU: tl.constexpr):
    """a @ b of two fp16 tiles, fp32 result (an exact fp32 product of the same values under the interpreter)."""
    if EMU:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@_helper
def _chunk_program(S: tl.constexpr, H: tl.constexpr):
    """``(chunk, head, part)`` of a program on the 1-D grid of ``chunks * H * S`` programs.

    The ``S`` parts of one (chunk, head) are launched side by side, then the heads of one chunk: programs
    that read the same tiles run at the same time and share them through L2, and neighbouring programs read
    neighbouring rows of the token-major tensors."""
    pid = tl.program_id(0)
    part = pid % S
    rest = pid // S
    return rest // H, rest % H, part


@_helper
def _gate_rate(A_log, i_h):
    """(exp(A_log[h]) clamped to fp32 max, 1.0 if unclamped else 0.0 -- the derivative mask of the clamp)."""
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    ok = (a <= _FP32_MAX).to(tl.float32)
    return tl.minimum(a, _FP32_MAX), ok


@_helper
def _gate_sigmoid(graw, dt, rate):
    """(logit before the clamp, sigmoid of the clamped logit) of the KDA gate."""
    z = rate * (graw + dt[None, :])
    s = 1.0 / (1.0 + tl.exp(-tl.maximum(z, _LOGIT_MIN)))
    return z, s


@_helper
def _load_beta(beta_raw, row, mask, BETA_SIGMOID: tl.constexpr):
    b = tl.load(beta_raw + row, mask=mask, other=0.0).to(tl.float32)
    if BETA_SIGMOID:
        b = 1.0 / (1.0 + tl.exp(-b))
    return tl.where(mask, b, 0.0)


@_helper
def _unit_lower_inverse16(A):
    """(I + A)^-1 of a strictly lower-triangular fp32 ``[16, 16]`` block.

    A is nilpotent (A^16 = 0), so (I + A)^-1 = sum_k (-A)^k = (I - A)(I + A^2)(I + A^4)(I + A^8): six exact
    fp32 products of 16 x 16 tiles instead of a 15-step forward substitution of row extractions."""
    o = tl.arange(0, 16)
    eye = (o[:, None] == o[None, :]).to(tl.float32)
    X = eye - A
    P2 = tl.dot(A, A, input_precision="ieee")
    X = X + tl.dot(X, P2, input_precision="ieee")
    P4 = tl.dot(P2, P2, input_precision="ieee")
    X = X + tl.dot(X, P4, input_precision="ieee")
    P8 = tl.dot(P4, P4, input_precision="ieee")
    return X + tl.dot(X, P8, input_precision="ieee")


# ================================================================================================ forward


@triton.jit
def _fwd_gate_kernel(
    q, k, g_raw, A_log, dt_bias, G, gl, rq, rk,
    chunk_start, chunk_len, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, NKT: tl.constexpr,
    L2NORM: tl.constexpr,
):  # fmt: skip
    """One (chunk, head, part): parts below ``NKT`` take one K tile of the gate, its cumulative sum ``G`` and
    ``gl = G_last`` (one row per chunk); the last part takes the inverse row norms of q and k."""
    i_c, i_h, part = _chunk_program(NKT + 1, H)
    t0 = tl.load(chunk_start + i_c).to(tl.int64)
    nv = tl.load(chunk_len + i_c)
    r = tl.arange(0, BT)
    valid = r < nv
    row = (t0 + r) * H + i_h  # token-major row index of (token, head)
    if part < NKT:
        rate, _ = _gate_rate(A_log, i_h)
        c = part * BK + tl.arange(0, BK)
        cm = c < K
        m2 = valid[:, None] & cm[None, :]
        off = row[:, None] * K + c[None, :]
        graw = tl.load(g_raw + off, mask=m2, other=0.0).to(tl.float32)
        dt = tl.load(dt_bias + i_h * K + c, mask=cm, other=0.0).to(tl.float32)
        _, sig = _gate_sigmoid(graw, dt, rate)
        g = tl.where(m2, lower_bound * sig, 0.0)
        tl.store(G + off, _cumsum(g, 0), mask=m2)
        tl.store(gl + (i_c.to(tl.int64) * H + i_h) * K + c, _sum(g, 0), mask=cm)  # G at the chunk's last row
    else:
        if L2NORM:
            sq = tl.full([BT], 0.0, tl.float32)
            sk = tl.full([BT], 0.0, tl.float32)
            for kk in tl.static_range(0, K, BK):
                c = kk + tl.arange(0, BK)
                m2 = valid[:, None] & (c < K)[None, :]
                off = row[:, None] * K + c[None, :]
                bq = tl.load(q + off, mask=m2, other=0.0).to(tl.float32)
                bk = tl.load(k + off, mask=m2, other=0.0).to(tl.float32)
                sq += _sum(bq * bq, 1)
                sk += _sum(bk * bk, 1)
            iq = 1.0 / tl.maximum(tl.sqrt(sq), _L2_EPS)
            ik = 1.0 / tl.maximum(tl.sqrt(sk), _L2_EPS)
        else:
            iq = tl.full([BT], 1.0, dtype=tl.float32)
            ik = tl.full([BT], 1.0, dtype=tl.float32)
        tl.store(rq + row, iq, mask=valid)
        tl.store(rk + row, ik, mask=valid)


@triton.jit
def _fwd_intra_kernel(
    q, k, beta_raw, G, rq, rk, Aqk, Akk,
    chunk_start, chunk_len, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, P: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """One (chunk, head, 16-row strip b): rows of A_qk, and rows of A_kk with the strip's own diagonal block
    replaced by its inverse ``D_b = (I + A_kk[b, b])^-1`` (the inverse kernel assembles T from both).

    The reference row of the strip is its first row (see the module notes), so the strip is one product of
    row factors ``exp(G_i - G_r)`` and column factors ``exp(G_r - G_j)`` per K tile."""
    i_c, i_h, b = _chunk_program(BT // 16, H)
    t0 = tl.load(chunk_start + i_c).to(tl.int64)
    nv = tl.load(chunk_len + i_c)
    r = tl.arange(0, BT)
    o16 = tl.arange(0, 16)
    cols = (r < nv) & (r < b * 16 + 16)  # the columns strip b can see
    row = (t0 + r) * H + i_h  # token-major row index of (token, head)
    rb = b * 16 + o16
    vb = rb < nv
    rowb = (t0 + rb) * H + i_h
    ik = tl.load(rk + row, mask=cols, other=0.0)
    ikb = tl.load(rk + rowb, mask=vb, other=0.0)
    iqb = tl.load(rq + rowb, mask=vb, other=0.0)
    ref = (t0 + tl.minimum(b * 16, nv - 1)) * H + i_h
    # transposed strips, A^T[:, rows of b] = kc @ (row tile)^T: M = BT rows, so the product is a warp-group one
    acc_q = tl.full([BT, 16], 0.0, tl.float32)
    acc_k = tl.full([BT, 16], 0.0, tl.float32)
    for kk in tl.static_range(0, K, BK):
        c = kk + tl.arange(0, BK)
        cm = c < K
        m2 = cols[:, None] & cm[None, :]
        m2b = vb[:, None] & cm[None, :]
        Gr = tl.load(G + ref * K + c, mask=cm, other=0.0)
        kf = tl.load(k + row[:, None] * K + c[None, :], mask=m2, other=0.0).to(tl.float32) * ik[:, None]
        Gf = tl.load(G + row[:, None] * K + c[None, :], mask=m2, other=0.0)
        kc = kf * tl.exp(tl.where(m2, Gr[None, :] - Gf, float("-inf")))
        offb = rowb[:, None] * K + c[None, :]
        Gb = tl.load(G + offb, mask=m2b, other=0.0)
        er = tl.exp(tl.where(m2b, Gb - Gr[None, :], float("-inf")))
        kbf = tl.load(k + offb, mask=m2b, other=0.0).to(tl.float32) * ikb[:, None]
        qb = tl.load(q + offb, mask=m2b, other=0.0).to(tl.float32) * (iqb[:, None] * er)
        kb = kbf * er
        acc_q += _dot(kc, tl.trans(qb), P, EMU)
        acc_k += _dot(kc, tl.trans(kb), P, EMU)
    betab = _load_beta(beta_raw, rowb, vb, BETA_SIGMOID)
    offA = rowb[None, :] * BT + r[:, None]  # [BT, 16]: (j, i) -> A[i, j]
    a_q = tl.where(vb[None, :] & (r[:, None] <= rb[None, :]), acc_q * scale, 0.0)
    tl.store(Aqk + offA, _out(a_q, Aqk, EMU), mask=vb[None, :])
    a_k = tl.where(vb[None, :] & (r[:, None] < b * 16), acc_k * betab[None, :], 0.0)
    outside = (r < b * 16) | (r >= b * 16 + 16)
    tl.store(Akk + offA, a_k, mask=vb[None, :] & outside[:, None])
    # the diagonal block as a [16, 16] tile (Triton cannot slice): an exact selection product
    pick = (b * 16 + o16[:, None] == r[None, :]).to(tl.float32)
    acc_d = tl.trans(tl.dot(pick, acc_k, input_precision="ieee"))
    Ad = tl.where(vb[:, None] & (o16[None, :] < o16[:, None]), acc_d * betab[:, None], 0.0)
    tl.store(Akk + rowb[:, None] * BT + b * 16 + o16[None, :], _unit_lower_inverse16(Ad), mask=vb[:, None])


@triton.jit
def _fwd_inverse_kernel(
    Akk, Tout, chunk_start, chunk_len,
    H: tl.constexpr, BT: tl.constexpr, P: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """One (chunk, head): T = (I + A_kk)^-1 from the strip kernel's output X, written to ``Tout``: over X when a
    backward follows (fp32), to a bf16 buffer of its own otherwise (the WY products' operand).

    X holds the inverted diagonal blocks D and the strictly block-lower part L of A_kk:
    I + A = (I + A_diag)(I + D L), and M = D L is block-nilpotent (M^4 = 0 for four 16-row blocks), so
    T = (I + M)^-1 D = (I - M)(I + M^2) D: four chunk-sized products, no sequential block sweep. A kernel
    of its own so that the WY kernel, which applies T to every K and V tile, can run one program per tile."""
    i_c, i_h, _ = _chunk_program(1, H)
    t0 = tl.load(chunk_start + i_c).to(tl.int64)
    nv = tl.load(chunk_len + i_c)
    r = tl.arange(0, BT)
    valid = r < nv
    offT = ((t0 + r) * H + i_h)[:, None] * BT + r[None, :]
    X = tl.load(Akk + offT, mask=valid[:, None] & valid[None, :], other=0.0)
    blk = r // 16
    D = tl.where(blk[:, None] == blk[None, :], X, 0.0)
    M = _dot(D, tl.where(blk[:, None] > blk[None, :], X, 0.0), P, EMU)
    Y = (r[:, None] == r[None, :]).to(tl.float32) + _dot(M, M, P, EMU)
    Tm = _dot(Y - _dot(M, Y, P, EMU), D, P, EMU)
    tl.debug_barrier()  # every thread has read its part of X (Tout may be Akk)
    tl.store(Tout + offT, _out(Tm, Tout, EMU), mask=valid[:, None])


@_helper
def _sub_tile(G, t0, nv, i_h, s, c, cm, H: tl.constexpr, K: tl.constexpr):
    """Sub-chunk ``s`` on the K columns ``c``: ``(off, m2, rows, vs, G - G_r, G_r)``, the tile's offsets and mask,
    its token-major rows and their validity, and its gates against its first row ``r``."""
    rs = s * 16 + tl.arange(0, 16)
    vs = rs < nv
    rows = (t0 + rs) * H + i_h
    m2 = vs[:, None] & cm[None, :]
    off = rows[:, None] * K + c[None, :]
    Gr = tl.load(G + ((t0 + tl.minimum(s * 16, nv - 1)) * H + i_h) * K + c, mask=cm, other=0.0)
    return off, m2, rows, vs, tl.load(G + off, mask=m2, other=0.0) - Gr[None, :], Gr


@_helper
def _sub_rows(q, k, G, rq, rk, t0, nv, i_h, s, c, cm, H: tl.constexpr, K: tl.constexpr):
    """Rows of sub-chunk ``s`` on the K columns ``c`` against its first row ``r``: ``(q exp(G - G_r),
    k exp(G - G_r), G_r)``, factors <= 1, the norms applied, zero outside the sequence."""
    off, m2, rows, vs, d, Gr = _sub_tile(G, t0, nv, i_h, s, c, cm, H=H, K=K)
    er = tl.exp(tl.where(m2, d, float("-inf")))
    kf = tl.load(k + off, mask=m2, other=0.0).to(tl.float32) * (tl.load(rk + rows, mask=vs, other=0.0)[:, None] * er)
    qf = tl.load(q + off, mask=m2, other=0.0).to(tl.float32) * (tl.load(rq + rows, mask=vs, other=0.0)[:, None] * er)
    return qf, kf, Gr


@_helper
def _sub_columns(k, G, rk, t0, nv, i_h, s, c, cm, H: tl.constexpr, K: tl.constexpr):
    """Columns of sub-chunk ``s`` against its first row ``r``: ``(k exp(G_r - G))^T``, factors <= exp(15
    |lower_bound|), ready as the right operand of a product."""
    off, m2, rows, vs, d, _ = _sub_tile(G, t0, nv, i_h, s, c, cm, H=H, K=K)
    ec = tl.exp(tl.where(m2, -d, float("-inf")))
    kf = tl.load(k + off, mask=m2, other=0.0).to(tl.float32) * (tl.load(rk + rows, mask=vs, other=0.0)[:, None] * ec)
    return tl.trans(kf)


@_helper
def _sub_tiles(q, k, G, rq, rk, t0, nv, i_h, s, c, cm, H: tl.constexpr, K: tl.constexpr):
    """Both sides of sub-chunk ``s`` from one read of its tiles: ``(q exp(G - G_r), k exp(G - G_r),
    (k exp(G_r - G))^T)``, as ``_sub_rows`` and ``_sub_columns`` give them (the diagonal block needs both)."""
    off, m2, rows, vs, d, _ = _sub_tile(G, t0, nv, i_h, s, c, cm, H=H, K=K)
    er = tl.exp(tl.where(m2, d, float("-inf")))
    kf = tl.load(k + off, mask=m2, other=0.0).to(tl.float32) * tl.load(rk + rows, mask=vs, other=0.0)[:, None]
    qf = tl.load(q + off, mask=m2, other=0.0).to(tl.float32) * (tl.load(rq + rows, mask=vs, other=0.0)[:, None] * er)
    return qf, kf * er, tl.trans(kf * tl.exp(tl.where(m2, -d, float("-inf"))))


@_helper
def _block_pair(qs, ks, kct, Gr_row, Gr_col, aq, ak, P: tl.constexpr, EMU: tl.constexpr):
    """Adds one K tile's part of ``A_qk[b, c]`` and ``A_kk[b, c]`` (c < b) to ``aq``, ``ak``: the rows of sub-chunk
    ``b`` and the columns of sub-chunk ``c``, each factored against its own first row, meet through
    ``exp(G_ref_b - G_ref_c)`` (<= 1, one factor per K column)."""
    dec = tl.exp(Gr_row - Gr_col)[None, :]
    return aq + _dot(qs * dec, kct, P, EMU), ak + _dot(ks * dec, kct, P, EMU)


@_helper
def _store_block(ptr, x, t0, nv, i_h, b, c, H: tl.constexpr, BT: tl.constexpr, EMU: tl.constexpr):
    """Block ``(b, c)`` (16 x 16) of a ``[tokens, H, BT]`` chunk matrix; rows outside the sequence left alone."""
    o = tl.arange(0, 16)
    rs = b * 16 + o
    tl.store(ptr + ((t0 + rs) * H + i_h)[:, None] * BT + (c * 16 + o)[None, :], _out(x, ptr, EMU),
             mask=(rs < nv)[:, None])


@_helper
def _load_diag_inverse(Dinv, t0, nv, i_h, b, H: tl.constexpr):
    """``D_b`` of sub-chunk ``b`` from the diagonal kernel's ``[tokens, H, 16]`` output (zero rows outside the
    sequence)."""
    o = tl.arange(0, 16)
    rs = b * 16 + o
    return tl.load(Dinv + ((t0 + rs) * H + i_h)[:, None] * 16 + o[None, :], mask=(rs < nv)[:, None], other=0.0)


@triton.jit
def _fwd_diag_kernel(
    q, k, beta_raw, G, rq, rk, Aqk, Dinv,
    chunk_start, chunk_len, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, P: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """One (chunk, head, sub-chunk b): row ``b`` of ``A_qk`` from its diagonal block on (zeros right of it),
    and ``D_b = (I + A_kk[b, b])^-1`` to ``Dinv`` (``[tokens, H, 16]``). Rows and columns share one reference,
    the sub-chunk's first row, so each tile of ``q``, ``k`` and ``G`` is read once for both sides."""
    i_c, i_h, b = _chunk_program(BT // 16, H)
    t0 = tl.load(chunk_start + i_c).to(tl.int64)
    nv = tl.load(chunk_len + i_c)
    o = tl.arange(0, 16)
    rs = b * 16 + o
    vs = rs < nv
    rows = (t0 + rs) * H + i_h
    aq = tl.full([16, 16], 0.0, tl.float32)
    ak = tl.full([16, 16], 0.0, tl.float32)
    for kk in range(0, K, BK):
        c = kk + tl.arange(0, BK)
        qs, ks, kct = _sub_tiles(q, k, G, rq, rk, t0, nv, i_h, b, c, c < K, H=H, K=K)
        aq += _dot(qs, kct, P, EMU)
        ak += _dot(ks, kct, P, EMU)
    beta = _load_beta(beta_raw, rows, vs, BETA_SIGMOID)
    # the diagonal block, then the zeros right of it (Triton cannot place a tile at a runtime column offset
    # other than through its pointers, so the two are separate stores)
    tl.store(Aqk + rows[:, None] * BT + (b * 16 + o)[None, :],
             _out(tl.where(o[None, :] <= o[:, None], aq * scale, 0.0), Aqk, EMU), mask=vs[:, None])
    r = tl.arange(0, BT)
    tl.store(Aqk + rows[:, None] * BT + r[None, :], tl.zeros([16, BT], Aqk.dtype.element_ty),
             mask=vs[:, None] & (r >= b * 16 + 16)[None, :])
    a_k = tl.where(vs[:, None] & (o[None, :] < o[:, None]), ak * beta[:, None], 0.0)
    tl.store(Dinv + rows[:, None] * 16 + o[None, :], _unit_lower_inverse16(a_k), mask=vs[:, None])


@triton.jit
def _fwd_solve_kernel(
    q, k, beta_raw, G, rq, rk, Aqk, Dinv, Tout,
    chunk_start, chunk_len, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, P: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """One (chunk, head): the blocks below the diagonal of ``A_qk`` and ``A_kk``, all in one loop over K tiles,
    then ``T = (I + A_kk)^-1`` by block forward substitution from the diagonal inverses ``D_b``:
    ``T[b, b] = D_b``, ``T[b, c] = -D_b sum_{c <= m < b} A_kk[b, m] T[m, c]``. ``A_kk`` never leaves the
    program, and the zero blocks above the diagonal are written, never computed."""
    NC: tl.constexpr = BT // 16
    i_c, i_h, _ = _chunk_program(1, H)
    t0 = tl.load(chunk_start + i_c).to(tl.int64)
    nv = tl.load(chunk_len + i_c)
    # int32 offsets from per-(chunk, head) base pointers (an int64 offset tile holds two registers per element):
    # the helpers below then see the chunk's first token as token 0 of head 0
    row0 = t0 * H + i_h
    q, k, G, rq, rk, beta_raw = q + row0 * K, k + row0 * K, G + row0 * K, rq + row0, rk + row0, beta_raw + row0
    Aqk, Dinv, Tout = Aqk + row0 * BT, Dinv + row0 * 16, Tout + row0 * BT
    t0, i_h = 0, 0
    z = tl.full([16, 16], 0.0, tl.float32)
    aq10, ak10, aq20, ak20, aq21, ak21 = z, z, z, z, z, z
    aq30, ak30, aq31, ak31, aq32, ak32 = z, z, z, z, z, z
    if NC >= 2:
        for kk in range(0, K, BK):
            c = kk + tl.arange(0, BK)
            cm = c < K
            # each sub-chunk's columns are formed right before the first rows that need them: reading sub-chunks
            # 1 and 2 once for both sides (as _sub_tiles does) holds more tiles at once and spilled more
            # registers, which cost more than the second read saved (docs/BENCHMARKS.md, twentieth pass);
            # sub-chunk 0's reference is the chunk's first row, always inside the sequence
            G0 = tl.load(G + (t0 * H + i_h) * K + c, mask=cm, other=0.0)
            kc0 = _sub_columns(k, G, rk, t0, nv, i_h, 0, c, cm, H=H, K=K)
            qs, ks, G1 = _sub_rows(q, k, G, rq, rk, t0, nv, i_h, 1, c, cm, H=H, K=K)
            aq10, ak10 = _block_pair(qs, ks, kc0, G1, G0, aq10, ak10, P=P, EMU=EMU)
            if NC >= 4:
                kc1 = _sub_columns(k, G, rk, t0, nv, i_h, 1, c, cm, H=H, K=K)
                qs, ks, G2 = _sub_rows(q, k, G, rq, rk, t0, nv, i_h, 2, c, cm, H=H, K=K)
                aq20, ak20 = _block_pair(qs, ks, kc0, G2, G0, aq20, ak20, P=P, EMU=EMU)
                aq21, ak21 = _block_pair(qs, ks, kc1, G2, G1, aq21, ak21, P=P, EMU=EMU)
                kc2 = _sub_columns(k, G, rk, t0, nv, i_h, 2, c, cm, H=H, K=K)
                qs, ks, G3 = _sub_rows(q, k, G, rq, rk, t0, nv, i_h, 3, c, cm, H=H, K=K)
                aq30, ak30 = _block_pair(qs, ks, kc0, G3, G0, aq30, ak30, P=P, EMU=EMU)
                aq31, ak31 = _block_pair(qs, ks, kc1, G3, G1, aq31, ak31, P=P, EMU=EMU)
                aq32, ak32 = _block_pair(qs, ks, kc2, G3, G2, aq32, ak32, P=P, EMU=EMU)
    for rb in tl.static_range(NC):
        for cb in tl.static_range(rb + 1, NC):
            _store_block(Tout, z, t0, nv, i_h, rb, cb, H=H, BT=BT, EMU=EMU)
    D0 = _load_diag_inverse(Dinv, t0, nv, i_h, 0, H=H)
    _store_block(Tout, D0, t0, nv, i_h, 0, 0, H=H, BT=BT, EMU=EMU)
    if NC >= 2:
        o = tl.arange(0, 16)
        beta = _load_beta(beta_raw, (t0 + 16 + o) * H + i_h, 16 + o < nv, BETA_SIGMOID)[:, None]
        _store_block(Aqk, aq10 * scale, t0, nv, i_h, 1, 0, H=H, BT=BT, EMU=EMU)
        D1 = _load_diag_inverse(Dinv, t0, nv, i_h, 1, H=H)
        T10 = -_dot(D1, _dot(ak10 * beta, D0, P, EMU), P, EMU)
        _store_block(Tout, D1, t0, nv, i_h, 1, 1, H=H, BT=BT, EMU=EMU)
        _store_block(Tout, T10, t0, nv, i_h, 1, 0, H=H, BT=BT, EMU=EMU)
        if NC >= 4:
            beta = _load_beta(beta_raw, (t0 + 32 + o) * H + i_h, 32 + o < nv, BETA_SIGMOID)[:, None]
            _store_block(Aqk, aq20 * scale, t0, nv, i_h, 2, 0, H=H, BT=BT, EMU=EMU)
            _store_block(Aqk, aq21 * scale, t0, nv, i_h, 2, 1, H=H, BT=BT, EMU=EMU)
            D2 = _load_diag_inverse(Dinv, t0, nv, i_h, 2, H=H)
            A21 = ak21 * beta
            T21 = -_dot(D2, _dot(A21, D1, P, EMU), P, EMU)
            T20 = -_dot(D2, _dot(ak20 * beta, D0, P, EMU) + _dot(A21, T10, P, EMU), P, EMU)
            _store_block(Tout, D2, t0, nv, i_h, 2, 2, H=H, BT=BT, EMU=EMU)
            _store_block(Tout, T21, t0, nv, i_h, 2, 1, H=H, BT=BT, EMU=EMU)
            _store_block(Tout, T20, t0, nv, i_h, 2, 0, H=H, BT=BT, EMU=EMU)
            beta = _load_beta(beta_raw, (t0 + 48 + o) * H + i_h, 48 + o < nv, BETA_SIGMOID)[:, None]
            _store_block(Aqk, aq30 * scale, t0, nv, i_h, 3, 0, H=H, BT=BT, EMU=EMU)
            _store_block(Aqk, aq31 * scale, t0, nv, i_h, 3, 1, H=H, BT=BT, EMU=EMU)
            _store_block(Aqk, aq32 * scale, t0, nv, i_h, 3, 2, H=H, BT=BT, EMU=EMU)
            D3 = _load_diag_inverse(Dinv, t0, nv, i_h, 3, H=H)
            A31 = ak31 * beta
            A32 = ak32 * beta
            T32 = -_dot(D3, _dot(A32, D2, P, EMU), P, EMU)
            T31 = -_dot(D3, _dot(A31, D1, P, EMU) + _dot(A32, T21, P, EMU), P, EMU)
            T30 = _dot(ak30 * beta, D0, P, EMU) + _dot(A31, T10, P, EMU) + _dot(A32, T20, P, EMU)
            T30 = -_dot(D3, T30, P, EMU)
            _store_block(Tout, D3, t0, nv, i_h, 3, 3, H=H, BT=BT, EMU=EMU)
            _store_block(Tout, T32, t0, nv, i_h, 3, 2, H=H, BT=BT, EMU=EMU)
            _store_block(Tout, T31, t0, nv, i_h, 3, 1, H=H, BT=BT, EMU=EMU)
            _store_block(Tout, T30, t0, nv, i_h, 3, 0, H=H, BT=BT, EMU=EMU)


@triton.jit
def _fwd_wy_kernel(
    q, k, v, beta_raw, G, rq, rk, Tkk, w, u, qg, kd, gl,
    chunk_start, chunk_len, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, P: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """One (chunk, head, K or V tile): ``w = T (beta k exp(G))`` and the operands of the state and output
    kernels, ``qg = scale q exp(G)`` and ``kd = k exp(G_last - G)``, on a K tile; ``u = T (beta v)`` on a
    V tile. The tiles of one (chunk, head) are neighbours on the grid and share T through L2."""
    NKT: tl.constexpr = (K + BK - 1) // BK
    i_c, i_h, part = _chunk_program(NKT + (V + BV - 1) // BV, H)
    t0 = tl.load(chunk_start + i_c).to(tl.int64)
    nv = tl.load(chunk_len + i_c)
    r = tl.arange(0, BT)
    valid = r < nv
    row = (t0 + r) * H + i_h  # token-major row index of (token, head)
    beta_f = _load_beta(beta_raw, row, valid, BETA_SIGMOID)
    Tm = tl.load(Tkk + row[:, None] * BT + r[None, :], mask=valid[:, None], other=0.0)
    if part < NKT:
        c = part * BK + tl.arange(0, BK)
        cm = c < K
        m2 = valid[:, None] & cm[None, :]
        off = row[:, None] * K + c[None, :]
        ik = tl.load(rk + row, mask=valid, other=0.0)
        kf = tl.load(k + off, mask=m2, other=0.0).to(tl.float32) * ik[:, None]
        Gf = tl.load(G + off, mask=m2, other=0.0)
        Gl = tl.load(gl + (i_c.to(tl.int64) * H + i_h) * K + c, mask=cm, other=0.0)
        eg = tl.exp(tl.where(m2, Gf, float("-inf")))
        tl.store(w + off, _out(_dot(Tm, beta_f[:, None] * kf * eg, P, EMU), w, EMU), mask=m2)
        tl.store(kd + off, _out(kf * tl.exp(tl.where(m2, Gl[None, :] - Gf, float("-inf"))), kd, EMU), mask=m2)
        iq = tl.load(rq + row, mask=valid, other=0.0)
        qf = tl.load(q + off, mask=m2, other=0.0).to(tl.float32) * (iq * scale)[:, None]
        tl.store(qg + off, _out(qf * eg, qg, EMU), mask=m2)
    else:
        # names of their own: Triton needs a name bound in both branches to have one type, and the K and
        # V tiles differ in shape when block_k != block_v
        cv = (part - NKT) * BV + tl.arange(0, BV)
        m2v = valid[:, None] & (cv < V)[None, :]
        offv = row[:, None] * V + cv[None, :]
        x = tl.load(v + offv, mask=m2v, other=0.0).to(tl.float32) * beta_f[:, None]
        tl.store(u + offv, _out(_dot(Tm, x, P, EMU), u, EMU), mask=m2v)


@triton.jit
def _fwd_state_kernel(
    kd, gl, w, u, h0, h_out, h_unit, v_new, ht, qg, Aqk, o,
    seq_start, seq_len, seq_chunk0,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, SAVE_H: tl.constexpr, SAVE_V_NEW: tl.constexpr, OUT: tl.constexpr,
    STORE_FINAL: tl.constexpr, P: tl.constexpr, F16: tl.constexpr, H16: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """One (sequence x head, V tile): S -> exp(G_last) S + kd^T (u - w S), chunk by chunk; with ``OUT`` also
    the chunk's output O = qg S + A_qk v_new from the state before the chunk.

    Every per-token factor (norms, decays, the scale) is already folded into ``w``, ``kd`` and ``qg`` by the
    WY kernel, so the sequential loop reads a few tiles and one row per chunk. The output's two products
    do not feed the recurrence, so they overlap with the next chunk's loads instead of lengthening the
    sequential chain; the states and ``v_new`` are written only where they are wanted (``SAVE_H``,
    ``SAVE_V_NEW``).

    ``F16`` (fp16 ``w`` and ``kd``, tf32 products asked for, no output): the two products take fp16 operands,
    ``S`` and ``v_new`` scaled per column (``_f16_columns``), instead of converting the fp16 tiles for tf32
    products: the same 11 significant bits, none of the conversions, and Hopper reads fp16 operands of either
    layout from shared memory, where tf32 ones must be transposed first (the backward's recomputation at
    2·8192·32·128 on an H200: 0.608 -> 0.495 ms). Not used with ``OUT``: the scaled products made the fused
    output kernel need 135 KB of shared memory (one program per SM) and took it from 0.42 to 0.86 ms.

    ``H16`` (with ``F16`` and ``SAVE_H``): the states are written as that same fp16 ``S16`` with its per-column
    factor in ``h_unit`` (``[chunks, H, V]``), half the bytes of fp32 states for the same values the products
    use (see ``ChunkKDAConfig.f16_states``)."""
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    n = i_nh // H
    i_h = i_nh % H
    s0 = tl.load(seq_start + n).to(tl.int64)
    L = tl.load(seq_len + n)
    c0 = tl.load(seq_chunk0 + n).to(tl.int64)
    r = tl.arange(0, BT)
    kc = tl.arange(0, KP)
    km = kc < K
    vc = i_v * BV + tl.arange(0, BV)
    vm = vc < V
    hm = km[:, None] & vm[None, :]
    hoff = kc[:, None] * V + vc[None, :]
    seq_state = (n.to(tl.int64) * H + i_h) * K * V  # int64: sequences x H x K x V can pass 2^31
    if HAS_H0:
        S = tl.load(h0 + seq_state + hoff, mask=hm, other=0.0).to(tl.float32)
    else:
        S = tl.full([KP, BV], 0.0, tl.float32)
    for ci in range(0, (L + BT - 1) // BT):
        t0 = s0 + ci * BT
        valid = r < L - ci * BT
        row = (t0 + r) * H + i_h  # token-major row index of (token, head)
        if F16:
            S16, S_unit = _f16_columns(S)
        if SAVE_H:
            if H16:
                tl.store(h_out + ((c0 + ci) * H + i_h) * K * V + hoff, S16, mask=hm)
                tl.store(h_unit + ((c0 + ci) * H + i_h) * V + vc, S_unit, mask=vm)
            else:
                tl.store(h_out + ((c0 + ci) * H + i_h) * K * V + hoff, _out(S, h_out, EMU), mask=hm)
        m2k = valid[:, None] & km[None, :]
        m2v = valid[:, None] & vm[None, :]
        offk = row[:, None] * K + kc[None, :]
        offv = row[:, None] * V + vc[None, :]
        wt = tl.load(w + offk, mask=m2k, other=0.0)
        if F16:
            vn = tl.load(u + offv, mask=m2v, other=0.0).to(tl.float32) - _dot16(wt, S16, EMU) * S_unit[None, :]
        else:
            vn = tl.load(u + offv, mask=m2v, other=0.0).to(tl.float32) - _dot(wt, S, P, EMU)
        if SAVE_V_NEW:
            tl.store(v_new + offv, _out(vn, v_new, EMU), mask=m2v)
        if OUT:  # the output of the chunk from the state before it: O = qg S + A_qk v_new
            acc = _dot(tl.load(qg + offk, mask=m2k, other=0.0), S, P, EMU)
            Aq = tl.load(Aqk + row[:, None] * BT + r[None, :], mask=valid[:, None], other=0.0)
            acc += _dot(Aq, vn, P, EMU)
            tl.store(o + offv, _out(acc, o, EMU), mask=m2v)
        kdt = tl.load(kd + offk, mask=m2k, other=0.0)
        Gl = tl.load(gl + ((c0 + ci) * H + i_h) * K + kc, mask=km, other=0.0)
        if F16:
            vn16, vn_unit = _f16_columns(vn)
            S = S * tl.exp(Gl)[:, None] + _dot16(tl.trans(kdt), vn16, EMU) * vn_unit[None, :]
        else:
            S = S * tl.exp(Gl)[:, None] + _dot(tl.trans(kdt), vn, P, EMU)
    if STORE_FINAL:
        tl.store(ht + seq_state + hoff, S, mask=hm)


# =============================================================================================== backward


@triton.jit
def _bwd_dav_kernel(
    v_new, do, dAq,
    chunk_start, chunk_len,
    H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    P: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """One (chunk, head): dA_qk = dO v_new^T (masked j <= i). The other product of this pair, the
    intra-chunk ``A_qk^T dO`` of dv_new, is formed in the backward state kernel, which loads dO anyway."""
    i_c, i_h, _ = _chunk_program(1, H)
    t0 = tl.load(chunk_start + i_c).to(tl.int64)
    nv = tl.load(chunk_len + i_c)
    r = tl.arange(0, BT)
    cc = tl.arange(0, BT)
    valid = r < nv
    tok = t0 + r
    row = tok * H + i_h  # token-major row index of (token, head)
    offA = row[:, None] * BT + cc[None, :]
    dA = tl.full([BT, BT], 0.0, tl.float32)
    for vv in tl.static_range(0, V, BV):
        c = vv + tl.arange(0, BV)
        m2 = valid[:, None] & (c < V)[None, :]
        off = row[:, None] * V + c[None, :]
        dot_ = tl.load(do + off, mask=m2, other=0.0).to(tl.float32)
        vn = tl.load(v_new + off, mask=m2, other=0.0)
        dA += _dot(dot_, tl.trans(vn), P, EMU)
    dA = tl.where(valid[:, None] & (cc[None, :] <= r[:, None]), dA, 0.0)
    tl.store(dAq + offA, dA, mask=valid[:, None])


@triton.jit
def _bwd_state_kernel(
    qg, kd, gl, w, Aqk, do, dht, dh_out, dh_unit, dvn, dh0,
    seq_start, seq_len, seq_chunk0,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, KP: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, P: tl.constexpr, F16: tl.constexpr, H16: tl.constexpr,
    EMU: tl.constexpr,
):  # fmt: skip
    """One (sequence x head, V tile), chunks in reverse: dS (grad of the state after each chunk) and dv_new.

    dv_new = A_qk^T dO + kd dS;  dS <- exp(G_last) dS + qg^T dO - w^T dv_new, with the forward's ``qg`` and
    ``kd`` (every per-token factor folded in), so the loop does no elementwise work but the decay.

    ``F16`` (fp16 ``A_qk``, ``qg``, ``kd`` and ``w``, tf32 products asked for): as in the forward's state kernel,
    the four products take fp16 operands, ``dO``, ``dS`` and ``dv_new`` scaled per column (``_f16_columns``):
    the 11 significant bits of tf32 without converting the fp16 tiles to fp32 for every product. ``H16`` (with
    ``F16``): each ``dS`` is written as that fp16 ``dS16`` with its per-column factor in ``dh_unit``."""
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    n = i_nh // H
    i_h = i_nh % H
    s0 = tl.load(seq_start + n).to(tl.int64)
    L = tl.load(seq_len + n)
    c0 = tl.load(seq_chunk0 + n).to(tl.int64)
    r = tl.arange(0, BT)
    kc = tl.arange(0, KP)
    km = kc < K
    vc = i_v * BV + tl.arange(0, BV)
    vm = vc < V
    hm = km[:, None] & vm[None, :]
    hoff = kc[:, None] * V + vc[None, :]
    seq_state = (n.to(tl.int64) * H + i_h) * K * V  # int64: sequences x H x K x V can pass 2^31
    if HAS_DHT:
        dS = tl.load(dht + seq_state + hoff, mask=hm, other=0.0).to(tl.float32)
    else:
        dS = tl.full([KP, BV], 0.0, tl.float32)
    nch = (L + BT - 1) // BT
    for cj in range(0, nch):
        ci = nch - 1 - cj
        valid = r < L - ci * BT
        row = (s0 + ci * BT + r) * H + i_h  # token-major row index of (token, head)
        if F16:
            dS16, dS_unit = _f16_columns(dS)
        if H16:
            tl.store(dh_out + ((c0 + ci) * H + i_h) * K * V + hoff, dS16, mask=hm)
            tl.store(dh_unit + ((c0 + ci) * H + i_h) * V + vc, dS_unit, mask=vm)
        else:
            tl.store(dh_out + ((c0 + ci) * H + i_h) * K * V + hoff, dS, mask=hm)
        m2k = valid[:, None] & km[None, :]
        m2v = valid[:, None] & vm[None, :]
        offk = row[:, None] * K + kc[None, :]
        offv = row[:, None] * V + vc[None, :]
        kdt = tl.load(kd + offk, mask=m2k, other=0.0)
        dot_ = tl.load(do + offv, mask=m2v, other=0.0).to(tl.float32)
        AqT = tl.trans(tl.load(Aqk + row[:, None] * BT + r[None, :], mask=valid[:, None], other=0.0))
        if F16:
            do16, do_unit = _f16_columns(dot_)
            dv_ = _dot16(AqT, do16, EMU) * do_unit[None, :] + _dot16(kdt, dS16, EMU) * dS_unit[None, :]
        else:
            dv_ = _dot(AqT, dot_, P, EMU) + _dot(kdt, dS, P, EMU)
        tl.store(dvn + offv, dv_, mask=m2v)
        qgt = tl.load(qg + offk, mask=m2k, other=0.0)
        wt = tl.load(w + offk, mask=m2k, other=0.0)
        Gl = tl.load(gl + ((c0 + ci) * H + i_h) * K + kc, mask=km, other=0.0)
        if F16:
            dv16, dv_unit = _f16_columns(dv_)
            dS = (dS * tl.exp(Gl)[:, None] + _dot16(tl.trans(qgt), do16, EMU) * do_unit[None, :]
                  - _dot16(tl.trans(wt), dv16, EMU) * dv_unit[None, :])
        else:
            dS = dS * tl.exp(Gl)[:, None] + _dot(tl.trans(qgt), dot_, P, EMU) - _dot(tl.trans(wt), dv_, P, EMU)
    if STORE_DH0:
        tl.store(dh0 + seq_state + hoff, dS, mask=hm)


@triton.jit
def _bwd_wy_v_kernel(
    v, beta_raw, Tkk, u, dvn, dv, dAk_part, dbeta_wy,
    chunk_start, chunk_len,
    H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, P: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """One (chunk, head): gradients through u = T (beta v): dv = beta T^T du, the v share of dbeta, and
    du u^T, the first term of dA_kk = -T^T (du u^T + dw w^T) (slot 0 of ``dAk_part``)."""
    i_c, i_h, _ = _chunk_program(1, H)
    t0 = tl.load(chunk_start + i_c).to(tl.int64)
    nv = tl.load(chunk_len + i_c)
    r = tl.arange(0, BT)
    valid = r < nv
    row = (t0 + r) * H + i_h  # token-major row index of (token, head)
    offT = row[:, None] * BT + r[None, :]
    TmT = tl.trans(tl.load(Tkk + offT, mask=valid[:, None], other=0.0))
    beta_f = _load_beta(beta_raw, row, valid, BETA_SIGMOID)
    acc = tl.full([BT, BT], 0.0, tl.float32)
    dbeta = tl.full([BT], 0.0, tl.float32)
    for vv in tl.static_range(0, V, BV):
        c = vv + tl.arange(0, BV)
        m2 = valid[:, None] & (c < V)[None, :]
        off = row[:, None] * V + c[None, :]
        du = tl.load(dvn + off, mask=m2, other=0.0)
        x = _dot(TmT, du, P, EMU)
        tl.store(dv + off, _out(beta_f[:, None] * x, dv, EMU), mask=m2)
        dbeta += _sum(tl.load(v + off, mask=m2, other=0.0).to(tl.float32) * x, 1)
        acc += _dot(du, tl.trans(tl.load(u + off, mask=m2, other=0.0)), P, EMU)
    tl.store(dAk_part + offT, acc, mask=valid[:, None])
    tl.store(dbeta_wy + row, dbeta, mask=valid)


@triton.jit
def _bwd_wy_k_kernel(
    q, k, beta_raw, G, rq, rk, Tkk, w, v_new, dvn, h, h_unit, dh, dh_unit, do,
    dqh, dkh, dGh, dAk_part, dAk, dbeta_part,
    chunk_start, chunk_len, n_tok, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr, SLOT0: tl.constexpr,
    H16: tl.constexpr, DH16: tl.constexpr, BETA_SIGMOID: tl.constexpr, P: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """One (chunk, head, K tile): gradients through the inter-chunk terms and w = T (beta k exp(G)).

    Writes this tile's inter-chunk parts of dq, dk, dG, its share of dbeta (slot ``SLOT0 + i_k`` of
    ``dbeta_part``) and dw w^T (slot ``1 + i_k`` of ``dAk_part``). By default the K tile is the whole K
    (``ChunkKDAConfig.bwd_block_k``), so the V-side tiles are read once per (chunk, head), and then the
    program has the whole ``dw w^T``: it finishes ``dA_kk = -T^T (du u^T + dw w^T)`` itself (the ``dA_kk``
    kernel's work, with ``du u^T`` from slot 0) and writes it to ``dAk``. ``H16`` / ``DH16``: the states /
    their gradients come as fp16 tiles with one factor per column (the state kernels' ``H16``)."""
    i_c, i_h, i_k = _chunk_program(NK, H)
    t0 = tl.load(chunk_start + i_c).to(tl.int64)
    nv = tl.load(chunk_len + i_c)
    r = tl.arange(0, BT)
    valid = r < nv
    # int32 offsets within the chunk from per-(chunk, head) base pointers: an int64 offset tile holds two
    # registers per element
    row0 = t0 * H + i_h  # token-major row of (first token, head)
    q, k, G, w = q + row0 * K, k + row0 * K, G + row0 * K, w + row0 * K
    dqh, dkh, dGh = dqh + row0 * K, dkh + row0 * K, dGh + row0 * K
    v_new, dvn, do = v_new + row0 * V, dvn + row0 * V, do + row0 * V
    rq, rk, beta_raw, Tkk = rq + row0, rk + row0, beta_raw + row0, Tkk + row0 * BT
    row = r * H  # rows after the base
    c = i_k * BK + tl.arange(0, BK)
    cm = c < K
    m2k = valid[:, None] & cm[None, :]
    offk = row[:, None] * K + c[None, :]
    dqi = tl.full([BT, BK], 0.0, tl.float32)  # dO S^T
    dw = tl.full([BT, BK], 0.0, tl.float32)  # -dv_new S^T
    dkt = tl.full([BT, BK], 0.0, tl.float32)  # v_new dS'^T
    dgl = tl.full([BK], 0.0, tl.float32)  # sum_v S * dS'
    hbase = (i_c.to(tl.int64) * H + i_h) * K * V
    ubase = (i_c.to(tl.int64) * H + i_h) * V  # the column factors of the H16 / DH16 forms
    h, dh, h_unit, dh_unit = h + hbase, dh + hbase, h_unit + ubase, dh_unit + ubase
    # a runtime loop: unrolled (static_range), every V tile's loads were issued up front and the kernel spilled
    # 616 bytes per thread; as a loop it is 1.94 -> 1.64 ms at 2·8192·32·128 on an H200 (same tiles)
    for vv in range(0, V, BV):
        cv = vv + tl.arange(0, BV)
        vm = cv < V
        m2v = valid[:, None] & vm[None, :]
        offv = row[:, None] * V + cv[None, :]
        hoff = c[:, None] * V + cv[None, :]
        hm = cm[:, None] & vm[None, :]
        hs = tl.load(h + hoff, mask=hm, other=0.0).to(tl.float32)
        if H16:
            hs *= tl.load(h_unit + cv, mask=vm, other=0.0)[None, :]
        dhs = tl.load(dh + hoff, mask=hm, other=0.0).to(tl.float32)
        if DH16:
            dhs *= tl.load(dh_unit + cv, mask=vm, other=0.0)[None, :]
        dot_ = tl.load(do + offv, mask=m2v, other=0.0).to(tl.float32)
        dvt = tl.load(dvn + offv, mask=m2v, other=0.0)
        vnt = tl.load(v_new + offv, mask=m2v, other=0.0)
        hsT = tl.trans(hs)
        dqi += _dot(dot_, hsT, P, EMU)
        dw -= _dot(dvt, hsT, P, EMU)
        dkt += _dot(vnt, tl.trans(dhs), P, EMU)
        dgl += _sum(hs * dhs, 1)
    # w = T (beta k exp(G)): both products of dw before the epilogue's tiles are loaded, so that dw dies first
    offT = row[:, None] * BT + r[None, :]
    TmT = tl.trans(tl.load(Tkk + offT, mask=valid[:, None], other=0.0))
    x = _dot(TmT, dw, P, EMU)
    part = _dot(dw, tl.trans(tl.load(w + offk, mask=m2k, other=0.0)), P, EMU)
    if NK == 1:  # same sum and product as _bwd_dak_kernel
        part += tl.load(dAk_part + row0 * BT + offT, mask=valid[:, None], other=0.0)
        dA = -_dot(TmT, part, P, EMU)
        dA = tl.where(valid[:, None] & (r[None, :] < r[:, None]), dA, 0.0)
        tl.store(dAk + row0 * BT + offT, dA, mask=valid[:, None])
    else:
        tl.store(dAk_part + (1 + i_k) * n_tok * H * BT + row0 * BT + offT, part, mask=valid[:, None])
    Gt = tl.load(G + offk, mask=m2k, other=0.0)
    gam = tl.exp(tl.where(m2k, Gt, float("-inf")))
    dq_ = scale * gam * dqi
    tl.store(dqh + offk, dq_, mask=m2k)
    qt = tl.load(q + offk, mask=m2k, other=0.0).to(tl.float32) * tl.load(rq + row, mask=valid, other=0.0)[:, None]
    dG = qt * dq_
    # S' = exp(G_last) S + (k exp(G_last - G))^T v_new
    Gl = tl.load(G + (nv - 1) * H * K + c, mask=cm, other=0.0)
    dk_ = tl.exp(tl.where(m2k, Gl[None, :] - Gt, float("-inf"))) * dkt
    kt = tl.load(k + offk, mask=m2k, other=0.0).to(tl.float32) * tl.load(rk + row, mask=valid, other=0.0)[:, None]
    tt = kt * dk_
    dG -= tt
    dglt = _sum(tt, 0) + tl.exp(Gl) * dgl
    dG += tl.where((r == nv - 1)[:, None], dglt[None, :], 0.0)
    beta_f = _load_beta(beta_raw, row, valid, BETA_SIGMOID)
    gx = gam * x
    dk_ += beta_f[:, None] * gx
    kgx = kt * gx
    dG += beta_f[:, None] * kgx
    tl.store(dkh + offk, dk_, mask=m2k)
    tl.store(dGh + offk, dG, mask=m2k)
    tl.store(dbeta_part + (SLOT0 + i_k) * n_tok * H + row0 + row, _sum(kgx, 1), mask=valid)


@triton.jit
def _bwd_dak_kernel(
    Tkk, dAk_part, dAk, chunk_start, chunk_len, n_tok,
    H: tl.constexpr, BT: tl.constexpr, NPART: tl.constexpr, P: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """One (chunk, head): dA_kk = -T^T (du u^T + sum over K tiles of dw w^T), strictly lower."""
    i_c, i_h, _ = _chunk_program(1, H)
    t0 = tl.load(chunk_start + i_c).to(tl.int64)
    nv = tl.load(chunk_len + i_c)
    r = tl.arange(0, BT)
    valid = r < nv
    row = (t0 + r) * H + i_h  # token-major row index of (token, head)
    offT = row[:, None] * BT + r[None, :]
    acc = tl.full([BT, BT], 0.0, tl.float32)
    for s in tl.static_range(NPART):
        acc += tl.load(dAk_part + s * n_tok * H * BT + offT, mask=valid[:, None], other=0.0)
    dA = -_dot(tl.trans(tl.load(Tkk + offT, mask=valid[:, None], other=0.0)), acc, P, EMU)
    dA = tl.where(valid[:, None] & (r[None, :] < r[:, None]), dA, 0.0)
    tl.store(dAk + offT, dA, mask=valid[:, None])


@_helper
def _intra_grads(
    q, k, beta_raw, G, rq, rk, dAq, dAk, t0, nv, i_h, b, c, cm, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, P: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """The intra-chunk parts of ``(dq, dk, dG)`` (``[16, BK]`` tiles) and of ``dbeta`` (16 rows) of sub-chunk
    ``b`` on the K columns ``c``: gradients through A_qk and A_kk of the rows and the columns of sub-chunk b.

    Row side, A[i, j] with i in b: reference = b's first row, one ``[16, 16] x [16, BK]`` product per column
    block j <= b. Column side, A[i, j] with j in b: reference = b's last row, one product per row block i >= b.
    Both keep every exp() argument below 15 |lower_bound|, and each sub-chunk only visits the blocks it
    interacts with."""
    o16 = tl.arange(0, 16)
    rb = b * 16 + o16
    vb = rb < nv
    rowb = (t0 + rb) * H + i_h  # token-major row index of (token, head)
    m2b = vb[:, None] & cm[None, :]
    offb = rowb[:, None] * K + c[None, :]
    Gb = tl.load(G + offb, mask=m2b, other=0.0)
    qb = tl.load(q + offb, mask=m2b, other=0.0).to(tl.float32) * tl.load(rq + rowb, mask=vb, other=0.0)[:, None]
    kb = tl.load(k + offb, mask=m2b, other=0.0).to(tl.float32) * tl.load(rk + rowb, mask=vb, other=0.0)[:, None]
    betab = _load_beta(beta_raw, rowb, vb, BETA_SIGMOID)

    # row side: rows of b against the columns j <= i
    Gr = tl.load(G + ((t0 + tl.minimum(b * 16, nv - 1)) * H + i_h) * K + c, mask=cm, other=0.0)
    acc_q = tl.full([16, BK], 0.0, tl.float32)
    acc_k = tl.full([16, BK], 0.0, tl.float32)
    for jb in range(0, b + 1):
        rj = jb * 16 + o16
        vj = rj < nv
        rowj = (t0 + rj) * H + i_h
        m2j = vj[:, None] & cm[None, :]
        offj = rowj[:, None] * K + c[None, :]
        Gj = tl.load(G + offj, mask=m2j, other=0.0)
        kj = tl.load(k + offj, mask=m2j, other=0.0).to(tl.float32) * tl.load(rk + rowj, mask=vj, other=0.0)[:, None]
        xj = kj * tl.exp(tl.where(m2j, Gr[None, :] - Gj, float("-inf")))
        offA = rowb[:, None] * BT + rj[None, :]
        acc_q += _dot(tl.load(dAq + offA, mask=vb[:, None], other=0.0), xj, P, EMU)
        acc_k += _dot(tl.load(dAk + offA, mask=vb[:, None], other=0.0), xj, P, EMU)
    eb = tl.exp(tl.where(m2b, Gb - Gr[None, :], float("-inf")))
    dqb = (scale * eb) * acc_q
    yb = eb * acc_k
    dk_row = betab[:, None] * yb

    # column side: columns of b against the rows i >= j
    Gr1 = tl.load(G + ((t0 + tl.minimum(b * 16 + 15, nv - 1)) * H + i_h) * K + c, mask=cm, other=0.0)
    acc_c = tl.full([16, BK], 0.0, tl.float32)
    for ib in range(b, tl.cdiv(nv, 16)):
        ri = ib * 16 + o16
        vi = ri < nv
        rowi = (t0 + ri) * H + i_h
        m2i = vi[:, None] & cm[None, :]
        offi = rowi[:, None] * K + c[None, :]
        ez = tl.exp(tl.where(m2i, tl.load(G + offi, mask=m2i, other=0.0) - Gr1[None, :], float("-inf")))
        qi = tl.load(q + offi, mask=m2i, other=0.0).to(tl.float32) * tl.load(rq + rowi, mask=vi, other=0.0)[:, None]
        ki = tl.load(k + offi, mask=m2i, other=0.0).to(tl.float32) * tl.load(rk + rowi, mask=vi, other=0.0)[:, None]
        bi = _load_beta(beta_raw, rowi, vi, BETA_SIGMOID)
        offAT = rowi[None, :] * BT + rb[:, None]  # [16, 16]: (j, i) -> dA[i, j]
        mT = vb[:, None] & vi[None, :]
        acc_c += _dot(tl.load(dAq + offAT, mask=mT, other=0.0), (scale * qi) * ez, P, EMU)
        acc_c += _dot(tl.load(dAk + offAT, mask=mT, other=0.0), (bi[:, None] * ki) * ez, P, EMU)
    dk_col = tl.exp(tl.where(m2b, Gr1[None, :] - Gb, float("-inf"))) * acc_c
    return dqb, dk_row + dk_col, qb * dqb + kb * (dk_row - dk_col), _sum(kb * yb, 1)


@triton.jit
def _bwd_intra_kernel(
    q, k, beta_raw, G, rq, rk, dAq, dAk, dqh, dkh, dGh, dbeta_part,
    chunk_start, chunk_len, n_tok, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, P: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """One (chunk, head, 16-row sub-chunk b, K tile of ``NK``): the intra-chunk gradients (``_intra_grads``),
    added in place to the inter-chunk parts in dqh / dkh / dGh. Working on ``[16, BK]`` tiles keeps the kernel
    far from the register limit."""
    i_c, i_h, part = _chunk_program((BT // 16) * NK, H)
    b = part // NK
    i_k = part % NK
    t0 = tl.load(chunk_start + i_c).to(tl.int64)
    nv = tl.load(chunk_len + i_c)
    # int32 offsets from per-(chunk, head) base pointers: an int64 offset tile holds two registers per element.
    # _intra_grads then sees the chunk's first token as token 0 of head 0.
    row0 = t0 * H + i_h
    q, k, G, dqh, dkh, dGh = q + row0 * K, k + row0 * K, G + row0 * K, dqh + row0 * K, dkh + row0 * K, dGh + row0 * K
    rq, rk, beta_raw, dAq, dAk = rq + row0, rk + row0, beta_raw + row0, dAq + row0 * BT, dAk + row0 * BT
    c = i_k * BK + tl.arange(0, BK)
    cm = c < K
    rb = b * 16 + tl.arange(0, 16)
    vb = rb < nv
    rowb = rb * H  # token-major row index after the base
    m2b = vb[:, None] & cm[None, :]
    offb = rowb[:, None] * K + c[None, :]
    dq_i, dk_i, dG_i, db_i = _intra_grads(
        q, k, beta_raw, G, rq, rk, dAq, dAk, 0, nv, 0, b, c, cm, scale, H, K, BT, BK, BETA_SIGMOID, P, EMU
    )
    dq_t = tl.load(dqh + offb, mask=m2b, other=0.0) + dq_i
    dk_t = tl.load(dkh + offb, mask=m2b, other=0.0) + dk_i
    dG_t = tl.load(dGh + offb, mask=m2b, other=0.0) + dG_i
    tl.debug_barrier()  # every thread has read its inter-chunk parts before they are overwritten
    tl.store(dqh + offb, dq_t, mask=m2b)
    tl.store(dkh + offb, dk_t, mask=m2b)
    tl.store(dGh + offb, dG_t, mask=m2b)
    tl.store(dbeta_part + i_k * n_tok * H + row0 + rowb, db_i, mask=vb)


@_helper
def _l2norm_bwd(x, rx, dxh, dx, off, m2, row, tm, L2NORM: tl.constexpr, EMU: tl.constexpr):
    """dx from g = d(x / max(||x||, eps)) = dxh: rstd (g - xh (xh . g)) above eps, rstd g below."""
    g = tl.load(dxh + off, mask=m2, other=0.0)
    if L2NORM:
        inv = tl.load(rx + row, mask=tm, other=0.0)
        xh = tl.load(x + off, mask=m2, other=0.0).to(tl.float32) * inv[:, None]
        proj = tl.where(inv < 1.0 / _L2_EPS, _sum(xh * g, 1), 0.0)
        g = inv[:, None] * (g - xh * proj[:, None])
    tl.store(dx + off, _out(g, dx, EMU), mask=m2)


@triton.jit
def _bwd_finish_kernel(
    q, k, g_raw, beta_raw, A_log, dt_bias, rq, rk, dqh, dkh, dGh, dbeta_wy, dbeta_part,
    dq, dk, dg_raw, dbeta, ddt_part, dalog_part,
    chunk_start, chunk_len, n_tok, lower_bound,
    H: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    NKT: tl.constexpr, NKB: tl.constexpr, L2NORM: tl.constexpr, BETA_SIGMOID: tl.constexpr, EMU: tl.constexpr,
):  # fmt: skip
    """The last step, on the gradients the WY-K and intra-chunk kernels left in dqh / dkh / dGh and the dbeta
    parts. One (chunk, head, part): parts below ``NKT`` take one K tile of the whole chunk, the reverse
    cumulative sum of dG and the gate backward (-> dg_raw, and the per-chunk sums for dt_bias and A_log);
    part ``NKT`` the L2-norm backward of dq and the sigmoid backward of dbeta, part ``NKT + 1`` the L2-norm
    backward of dk, 16 rows at a time.

    Every column is independent except in the L2 norm, so the gate work splits by K tile, as in the forward
    gate kernel. Tried and dropped (docs/BENCHMARKS.md): the intra-chunk gradients computed in this kernel
    over the whole K, so that they never go through dqh / dkh / dGh, took 4.36 ms against 1.94 + 0.61 ms for
    the two kernels at 2·8192·32·128 on an H200; this kernel fused into the intra-chunk one (one program per
    (chunk, head) looping over its K tiles and sub-chunks, then over rows it had just written) 3.21 ms against
    1.92 + 0.68 on an H100: eight times fewer programs than the intra-chunk kernel has, to hide the same
    loads' latency; one program per (chunk, head, K tile) that factored each key tile once, looped over the
    four 16-row strips with the column sides in a ``[64, K tile]`` accumulator and then ran this gate part on
    its tile took 6.40 ms against 1.75 + 0.17 ms of the two kernels' parts at 8·4096·16·128 on an H100
    (3.70 at 4 warps, 10.7 on 16-wide tiles), though it compiled to 252 registers without spill."""
    i_c, i_h, part = _chunk_program(NKT + 2, H)
    t0 = tl.load(chunk_start + i_c).to(tl.int64)
    nv = tl.load(chunk_len + i_c)
    if part < NKT:
        r = tl.arange(0, BT)
        valid = r < nv
        row = (t0 + r) * H + i_h  # token-major row index of (token, head)
        c = part * BK + tl.arange(0, BK)
        cm = c < K
        m2 = valid[:, None] & cm[None, :]
        off = row[:, None] * K + c[None, :]
        dg = _revcumsum(tl.load(dGh + off, mask=m2, other=0.0), 0)
        # gate: g = lower_bound * sigmoid(z), z = rate * (g_raw + dt_bias), z clamped below at -80
        rate, rate_ok = _gate_rate(A_log, i_h)
        dt = tl.load(dt_bias + i_h * K + c, mask=cm, other=0.0).to(tl.float32)
        z, sig = _gate_sigmoid(tl.load(g_raw + off, mask=m2, other=0.0).to(tl.float32), dt, rate)
        dz = tl.where(m2 & (z >= _LOGIT_MIN), dg * (lower_bound * sig * (1.0 - sig)), 0.0)
        tl.store(dg_raw + off, _out(dz * rate, dg_raw, EMU), mask=m2)
        poff = (i_c.to(tl.int64) * H + i_h) * K + c
        tl.store(ddt_part + poff, _sum(dz, 0) * rate, mask=cm)
        # dz = 0 wherever z is infinite
        tl.store(dalog_part + poff, _sum(dz * tl.where(dz != 0.0, z, 0.0), 0) * rate_ok, mask=cm)
    else:
        o16 = tl.arange(0, 16)
        kc = tl.arange(0, KP)
        km = kc < K
        for b in range(0, tl.cdiv(nv, 16)):
            rb = b * 16 + o16
            vb = rb < nv
            rowb = (t0 + rb) * H + i_h
            m2b = vb[:, None] & km[None, :]
            offb = rowb[:, None] * K + kc[None, :]
            if part == NKT:
                _l2norm_bwd(q, rq, dqh, dq, offb, m2b, rowb, vb, L2NORM, EMU)
                db = tl.load(dbeta_wy + rowb, mask=vb, other=0.0)
                for j in tl.static_range(NKB):
                    db += tl.load(dbeta_part + j * n_tok * H + rowb, mask=vb, other=0.0)
                if BETA_SIGMOID:
                    sb = 1.0 / (1.0 + tl.exp(-tl.load(beta_raw + rowb, mask=vb, other=0.0).to(tl.float32)))
                    db = db * sb * (1.0 - sb)
                tl.store(dbeta + rowb, _out(db, dbeta, EMU), mask=vb)
            else:
                _l2norm_bwd(k, rk, dkh, dk, offb, m2b, rowb, vb, L2NORM, EMU)


# ============================================================================================ host side


@dataclass(frozen=True)
class _Layout:
    """Chunk and sequence tables of one call (int32 on the device), built once on the host.

    chunk_start / chunk_len: first token and length of every chunk (chunks listed sequence by sequence);
    seq_start / seq_len / seq_chunk0: first token, length and index of the first chunk of every sequence.
    """

    chunk_start: Tensor
    chunk_len: Tensor
    seq_start: Tensor
    seq_len: Tensor
    seq_chunk0: Tensor
    n_chunks: int
    n_seqs: int
    n_tokens: int


@functools.lru_cache(maxsize=64)
def _build_layout(bounds: tuple[tuple[int, int], ...], chunk_size: int, device: torch.device) -> _Layout:
    """Tables for the sequences ``bounds``. Cached: a training or serving loop sees the same few layouts
    again and again, and building one costs host work and a host-to-device copy on every call."""
    starts = torch.tensor([s for s, _ in bounds], dtype=torch.int64)
    lens = torch.tensor([e - s for s, e in bounds], dtype=torch.int64)
    n_chunks_per = (lens + chunk_size - 1) // chunk_size
    first = torch.cumsum(n_chunks_per, 0) - n_chunks_per
    n_chunks = int(n_chunks_per.sum())
    seq_of = torch.repeat_interleave(torch.arange(len(bounds)), n_chunks_per)
    local = torch.arange(n_chunks) - first[seq_of]
    c_start = starts[seq_of] + local * chunk_size
    c_len = torch.minimum(lens[seq_of] - local * chunk_size, torch.full_like(local, chunk_size))
    table = torch.cat([c_start, c_len, starts, lens, first]).to(torch.int32).to(device)
    n = len(bounds)
    c_start, c_len, s_start, s_len, s_first = table.split([n_chunks, n_chunks, n, n, n])
    n_tokens = bounds[-1][1] if bounds else 0
    return _Layout(c_start, c_len, s_start, s_len, s_first, n_chunks, n, n_tokens)


def _precision_codes(precision: str, tensors) -> tuple[int, int, int, int]:
    """``_dot``'s ``P`` codes (forward intra-chunk kernels, forward state kernel, backward,
    backward intra-chunk kernel) for ``ChunkKDAConfig.precision`` and the input dtypes."""
    if precision == "ieee" or (precision == "auto" and any(t.dtype == torch.float32 for t in tensors)):
        return 2, 2, 2, 2
    if precision == "auto":
        return 3, 0, 3, 1
    code = {"bf16": 0, "tf32": 3, "split": 1}[precision]
    return code, code, code, code


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0


def _state_launch(block_v: int, num_warps: int, pairs: int, V: int, device: torch.device) -> tuple[int, int]:
    """(V tile, warps) of a state kernel: ``block_v``, halved (down to 16) while fewer than half the SMs would
    get a program, and at most 4 warps on tiles 64 wide or narrower.

    The state kernels run one program per (sequence, head, V tile) and loop over chunks, so with few long
    sequences the V tiles are the only parallelism (at 32 (sequence, head) pairs on an H200, 32-wide tiles made
    forward + backward 7 % faster than 64-wide ones; at 64 pairs 64-wide tiles were faster). On 32-wide tiles
    4 warps beat 8 (one sequence of 32768 tokens, 32 heads: forward + backward 25.79 -> 25.27 ms), and on
    64-wide tiles too (the bf16 forward state kernel at 2·8192·32·128 on an H200: 0.37 -> 0.30-0.33 ms; at
    128-wide tiles 8 warps stay faster: 0.338 against 0.363 ms at 8·4096·16·128). On 16-wide
    tiles the cap is also a workaround: Triton 3.6 builds tf32 products on ``[*, 16]`` tiles at 8 warps into
    code that makes an illegal memory access on an H200 (both state kernels, one sequence of 128 or 160 tokens
    and two heads); the same launches at 4 warps, or with exact fp32 products, run correctly."""
    while block_v > 16 and 2 * pairs * triton.cdiv(V, block_v) < _sm_count(device):
        block_v //= 2
    return block_v, (min(num_warps, 4) if block_v <= 64 else num_warps)


def _forward_state_stages(cfg: ChunkKDAConfig, fp32: bool, programs: int, device: torch.device) -> int:
    """Pipelining depth of the forward state kernel: ``state_num_stages_fp32`` with fp32 operands, else
    ``state_num_stages_few_programs`` when fewer programs than SMs run, else ``state_num_stages``."""
    if fp32:
        return cfg.state_num_stages_fp32
    if programs < _sm_count(device):
        return cfg.state_num_stages_few_programs
    return cfg.state_num_stages


_STAGES_THAT_FIT: dict[tuple, int] = {}  # launch key -> the deepest pipeline that fitted in shared memory


def _launch_within_shared_memory(launch, num_stages: int, key: tuple | None = None):
    """``launch(num_stages)``, retried with one stage fewer each time the compiled kernel needs more shared memory
    than the GPU has (Triton raises ``OutOfResources`` when it loads the kernel, before anything runs).

    Each pipeline stage holds a copy of a loop iteration's tiles: the forward state kernel's 128-wide V tiles with
    the deeper pipeline of ``state_num_stages_few_programs`` need 237 KB against an H200's 227 KB. Same kernel,
    same results, a shallower pipeline instead of a failed call. With a ``key`` (everything that decides the
    kernel's shared memory) the depth that fitted is remembered, so later calls launch it directly."""
    if key is not None:
        num_stages = _STAGES_THAT_FIT.get(key, num_stages)
    for stages in range(num_stages, 0, -1):
        try:
            result = launch(stages)
        except OutOfResources:
            if stages == 1:
                raise
            continue
        if key is not None:
            _STAGES_THAT_FIT[key] = stages
        return result


def _alloc(shape, dtype: torch.dtype, device, poison: bool) -> Tensor:
    if poison:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@dataclass(frozen=True)
class _Meta:
    """Compile-time switches and scalars shared by the forward and backward of one call."""

    scale: float
    lower_bound: float
    l2norm: bool
    beta_sigmoid: bool
    chunk_size: int
    prec_intra: int  # product precision code of _dot in the forward intra-chunk kernel (see _dot)
    prec_fwd: int  # ... in the forward state kernel (and the WY kernel without a backward)
    prec: int  # ... in the backward (and its recomputation of the states)
    prec_bwd_intra: int  # ... in the backward intra-chunk kernel (the gate gradients' cancelling sums)
    lean: bool  # no backward will follow: forward intermediates in bf16, nothing saved
    emu: bool
    cfg: ChunkKDAConfig


def _bounded_operand_dtype(meta: _Meta) -> torch.dtype:
    """Storage of ``A_qk``, ``w``, ``qg`` and ``kd`` when a backward follows: fp16 when the kernels normalise q
    and k and squash beta, else fp32.

    With unit q and k and beta in (0, 1) every element of these four is at most 1 in magnitude (``scale`` for
    ``A_qk`` and ``qg``; ``w``'s rows are beta-weighted keys pushed through the chunk's delta-rule
    contractions), so fp16 cannot overflow, and it keeps the 11 significant bits that the backward's tf32
    products use: the same numbers in half the bytes. Below 2^-14 fp16 loses relative precision, an absolute
    error under 2^-25 on terms bounded by 1. Measured with the CPU tests' fresh inputs: 0 failures in 40
    varlen and 60 small-tile runs, ``dA_log``'s worst error 1.5e-3 against 3.5e-3 with fp32. Without those
    bounds (raw q, k or beta) nothing limits the values, so they stay fp32."""
    if meta.prec != 2 and meta.l2norm and meta.beta_sigmoid:
        return torch.float16
    return torch.float32


def _bwd_state_f16(cfg: ChunkKDAConfig, kd: Tensor, Aqk: Tensor, meta: _Meta) -> bool:
    """Whether the backward state kernel takes fp16 products (its ``F16``): asked for, fp16 tiles, tf32 products
    asked for, and the loop not pipelined. Pipelined two deep, the fp16 form failed the GPU check on an H100
    (``dA_log`` 7.4e-3 at 2·1000·4·128 against 5e-3; unpipelined it matched the tf32 form's errors)."""
    fp16_tiles = kd.dtype == torch.float16 and Aqk.dtype == torch.float16
    return cfg.bwd_state_f16 and fp16_tiles and meta.prec == 3 and cfg.bwd_state_num_stages == 1


def _run_state_forward(kd, gl, w, u, h0, layout, meta, *, P, h_dtype, v_new_dtype, want_final, out=None):
    """Stage 5 (also the backward's recomputation): ``(states before every chunk, their column factors, v_new,
    final state)``.

    ``out = (qg, Aqk, o)``: the forward's output is computed here too, chunk by chunk from the state in
    registers, and neither ``v_new`` nor the states are written (None is returned for them) unless ``h_dtype``
    is given (the chunk states were asked for). Without ``out``, where the kernel forms fp16 products and
    ``ChunkKDAConfig.f16_states`` is on, the states come back as fp16 with an fp32 factor per column
    (``[chunks, H, V]``; None otherwise)."""
    _, H, K = kd.shape
    V = u.shape[-1]
    cfg, dev = meta.cfg, kd.device
    save_h = out is None or h_dtype is not None
    f16 = out is None and kd.dtype == torch.float16 and P == 3  # tf32 asked for: see the kernel's notes
    h16 = f16 and cfg.f16_states
    h = _alloc((layout.n_chunks, H, K, V), torch.float16 if h16 else h_dtype, dev, cfg.poison) if save_h else gl
    h_unit = _alloc((layout.n_chunks, H, V), torch.float32, dev, cfg.poison) if h16 else gl
    v_new = _alloc((layout.n_tokens, H, V), v_new_dtype, dev, cfg.poison) if out is None else gl
    qg, Aqk, o = out if out is not None else (gl, gl, gl)
    ht = _alloc((layout.n_seqs, H, K, V), torch.float32, dev, cfg.poison) if want_final else gl
    fp32 = u.dtype == torch.float32
    BV, num_warps = _state_launch(cfg.state_block_v_fp32 if fp32 else cfg.state_block_v,
                                  cfg.state_num_warps_fp32 if fp32 else cfg.state_num_warps, layout.n_seqs * H, V, dev)
    num_stages = _forward_state_stages(cfg, fp32, layout.n_seqs * H * triton.cdiv(V, BV), dev)
    key = (dev, kd.dtype, u.dtype, K, V, meta.chunk_size, BV, num_warps, num_stages, save_h, out is None, P, h16)
    _launch_within_shared_memory(lambda stages: _fwd_state_kernel[(layout.n_seqs * H, triton.cdiv(V, BV))](
        kd, gl, w, u, h0 if h0 is not None else gl, h, h_unit, v_new, ht, qg, Aqk, o,
        layout.seq_start, layout.seq_len, layout.seq_chunk0,
        H=H, K=K, V=V, BT=meta.chunk_size, KP=max(16, triton.next_power_of_2(K)), BV=BV,
        HAS_H0=h0 is not None, SAVE_H=save_h, SAVE_V_NEW=out is None, OUT=out is not None,
        STORE_FINAL=want_final, P=P, F16=f16, H16=h16, EMU=meta.emu, num_warps=num_warps, num_stages=stages,
    ), num_stages, key)  # fmt: skip
    return ((h if save_h else None), (h_unit if h16 else None), (v_new if out is None else None),
            (ht if want_final else None))


def _intermediates(q, k, v, g_raw, beta_raw, A_log, dt_bias, layout, meta):
    """Stages 1-4, the chunk-parallel part of the forward: ``(G, rq, rk, Aqk, T, w, u, qg, kd, gl)``.

    With ``meta.lean`` (no backward to follow) every intermediate that is only a product operand is bf16:
    half the bytes, and the forward's products round their operands to bf16 or tf32 anyway. Otherwise they
    are fp32 (see the module notes). The backward calls this again when
    ``ChunkKDAConfig.recompute`` kept only the inputs: same kernels, same inputs, the same bits."""
    _, H, K = q.shape
    V = v.shape[-1]
    cfg, dev, BT = meta.cfg, q.device, meta.chunk_size
    NT, N = layout.n_tokens, layout.n_chunks
    f32, poison = torch.float32, cfg.poison
    half = torch.bfloat16 if meta.prec_fwd != 2 else f32
    # see the module notes: bf16 without a backward; with one, fp16 for the operands bounded by 1, else fp32
    inter = half if meta.lean else f32
    bounded = half if meta.lean else _bounded_operand_dtype(meta)
    G = _alloc((NT, H, K), f32, dev, poison)
    gl = _alloc((N, H, K), f32, dev, poison)
    rq = _alloc((NT, H), f32, dev, poison)
    rk = _alloc((NT, H), f32, dev, poison)
    Aqk = _alloc((NT, H, BT), bounded, dev, poison)
    # T is fp32 when a backward follows; without one it is only the bf16 operand of the WY products, and the
    # strips then write their output X (which the inverse kernel turns into T) to an fp32 buffer of its own
    lean_T = meta.lean and BT > _SUB
    Twy = _alloc((NT, H, BT), half if lean_T else f32, dev, poison)
    Tkk = _alloc((NT, H, BT), f32, dev, poison) if lean_T and cfg.intra_solve == "strips" else Twy
    p_wy = meta.prec_fwd if meta.lean else meta.prec_intra
    w = _alloc((NT, H, K), bounded, dev, poison)
    u = _alloc((NT, H, V), inter, dev, poison)
    qg = _alloc((NT, H, K), bounded, dev, poison)
    kd = _alloc((NT, H, K), bounded, dev, poison)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    nkt = triton.cdiv(K, cfg.gate_block_k)
    _fwd_gate_kernel[(N * H * (nkt + 1),)](
        q, k, g_raw, A_log, dt_bias, G, gl, rq, rk, layout.chunk_start, layout.chunk_len, meta.lower_bound,
        H=H, K=K, BT=BT, BK=cfg.gate_block_k, NKT=nkt, L2NORM=meta.l2norm, **launch,
    )  # fmt: skip
    if cfg.intra_solve == "blocks":
        Dinv = _alloc((NT, H, _SUB), f32, dev, poison)  # the inverted diagonal blocks D_b
        _fwd_diag_kernel[(N * H * (BT // _SUB),)](
            q, k, beta_raw, G, rq, rk, Aqk, Dinv, layout.chunk_start, layout.chunk_len, meta.scale,
            H=H, K=K, BT=BT, BK=cfg.diag_block_k, BETA_SIGMOID=meta.beta_sigmoid, P=meta.prec_intra,
            EMU=meta.emu, num_warps=cfg.diag_num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        _fwd_solve_kernel[(N * H,)](
            q, k, beta_raw, G, rq, rk, Aqk, Dinv, Twy, layout.chunk_start, layout.chunk_len, meta.scale,
            H=H, K=K, BT=BT, BK=cfg.solve_block_k, BETA_SIGMOID=meta.beta_sigmoid, P=meta.prec_intra,
            EMU=meta.emu, num_warps=cfg.solve_num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    else:
        _fwd_intra_kernel[(N * H * (BT // _SUB),)](
            q, k, beta_raw, G, rq, rk, Aqk, Tkk, layout.chunk_start, layout.chunk_len, meta.scale,
            H=H, K=K, BT=BT, BK=cfg.intra_block_k, BETA_SIGMOID=meta.beta_sigmoid, P=meta.prec_intra, EMU=meta.emu,
            **launch,
        )  # fmt: skip
        if BT > _SUB:
            _fwd_inverse_kernel[(N * H,)](
                Tkk, Twy, layout.chunk_start, layout.chunk_len, H=H, BT=BT, P=meta.prec_intra, EMU=meta.emu,
                num_warps=cfg.inverse_num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
    wy_block_k = cfg.block_k if Twy.dtype == torch.bfloat16 else cfg.block_k_fp32
    n_tiles = triton.cdiv(K, wy_block_k) + triton.cdiv(V, cfg.block_v)
    _fwd_wy_kernel[(N * H * n_tiles,)](
        q, k, v, beta_raw, G, rq, rk, Twy, w, u, qg, kd, gl, layout.chunk_start, layout.chunk_len, meta.scale,
        H=H, K=K, V=V, BT=BT, BK=wy_block_k, BV=cfg.block_v, BETA_SIGMOID=meta.beta_sigmoid,
        P=p_wy, EMU=meta.emu, **launch,
    )  # fmt: skip
    return G, rq, rk, Aqk, Tkk, w, u, qg, kd, gl


def _forward(q, k, v, g_raw, beta_raw, A_log, dt_bias, h0, layout, meta, want_final, want_chunks):
    """Returns ``(o, final state, chunk states, intermediates the backward needs)``."""
    _, H, K = q.shape
    V = v.shape[-1]
    cfg, dev = meta.cfg, q.device
    inter = _intermediates(q, k, v, g_raw, beta_raw, A_log, dt_bias, layout, meta)
    _, _, _, Aqk, _, w, u, qg, kd, gl = inter
    o = _alloc((layout.n_tokens, H, V), v.dtype, dev, cfg.poison)
    h, _, _, ht = _run_state_forward(
        kd, gl, w, u, h0, layout, meta, P=meta.prec_fwd, h_dtype=torch.float32 if want_chunks else None,
        v_new_dtype=None, want_final=want_final, out=(qg, Aqk, o),
    )  # fmt: skip
    return o, ht, h, inter


def _backward(do, dht, saved, layout, meta):
    q, k, v, g_raw, beta_raw, A_log, dt_bias, h0, G, rq, rk, Aqk, Tkk, w, u, qg, kd, gl = saved
    _, H, K = q.shape
    V = v.shape[-1]
    cfg, dev, BT = meta.cfg, q.device, meta.chunk_size
    NT, N = layout.n_tokens, layout.n_chunks
    f32, poison = torch.float32, cfg.poison
    KP = max(16, triton.next_power_of_2(K))
    bkb = min(cfg.bwd_block_k, KP)  # K tile of the WY kernel: no wider than K (rounded up to a power of two)
    nkb = triton.cdiv(K, bkb)  # K tiles of the WY kernel
    nki = triton.cdiv(K, cfg.bwd_intra_block_k)  # K tiles of the intra-chunk kernel
    chunked = dict(num_warps=cfg.bwd_num_warps, num_stages=cfg.num_stages)

    h, h_unit, v_new, _ = _run_state_forward(
        kd, gl, w, u, h0, layout, meta, P=meta.prec, h_dtype=f32, v_new_dtype=f32, want_final=False
    )

    dAq = _alloc((NT, H, BT), f32, dev, poison)
    _bwd_dav_kernel[(N * H,)](
        v_new, do, dAq, layout.chunk_start, layout.chunk_len,
        H=H, V=V, BT=BT, BV=cfg.bwd_block_v, P=meta.prec, EMU=meta.emu, **chunked,
    )  # fmt: skip

    state_f16 = _bwd_state_f16(cfg, kd, Aqk, meta)
    dh16 = state_f16 and cfg.f16_states
    dh = _alloc((N, H, K, V), torch.float16 if dh16 else f32, dev, poison)
    dh_unit = _alloc((N, H, V), f32, dev, poison) if dh16 else None
    dvn = _alloc((NT, H, V), f32, dev, poison)
    dh0 = _alloc((layout.n_seqs, H, K, V), f32, dev, poison) if h0 is not None else None
    BV, num_warps = _state_launch(cfg.bwd_state_block_v, cfg.bwd_state_num_warps, layout.n_seqs * H, V, dev)
    _bwd_state_kernel[(layout.n_seqs * H, triton.cdiv(V, BV))](
        qg, kd, gl, w, Aqk, do, dht if dht is not None else gl, dh, dh_unit if dh16 else gl, dvn,
        dh0 if dh0 is not None else gl, layout.seq_start, layout.seq_len, layout.seq_chunk0,
        H=H, K=K, V=V, BT=BT, KP=KP, BV=BV, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None,
        P=meta.prec, F16=state_f16, H16=dh16, EMU=meta.emu, num_warps=num_warps,
        num_stages=cfg.bwd_state_num_stages,
    )  # fmt: skip
    del qg, kd, gl, Aqk

    dv = _alloc((NT, H, V), v.dtype, dev, poison)
    # du u^T, then dw w^T of every K tile where there are several (with one, WY-K finishes dA_kk itself)
    dAk_part = _alloc((1 + nkb if nkb > 1 else 1, NT, H, BT), f32, dev, poison)
    dbeta_wy = _alloc((NT, H), f32, dev, poison)
    dbeta_part = _alloc((nki + nkb, NT, H), f32, dev, poison)  # the intra kernel's K tiles, then the WY kernel's
    _bwd_wy_v_kernel[(N * H,)](
        v, beta_raw, Tkk, u, dvn, dv, dAk_part, dbeta_wy, layout.chunk_start, layout.chunk_len,
        H=H, V=V, BT=BT, BV=cfg.bwd_block_v, BETA_SIGMOID=meta.beta_sigmoid, P=meta.prec, EMU=meta.emu, **chunked,
    )  # fmt: skip
    dqh = _alloc((NT, H, K), f32, dev, poison)
    dkh = _alloc((NT, H, K), f32, dev, poison)
    dGh = _alloc((NT, H, K), f32, dev, poison)
    dAk = _alloc((NT, H, BT), f32, dev, poison)
    _bwd_wy_k_kernel[(N * H * nkb,)](
        q, k, beta_raw, G, rq, rk, Tkk, w, v_new, dvn, h, h_unit if h_unit is not None else G, dh,
        dh_unit if dh16 else G, do, dqh, dkh, dGh, dAk_part, dAk, dbeta_part,
        layout.chunk_start, layout.chunk_len, NT, meta.scale,
        H=H, K=K, V=V, BT=BT, BK=bkb, BV=cfg.bwd_wy_k_block_v, NK=nkb, SLOT0=nki,
        H16=h_unit is not None, DH16=dh16, BETA_SIGMOID=meta.beta_sigmoid,
        P=meta.prec, EMU=meta.emu, num_warps=cfg.bwd_wy_k_num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    del h, h_unit, dh, dh_unit, dvn, v_new
    if nkb > 1:
        _bwd_dak_kernel[(N * H,)](
            Tkk, dAk_part, dAk, layout.chunk_start, layout.chunk_len, NT,
            H=H, BT=BT, NPART=1 + nkb, P=meta.prec, EMU=meta.emu, **chunked,
        )  # fmt: skip
    del dAk_part

    dq = _alloc((NT, H, K), q.dtype, dev, poison)
    dk = _alloc((NT, H, K), k.dtype, dev, poison)
    dg_raw = _alloc((NT, H, K), g_raw.dtype, dev, poison)
    dbeta = _alloc((NT, H), beta_raw.dtype, dev, poison)
    ddt_part = _alloc((N, H, K), f32, dev, poison)
    dalog_part = _alloc((N, H, K), f32, dev, poison)
    _bwd_intra_kernel[(N * H * (BT // _SUB) * nki,)](
        q, k, beta_raw, G, rq, rk, dAq, dAk, dqh, dkh, dGh, dbeta_part,
        layout.chunk_start, layout.chunk_len, NT, meta.scale,
        H=H, K=K, BT=BT, BK=cfg.bwd_intra_block_k, NK=nki, BETA_SIGMOID=meta.beta_sigmoid,
        P=meta.prec_bwd_intra, EMU=meta.emu, num_warps=cfg.bwd_intra_num_warps,
        num_stages=cfg.bwd_intra_num_stages,
    )  # fmt: skip
    nkf = triton.cdiv(K, cfg.bwd_finish_block_k)
    _bwd_finish_kernel[(N * H * (nkf + 2),)](
        q, k, g_raw, beta_raw, A_log, dt_bias, rq, rk, dqh, dkh, dGh, dbeta_wy, dbeta_part,
        dq, dk, dg_raw, dbeta, ddt_part, dalog_part,
        layout.chunk_start, layout.chunk_len, NT, meta.lower_bound,
        H=H, K=K, KP=KP, BT=BT, BK=cfg.bwd_finish_block_k, NKT=nkf, NKB=nki + nkb, L2NORM=meta.l2norm,
        BETA_SIGMOID=meta.beta_sigmoid, EMU=meta.emu, num_warps=cfg.bwd_finish_num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    del dAq, dAk
    ddt = ddt_part.sum(0).reshape(H * K).to(dt_bias.dtype)
    dA_log = dalog_part.sum((0, 2)).to(A_log.dtype)
    return dq, dk, dv, dg_raw, dbeta, dA_log, ddt, dh0


class ChunkKDAFunction(torch.autograd.Function):
    """Autograd wrapper of the chunked KDA kernels; inputs are validated and packed by :func:`chunk_kda`.

    ``apply(q, k, v, g_raw, beta_raw, A_log, dt_bias, initial_state, layout, meta, output_final_state,
    return_chunk_states)`` with token-major packed tensors ``[NT, H, *]`` (``NT`` = all tokens) returns
    ``(o [NT, H, V], final_state [N, H, K, V] or None, chunk_states [chunks, H, K, V] or None)``.
    The chunk states are not differentiable; the final state is.
    """

    @staticmethod
    def forward(ctx, q, k, v, g_raw, beta_raw, A_log, dt_bias, initial_state, layout, meta,
                output_final_state, return_chunk_states):  # fmt: skip
        o, ht, h, inter = _forward(
            q, k, v, g_raw, beta_raw, A_log, dt_bias, initial_state, layout, meta, output_final_state,
            return_chunk_states,
        )
        if not meta.lean:
            kept = () if meta.cfg.recompute else inter
            ctx.save_for_backward(q, k, v, g_raw, beta_raw, A_log, dt_bias, initial_state, *kept)
        ctx.layout, ctx.meta = layout, meta
        chunk_states = h if return_chunk_states else None
        if chunk_states is not None:
            ctx.mark_non_differentiable(chunk_states)
        return o, ht, chunk_states

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht, _dchunks):
        saved = ctx.saved_tensors
        if ctx.meta.cfg.recompute:
            saved = (*saved, *_intermediates(*saved[:7], ctx.layout, ctx.meta))
        grads = _backward(
            do.contiguous(), None if dht is None else dht.contiguous(), saved, ctx.layout, ctx.meta
        )
        dq, dk, dv, dg_raw, dbeta, dA_log, ddt, dh0 = grads
        h0 = saved[7]
        if dh0 is not None:
            dh0 = dh0.to(h0.dtype)
        return dq, dk, dv, dg_raw, dbeta, dA_log, ddt, dh0, None, None, None, None


# ============================================================================================ public API


def _check_float(name: str, t: Tensor) -> None:
    if t.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_raw: Tensor,
    beta_raw: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    *,
    lower_bound: float = -5.0,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    use_qk_l2norm: bool = True,
    use_beta_sigmoid: bool = True,
    return_chunk_states: bool = False,
    chunk_size: int = 64,
    config: ChunkKDAConfig | None = None,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    """Chunked KDA with the gate, the q/k L2 norm and the beta sigmoid fused into the kernels.

    Args:
        q, k: ``[B, T, H, K]`` raw queries / keys (L2-normalised per head inside when ``use_qk_l2norm``,
            as ``x / max(||x||, 1e-6)``).
        v: ``[B, T, H, V]``.
        g_raw: ``[B, T, H, K]`` raw gate; the log decay is
            ``lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h, c]))`` (see ``kda_gate``).
        beta_raw: ``[B, T, H]``; ``beta = sigmoid(beta_raw)`` when ``use_beta_sigmoid``, else used as is.
        A_log: ``[H]``; dt_bias: ``[H * K]``.
        lower_bound: most negative log decay; ``15 * |lower_bound| <= 80`` (the sub-chunk factorisation).
        scale: output scale, ``K ** -0.5`` by default.
        initial_state: ``[B, H, K, V]`` (``[N, H, K, V]`` with ``cu_seqlens``), any float dtype, read as fp32.
        output_final_state: also return the fp32 state after the last token of every sequence.
        cu_seqlens: packed variable-length batch (``B == 1``), int tensor ``[N + 1]`` from 0 to ``T``.
        return_chunk_states: also return the fp32 state before every chunk, laid out like the
            reference's ``kda_chunk(..., return_chunk_states=True)`` (``[B, NC, H, K, V]``); not
            differentiable.
        chunk_size: 16, 32 or 64 tokens.
        config: tile sizes / launch parameters (:class:`ChunkKDAConfig`).

    Returns:
        ``(o, final_state or None[, chunk_states])``; ``o`` is ``[B, T, H, V]`` in ``v``'s dtype. Products
        run in bf16 / tf32 when q, k and v are all 16-bit, in exact fp32 otherwise; accumulation is fp32.
    """
    cfg = config if config is not None else ChunkKDAConfig()
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    for name, t in (("k", k), ("g_raw", g_raw)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with B, T, H = {B}, {T}, {H}, got {tuple(v.shape)}")
    V = v.shape[-1]
    if beta_raw.shape != (B, T, H):
        raise ValueError(f"beta_raw must be [B, T, H] = {(B, T, H)}, got {tuple(beta_raw.shape)}")
    if A_log.shape != (H,):
        raise ValueError(f"A_log must have shape [H]=[{H}], got {tuple(A_log.shape)}")
    if dt_bias.shape != (H * K,):
        raise ValueError(f"dt_bias must have shape [H*K]=[{H * K}], got {tuple(dt_bias.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g_raw", g_raw), ("beta_raw", beta_raw),
                    ("A_log", A_log), ("dt_bias", dt_bias)):  # fmt: skip
        _check_float(name, t)
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all inputs must share one device")
    if K > _MAX_HEAD_DIM or V > _MAX_HEAD_DIM:
        raise ValueError(f"head dims K, V must be <= {_MAX_HEAD_DIM}, got K={K}, V={V}")
    if chunk_size not in _CHUNK_SIZES or isinstance(chunk_size, bool):
        raise ValueError(f"chunk_size must be one of {_CHUNK_SIZES}, got {chunk_size!r}")
    if not (math.isfinite(lower_bound) and lower_bound < 0 and (_SUB - 1) * -lower_bound <= _MAX_EXPONENT):
        raise ValueError(
            f"lower_bound must be negative with 15 * |lower_bound| <= {_MAX_EXPONENT:g} "
            f"(i.e. >= {-_MAX_EXPONENT / (_SUB - 1):.4f}), got {lower_bound}"
        )
    scale = K**-0.5 if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    emu = _INTERPRETED
    if q.device.type != "cuda" and not (emu or _COMPILE_ONLY):
        raise ValueError(f"chunk_kda needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter), got {q.device}")

    if cu_seqlens is None:
        bounds = [(b * T, (b + 1) * T) for b in range(B)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens requires a packed batch with B == 1, got B = {B}")
        bounds = sequence_bounds(cu_seqlens, T)
    n_seqs = len(bounds)
    if initial_state is not None:
        if initial_state.shape != (n_seqs, H, K, V):
            who = "N (number of sequences)" if cu_seqlens is not None else "B"
            raise ValueError(
                f"initial_state must be [{who}, H, K, V] = {(n_seqs, H, K, V)}, got {tuple(initial_state.shape)}"
            )
        _check_float("initial_state", initial_state)
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device}, q on {q.device}")

    differentiable = (q, k, v, g_raw, beta_raw, A_log, dt_bias, initial_state)
    lean = not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable))
    meta = _Meta(
        scale, float(lower_bound), bool(use_qk_l2norm), bool(use_beta_sigmoid), chunk_size,
        *_precision_codes(cfg.precision, (q, k, v)), lean, emu, cfg,
    )  # fmt: skip
    layout = _build_layout(tuple(bounds), chunk_size, q.device)
    n_chunks_per_row = -(-T // chunk_size)

    if B * T == 0:  # nothing to run: outputs of the right shapes, the state passes through
        o = v.new_zeros(B, T, H, V)
        final = None
        if output_final_state:
            final = (
                initial_state.float().clone()
                if initial_state is not None
                else torch.zeros(n_seqs, H, K, V, dtype=torch.float32, device=q.device)
            )
        if return_chunk_states:
            return o, final, torch.zeros(B if cu_seqlens is None else 1, 0, H, K, V, device=q.device)
        return o, final

    flat = [t.contiguous().view(B * T, *t.shape[2:]) for t in (q, k, v, g_raw, beta_raw)]
    h0 = initial_state.contiguous() if initial_state is not None else None
    o, final, chunks = ChunkKDAFunction.apply(
        *flat, A_log.contiguous(), dt_bias.contiguous(), h0, layout, meta, output_final_state, return_chunk_states
    )
    o = o.view(B, T, H, V)
    if not return_chunk_states:
        return o, final
    if cu_seqlens is None:
        chunks = chunks.view(B, n_chunks_per_row, H, K, V)
    else:
        chunks = chunks.unsqueeze(0)
    return o, final, chunks
