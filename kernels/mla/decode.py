"""Absorbed MLA decode over a paged latent cache: split-K ("flash-decoding") Triton kernels.

Layout and semantics are those of :mod:`k3.kernels.mla.reference` (read that first): ``kv_cache
[num_pages, page_size, R + e]`` holds ``[RMSNorm(c_kv) | k_extra]`` per token, ``block_table [B, max_pages]``
maps sequences to pages, and the ``Tq`` new tokens are the last ``Tq`` of each sequence.

Design decisions:

- All heads share one key/value stream (the latent), so a program handles a block of ``BM`` query rows — the
  flattened ``(t, h)`` pairs of one sequence — against a key tile: two tensor-core products per tile
  (``q_latent . c`` over R and ``q_extra . k_extra`` over e) give the scores, one more (``p . c``) the output.
  Every latent row read from memory serves ``BM`` queries; with ``Tq * H <= BM`` the cache is read exactly once.
- Split-K over the sequence: the key range is cut into ``num_splits`` slices, one program per (row block, slice,
  sequence), so even a handful of long sequences fill the GPU. Each program writes its un-normalised partial
  state as (normalised output, log-sum-exp); a second kernel merges the slices with the usual rescaling.
  Row blocks vary fastest in the grid, so the programs reading one cache slice run side by side and share it
  through L2.
- Paging: tiles start at multiples of ``block_n`` within a sequence, so when ``page_size`` is a multiple of
  ``block_n`` a tile lies in one page and costs one page-table read; otherwise its rows are gathered one by one
  through ``block_table`` (``pos // page_size``), so any page size works. Page tables need not be contiguous.
  Each cache row is one contiguous 1152-byte read.
- No host synchronisation on the hot path: the number of slices comes from the static capacity of the page
  table (or a ``max_seq_len`` hint), not from ``seq_lens``; slices that start past a sequence's end write an
  empty partial (lse = -inf) and cost one early exit. ``validate=True`` (default) checks ``seq_lens`` and the page
  ids in use on the host, which synchronises; serving loops that validated their tables turn it off.
- Causal mask only where it can bite: key tiles that end before the first of the ``Tq`` new tokens (and inside
  the slice) are visible to every row, so they run without mask arithmetic and load whole rows unconditionally;
  only the tail tiles of a slice apply the bounds and causal-within-draft masks.
- Two latent halves: the program keeps two ``[BM, R/2]`` accumulators and loads each key tile as two
  ``[BN, R/2]`` halves plus the ``[BN, e]`` extra values. Same products, split along R; a half (256 wide
  for the released shapes) is also the widest box of a tensor-memory-access copy, so with ``MLAConfig.tma``
  the unmasked tiles are three descriptor copies per tile instead of per-thread pointer loads.
- On Hopper, more than 32 query rows per sequence go to the Gluon split kernel of :mod:`k3.kernels.mla.decode_sm90`
  (same arguments, partial states and merge): Triton places a 64-row score tile that feeds a second product on
  all eight warps along its rows, so both warpgroups of the kernel below compute the same scores; the Gluon
  kernel gives each warpgroup its own keys. This kernel stays the reference the CPU tests check and the path
  everywhere else.
- Softmax in fp32 with exp2 and the scale folded into log2 space; ``p`` is rounded to the cache dtype for the
  ``p . c`` product (bf16 tensor cores), accumulation is fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from k3.kernels.cast import dot_upcast, round_to
from k3.kernels.mla.reference import DEFAULT_SCALE, absorb_output, absorb_query, check_paged_inputs

try:  # Gluon ships with Triton 3.4 and later, its names moved between versions; without them, no sm90 kernel
    from k3.kernels.mla import decode_sm90
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    decode_sm90 = None

__all__ = [
    "MLAConfig", "mla_decode_attention", "mla_decode", "plan_splits", "resident_programs", "split_kernel",
    "tma_unsupported",
]

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class MLAConfig:
    """Launch parameters of the decode kernels (``None`` fields are chosen from the problem).

    Fields:
        block_m: query rows ((t, h) pairs) per program, power of two >= 16; default: 16 for up to 32 rows of a
            sequence, else 64 (the cache is streamed once per 64-row block, and the programs of one sequence's
            row blocks share its tiles through L2). 32-row blocks were the slowest choice measured: on an H100
            (B = 8 x 32K cache, Tq = 2 x 16 heads) one 32-row block took 0.156 ms, two 16-row blocks 0.131 ms.
        block_n: keys per inner step, power of two >= 16.
        num_warps: for the split kernel; default 4 for 16-row blocks, 8 for larger ones (the fp32 accumulator
            ``[block_m, R]`` lives in registers).
        num_stages: software-pipelining depth of the key loop.
        num_splits: slices of the key range; ``None`` fills one wave of the GPU (see :func:`plan_splits`).
        tma: load the unmasked key tiles through tensor descriptors (tensor memory access copies) instead of
            per-thread pointers. ``None``: on an sm90+ GPU for blocks of 64 or more rows, where the layout
            allows it (see :func:`tma_unsupported`): on an H200 (B = 8 x 32K cache, 16 heads) 64-row blocks
            (Tq = 4) went from 0.175 to 0.166 ms with them and 16-row blocks (Tq = 1) from 0.090 to 0.143 ms,
            as the descriptor path spills registers there.
            ``True`` asks for it (also under the interpreter) and is an error where the layout does not
            allow it; ``False`` never.
        sm90: run the split kernel of :mod:`k3.kernels.mla.decode_sm90` (Gluon, explicit warpgroup layouts, for
            more than 32 query rows per sequence, in blocks of 64) instead of the portable one. ``None``: on an sm90 GPU wherever it
            applies (see :func:`k3.kernels.mla.decode_sm90.sm90_unsupported`; it also needs the descriptor
            layout and 64-key tiles); ``True`` asks for it and is an error where it does not apply; ``False``
            never.
    """

    block_m: int | None = None
    block_n: int = 64
    num_warps: int | None = None
    num_stages: int = 2
    num_splits: int | None = None
    tma: bool | None = None
    sm90: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if name == "block_m" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"MLAConfig.{name} must be a power of two >= 16, got {value!r}")
        for name in ("num_warps", "num_stages", "num_splits"):
            value = getattr(self, name)
            if name != "num_stages" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MLAConfig.{name} must be a positive integer, got {value!r}")
        for name in ("tma", "sm90"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"MLAConfig.{name} must be None, True or False, got {value!r}")

    def resolve(self, rows: int) -> tuple[int, int]:
        """``(block_m, num_warps)`` for ``rows`` query rows per sequence."""
        block_m = self.block_m or (16 if rows <= 32 else 64)
        return block_m, self.num_warps or (4 if block_m <= 16 else 8)


@triton.jit
def _mla_tile(
    ql0, ql1, qe, acc0, acc1, m_i, l_i, kv_ptr, c_desc, e_desc, bt_ptr, b, s_btb, s_kvp, s_kvr, n0, end,
    query_pos, dr, de, qk_scale,
    R: tl.constexpr, RH: tl.constexpr, E: tl.constexpr, PAGE: tl.constexpr, BN: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, TILE_IN_PAGE: tl.constexpr, EVEN_R: tl.constexpr,
    EVEN_E: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr,
):
    """One key tile ``[n0, n0 + BN)`` against all query rows: online-softmax update of (acc, m_i, l_i).

    The latent dimension is handled as two halves of ``RH`` (``dr`` indexes one half): two accumulators of
    ``[BM, RH]``, which is also the widest box one tensor-memory-access copy moves.
    ``MASKED`` tiles may run past the slice end or reach the draft tokens (causal mask); the others are
    wholly visible to every row, so they skip the mask arithmetic and load whole rows unconditionally --
    through the tensor descriptors when ``TMA`` (no per-thread address arithmetic, asynchronous copies).
    """
    pos = n0 + tl.arange(0, BN)
    mask_n = pos < end
    if TMA and not MASKED:  # descriptor copies: the tile is one page's rows [r0, r0 + BN)
        r0 = tl.load(bt_ptr + b * s_btb + n0 // PAGE).to(tl.int32) * PAGE + n0 % PAGE
        c0 = c_desc.load([r0, 0])
        c1 = c_desc.load([r0, RH])
        ke = e_desc.load([r0, R])
    else:
        if TILE_IN_PAGE:  # the whole tile lies in one page: one page-table read, affine row addresses
            page = tl.load(bt_ptr + b * s_btb + n0 // PAGE).to(tl.int64)
            row = kv_ptr + page * s_kvp + (n0 % PAGE + tl.arange(0, BN)) * s_kvr
        elif MASKED:
            page = tl.load(bt_ptr + b * s_btb + pos // PAGE, mask=mask_n, other=0).to(tl.int64)
            row = kv_ptr + page * s_kvp + (pos % PAGE) * s_kvr
        else:
            page = tl.load(bt_ptr + b * s_btb + pos // PAGE).to(tl.int64)
            row = kv_ptr + page * s_kvp + (pos % PAGE) * s_kvr
        if MASKED or not EVEN_R:
            c0 = tl.load(row[:, None] + dr[None, :], mask=mask_n[:, None] & (dr < R)[None, :], other=0.0)
            c1 = tl.load(row[:, None] + RH + dr[None, :], mask=mask_n[:, None] & (RH + dr < R)[None, :], other=0.0)
        else:
            c0 = tl.load(row[:, None] + dr[None, :])
            c1 = tl.load(row[:, None] + RH + dr[None, :])
        if MASKED or not EVEN_E:
            ke = tl.load(row[:, None] + R + de[None, :], mask=mask_n[:, None] & (de < E)[None, :], other=0.0)
        else:
            ke = tl.load(row[:, None] + R + de[None, :])
    if UPCAST:  # see k3.kernels.cast
        c0, c1, ke = c0.to(tl.float32), c1.to(tl.float32), ke.to(tl.float32)
    s = tl.dot(ql0, tl.trans(c0), input_precision=PRECISION)
    s = tl.dot(ql1, tl.trans(c1), s, input_precision=PRECISION)
    s = tl.dot(qe, tl.trans(ke), s, input_precision=PRECISION)
    s = s * qk_scale  # log2 domain
    if MASKED:
        visible = mask_n[None, :] & (pos[None, :] <= query_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(c0.dtype)
    acc0 = tl.dot(p, c0, acc0 * alpha[:, None], input_precision=PRECISION)
    acc1 = tl.dot(p, c1, acc1 * alpha[:, None], input_precision=PRECISION)
    return acc0, acc1, m_new, l_i


@triton.jit
def _mla_split_kernel(
    ql_ptr, qe_ptr, kv_ptr, c_desc, e_desc, bt_ptr, len_ptr, op_ptr, lse_ptr,
    s_qlb, s_qlt, s_qlh, s_qeb, s_qet, s_qeh, s_kvp, s_kvr, s_btb,
    s_opb, s_ops, s_opr, s_lb, s_ls,
    H, Tq, split_len, qk_scale,
    R: tl.constexpr, RH: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, PAGE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr, TMA: tl.constexpr,
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    seq_len = tl.load(len_ptr + b).to(tl.int32)
    rows = pid_m * BM + tl.arange(0, BM)
    mask_r = rows < Tq * H
    t = rows // H  # rows are (draft token, head) pairs: all Tq x H of a sequence share each key tile
    h = rows % H
    query_pos = seq_len - Tq + t  # absolute position of each query row
    dr = tl.arange(0, RH)
    de = tl.arange(0, EP)
    mask_de = de < E
    ql_rows = ql_ptr + b * s_qlb + t[:, None] * s_qlt + h[:, None] * s_qlh
    ql0 = tl.load(ql_rows + dr[None, :], mask=mask_r[:, None] & (dr < R)[None, :], other=0.0)
    ql1 = tl.load(ql_rows + RH + dr[None, :], mask=mask_r[:, None] & (RH + dr < R)[None, :], other=0.0)
    qe = tl.load(qe_ptr + b * s_qeb + t[:, None] * s_qet + h[:, None] * s_qeh + de[None, :],
                 mask=mask_r[:, None] & mask_de[None, :], other=0.0)
    if UPCAST:  # see k3.kernels.cast
        ql0, ql1, qe = ql0.to(tl.float32), ql1.to(tl.float32), qe.to(tl.float32)

    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    # Tiles wholly before the first draft token and inside the slice need no mask.
    full_end = start + tl.maximum(tl.minimum(end, seq_len - Tq + 1) - start, 0) // BN * BN
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc0 = tl.zeros((BM, RH), tl.float32)
    acc1 = tl.zeros((BM, RH), tl.float32)
    for n0 in range(start, full_end, BN):
        acc0, acc1, m_i, l_i = _mla_tile(
            ql0, ql1, qe, acc0, acc1, m_i, l_i, kv_ptr, c_desc, e_desc, bt_ptr, b, s_btb, s_kvp, s_kvr, n0, end,
            query_pos, dr, de, qk_scale, R, RH, E, PAGE, BN, UPCAST, PRECISION, TILE_IN_PAGE, 2 * RH == R, EP == E,
            False, TMA)
    for n0 in range(full_end, end, BN):
        acc0, acc1, m_i, l_i = _mla_tile(
            ql0, ql1, qe, acc0, acc1, m_i, l_i, kv_ptr, c_desc, e_desc, bt_ptr, b, s_btb, s_kvp, s_kvr, n0, end,
            query_pos, dr, de, qk_scale, R, RH, E, PAGE, BN, UPCAST, PRECISION, TILE_IN_PAGE, 2 * RH == R, EP == E,
            True, TMA)

    seen = l_i > 0.0
    denom = tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    out_rows = op_ptr + b * s_opb + split * s_ops + rows[:, None] * s_opr
    tl.store(out_rows + dr[None, :], acc0 / denom, mask=mask_r[:, None] & (dr < R)[None, :])
    tl.store(out_rows + RH + dr[None, :], acc1 / denom, mask=mask_r[:, None] & (RH + dr < R)[None, :])
    tl.store(lse_ptr + b * s_lb + split * s_ls + rows, lse, mask=mask_r)


@triton.jit
def _mla_merge_kernel(
    op_ptr, lse_ptr, out_ptr,
    s_opb, s_ops, s_opr, s_lb, s_ls, s_ob, s_ot, s_oh,
    H, num_splits,
    R: tl.constexpr, RP: tl.constexpr, SP: tl.constexpr,
):
    r = tl.program_id(0)
    b = tl.program_id(1)
    t = r // H
    h = r % H
    splits = tl.arange(0, SP)
    lse = tl.load(lse_ptr + b * s_lb + splits * s_ls + r, mask=splits < num_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    dr = tl.arange(0, RP)
    mask_dr = dr < R
    acc = tl.zeros((RP,), tl.float32)
    total = 0.0
    for s in range(num_splits):
        w = tl.exp2(tl.load(lse_ptr + b * s_lb + s * s_ls + r) - m)  # 0 for an empty slice
        part = tl.load(op_ptr + b * s_opb + s * s_ops + r * s_opr + dr, mask=mask_dr, other=0.0)
        acc += w * part
        total += w
    o = acc / total
    tl.store(out_ptr + b * s_ob + t * s_ot + h * s_oh + dr, round_to(o, out_ptr.dtype.element_ty), mask=mask_dr)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few slices are enough to exercise the merge


def _half_width(R: int) -> int:
    """Width of each of the two latent halves the split kernel works on (a ``tl.dot`` needs >= 16)."""
    return max(16, triton.next_power_of_2(R) // 2)


def tma_unsupported(kv_cache: Tensor, R: int, E: int, block_n: int) -> str | None:
    """Why the split kernel cannot read ``kv_cache`` through tensor descriptors, or ``None`` when it can.

    A descriptor sees the cache as one ``[num_pages * page_size, R + e]`` matrix, so pages must be evenly
    spaced rows of it; its boxes are a tile's rows by one latent half (or the ``e`` extra values), at most
    256 wide, and its row stride must be a multiple of 16 bytes."""
    num_pages, page = kv_cache.shape[:2]
    if kv_cache.dtype not in (torch.bfloat16, torch.float16):
        return f"a 16-bit cache (got {kv_cache.dtype})"
    if 2 * _half_width(R) != R or R > 512 or triton.next_power_of_2(E) != E or not 16 <= E <= 256:
        return f"R a power of two in [32, 512] and e a power of two in [16, 256] (got R={R}, e={E})"
    if page % block_n:
        return f"page_size a multiple of block_n (got {page} and {block_n})"
    if kv_cache.stride(2) != 1 or kv_cache.stride(0) != page * kv_cache.stride(1):
        return "pages laid out as evenly spaced rows of one matrix"
    if (kv_cache.stride(1) * kv_cache.element_size()) % 16 or kv_cache.data_ptr() % 16:
        return "a 16-byte aligned cache and row stride"
    if num_pages * page >= 2**31:
        return "fewer than 2^31 cache rows"
    return None


def _descriptors(kv_cache: Tensor, R: int, E: int, block_n: int):
    """The split kernel's two descriptors over the cache as one matrix: latent halves, extra values."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = kv_cache.shape[0] * kv_cache.shape[1]
    shape, strides = [rows, R + E], [kv_cache.stride(1), 1]
    return (TensorDescriptor(kv_cache, shape, strides, [block_n, R // 2]),
            TensorDescriptor(kv_cache, shape, strides, [block_n, E]))


def _use_tma(config: MLAConfig, kv_cache: Tensor, R: int, E: int, block_m: int) -> bool:
    if config.tma is False:
        return False
    why = tma_unsupported(kv_cache, R, E, config.block_n)
    if config.tma:
        if why is not None:
            raise ValueError(f"MLAConfig(tma=True) needs {why}")
        return True
    return why is None and block_m >= 64 and kv_cache.is_cuda and torch.cuda.get_device_capability(kv_cache.device)[0] >= 9


def _use_sm90(config: MLAConfig, q_latent: Tensor, kv_cache: Tensor, R: int, E: int, rows: int) -> bool:
    if config.sm90 is False:
        return False
    if decode_sm90 is None:
        why = "a Triton with Gluon (3.4 or later)"
    elif config.block_n != decode_sm90.SM90_BLOCK_N or config.block_m not in (None, decode_sm90.SM90_BLOCK_M):
        why = f"block_n = block_m = {decode_sm90.SM90_BLOCK_N} (got {config.block_n} and {config.block_m})"
    elif not kv_cache.is_cuda:
        why = "a CUDA device (Gluon kernels have no interpreter)"
    else:
        why = tma_unsupported(kv_cache, R, E, decode_sm90.SM90_BLOCK_N) or decode_sm90.sm90_unsupported(
            kv_cache, q_latent, R, E, rows)
    if config.sm90:
        if why is not None:
            raise ValueError(f"MLAConfig(sm90=True) needs {why}")
        return True
    return why is None


def split_kernel(q_latent: Tensor, kv_cache: Tensor, config: MLAConfig | None = None) -> str:
    """``"sm90"`` or ``"portable"``: which split kernel :func:`mla_decode_attention` runs for these inputs."""
    R, E = q_latent.shape[3], kv_cache.shape[2] - q_latent.shape[3]
    rows = q_latent.shape[1] * q_latent.shape[2]
    return "sm90" if _use_sm90(config or MLAConfig(), q_latent, kv_cache, R, E, rows) else "portable"


def resident_programs(shared: int, regs: int, num_warps: int, *, smem_per_sm: int = 233472,
                      regs_per_sm: int = 65536, threads_per_sm: int = 2048) -> int:
    """How many programs of a compiled kernel one SM holds at once (at least 1), from its shared memory per
    program, registers per thread and warps: the smallest of the three limits. Registers are allocated per
    warp in units of 256, and the driver reserves 1 KB of shared memory per resident program (sm90's rules;
    the defaults are an H100's / H200's limits)."""
    regs_per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * num_warps)
    by_smem = smem_per_sm // (shared + 1024)
    by_threads = threads_per_sm // (32 * num_warps)
    return max(1, min(by_regs, by_smem, by_threads))


_RESIDENT: dict[tuple, int] = {}  # compile key of the split kernel -> programs per SM


def _resident_split_programs(key: tuple, compile_split_kernel, device: torch.device) -> int:
    """Programs per SM of the split kernel compiled for ``key`` (compiled on first use, then remembered)."""
    if key not in _RESIDENT:
        kernel = compile_split_kernel()
        kernel._init_handles()  # loads the binary: the register count is known only then
        props = torch.cuda.get_device_properties(device)
        _RESIDENT[key] = resident_programs(
            kernel.metadata.shared, kernel.n_regs, kernel.metadata.num_warps,
            smem_per_sm=props.shared_memory_per_multiprocessor, regs_per_sm=props.regs_per_multiprocessor,
            threads_per_sm=props.max_threads_per_multi_processor)
    return _RESIDENT[key]


def plan_splits(batch: int, row_blocks: int, max_len: int, block_n: int, device: torch.device,
                num_splits: int | None = None, per_sm: int = 2) -> tuple[int, int]:
    """``(num_splits, split_len)`` for a key range of ``max_len``; ``split_len`` is a multiple of ``block_n``.

    By default the grid is one full wave of ``per_sm`` resident programs on every SM, rounded *down*: a grid a
    few programs past a wave pays a whole second wave for them, and a second full wave only adds the cost of
    re-filling the pipeline and more partial states to merge. B = 8 x 32K cache, 16 heads, Tq = 4, where a
    64-row program fills an SM (222 KB of shared memory): on an H100 33 slices (264 programs, two waves)
    took 0.176 ms, 16 (128 programs, one wave) 0.158 ms and 17 (136 programs) 0.218 ms; on an H200 0.166
    and 0.151 ms for 33 and 16. At Tq = 1 two 16-row programs fit an SM, and the wave is 33 slices.
    """
    n_blocks = max(1, math.ceil(max_len / block_n))
    if num_splits is None:
        target = per_sm * _num_sms(device)
        num_splits = target // max(1, batch * row_blocks)
    num_splits = max(1, min(num_splits, n_blocks))
    split_len = math.ceil(n_blocks / num_splits) * block_n
    return math.ceil(n_blocks * block_n / split_len), split_len


def mla_decode_attention(
    q_latent: Tensor,
    q_extra: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    *,
    scale: float = DEFAULT_SCALE,
    max_seq_len: int | None = None,
    validate: bool = True,
    out: Tensor | None = None,
    config: MLAConfig | None = None,
) -> Tensor:
    """Attention core: ``o_latent [B, Tq, H, R]`` for queries ``q_latent [B, Tq, H, R]``,
    ``q_extra [B, Tq, H, e]`` over the paged cache (see the module docstring).

    The output has q's dtype, or fp32 when an fp32 ``out`` is given (then nothing is rounded before the caller's
    value absorption).

    ``max_seq_len`` bounds ``seq_lens`` (default: the page table's capacity) and sizes the split plan; it must
    not be exceeded (checked when ``validate``).
    """
    check_paged_inputs(q_latent, q_extra, kv_cache, block_table, seq_lens, validate=validate)
    config = config or MLAConfig()
    B, Tq, H, R = q_latent.shape
    E = q_extra.shape[3]
    page_size = kv_cache.shape[1]
    capacity = block_table.shape[1] * page_size
    if max_seq_len is None:
        max_seq_len = capacity
    elif isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= capacity:
        raise ValueError(f"max_seq_len must be an int in [1, {capacity}], got {max_seq_len!r}")
    elif validate and B > 0 and int(seq_lens.max()) > max_seq_len:
        raise ValueError(f"seq_lens exceed max_seq_len={max_seq_len}")
    if out is None:
        out = torch.empty_like(q_latent, memory_format=torch.contiguous_format)
    elif out.shape != q_latent.shape or out.dtype not in (q_latent.dtype, torch.float32) or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q_latent.shape)} of {q_latent.dtype} or float32 with unit inner stride")
    if B == 0 or Tq == 0 or H == 0:
        return out
    q_latent, q_extra, kv_cache = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_latent, q_extra, kv_cache))

    rows = Tq * H
    sm90 = _use_sm90(config, q_latent, kv_cache, R, E, rows)
    if sm90:
        block_m = decode_sm90.SM90_BLOCK_M
        c_desc, e_desc = decode_sm90.sm90_descriptors(kv_cache, R, E)
        kernel = decode_sm90.mla_split_kernel_sm90
        constexprs = decode_sm90.sm90_constexprs(R, E, page_size)
    else:
        block_m, num_warps = config.resolve(rows)
        tma = _use_tma(config, kv_cache, R, E, block_m)
        c_desc, e_desc = _descriptors(kv_cache, R, E, config.block_n) if tma else (None, None)
        kernel = _mla_split_kernel
        constexprs = dict(
            R=R, RH=_half_width(R), E=E, EP=max(16, triton.next_power_of_2(E)), PAGE=page_size,
            BM=block_m, BN=config.block_n, UPCAST=dot_upcast(_mla_split_kernel),
            PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32",
            TILE_IN_PAGE=page_size % config.block_n == 0, TMA=tma, num_warps=num_warps,
            num_stages=config.num_stages,
        )
    row_blocks = triton.cdiv(rows, block_m)

    def split_args(num_splits: int, split_len: int):
        partial = torch.empty(B, num_splits, rows, R, dtype=torch.float32, device=q_latent.device)
        lse = torch.empty(B, num_splits, rows, dtype=torch.float32, device=q_latent.device)
        return partial, lse, (
            q_latent, q_extra, kv_cache, c_desc, e_desc, block_table, seq_lens, partial, lse,
            q_latent.stride(0), q_latent.stride(1), q_latent.stride(2),
            q_extra.stride(0), q_extra.stride(1), q_extra.stride(2),
            kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
            partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
            H, Tq, split_len, float(scale) * _LOG2E,
        )

    per_sm = 2
    if config.num_splits is None and q_latent.is_cuda:  # a grid of whole waves of resident programs
        per_sm = _resident_split_programs(
            (q_latent.device, q_latent.dtype, sm90, *constexprs.items()),
            lambda: kernel.warmup(*split_args(1, max_seq_len)[2], grid=(1,), **constexprs),
            q_latent.device)
    num_splits, split_len = plan_splits(B, row_blocks, max_seq_len, config.block_n, q_latent.device,
                                        config.num_splits, per_sm)
    partial, lse, args = split_args(num_splits, split_len)
    kernel[(row_blocks, num_splits, B)](*args, **constexprs)
    _mla_merge_kernel[(rows, B)](
        partial, lse, out,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        H, num_splits,
        R=R, RP=triton.next_power_of_2(R), SP=triton.next_power_of_2(num_splits),
        num_warps=4,
    )
    return out


def mla_decode(
    q_nope: Tensor,
    q_extra: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    w_kvb: Tensor,
    gate_logits: Tensor,
    *,
    scale: float | None = None,
    max_seq_len: int | None = None,
    validate: bool = True,
    config: MLAConfig | None = None,
) -> Tensor:
    """The whole absorbed decode path before W_o, attention core in Triton: ``[B, Tq, H * v]``.

    Arguments as :func:`k3.kernels.mla.reference.mla_decode_reference`; ``scale`` defaults to ``(n + e)^-1/2``.
    The query absorption is a product in ``W_kvb``'s dtype (fp32 accumulation; its result is rounded to the
    cache dtype either way); the attention core accumulates and returns fp32, and the value absorption and the
    gate run in fp32 on it, so a bf16 path rounds once on the way in and once on the way out. Only the value
    half of the weight is upcast per call: upcasting all of it moved five times its bytes on every step (read
    2, write 4, read 4 per value), at batch 1 and the released shapes (64 heads, 8.4 M values per layer) more
    traffic than reading a 32K-token cache.
    """
    n, e = q_nope.shape[-1], q_extra.shape[-1]
    scale = (n + e) ** -0.5 if scale is None else scale
    v_dim = w_kvb.shape[0] // q_nope.shape[-2] - n
    q_latent = absorb_query(q_nope.to(w_kvb.dtype), w_kvb, v_dim).to(kv_cache.dtype)
    o_latent = torch.empty(q_latent.shape, dtype=torch.float32, device=q_latent.device)
    mla_decode_attention(q_latent, q_extra.to(kv_cache.dtype), kv_cache, block_table, seq_lens, scale=scale,
                         max_seq_len=max_seq_len, validate=validate, out=o_latent, config=config)
    return absorb_output(o_latent, w_kvb, n, gate_logits).to(gate_logits.dtype)
