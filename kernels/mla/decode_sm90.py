"""Hopper (sm90) split kernel of the absorbed MLA decode, written in Gluon for blocks of 64 query rows.

The portable split kernel (:mod:`k3.kernels.mla.decode`) leaves warp placement to Triton, and for a
``[64, BN]`` score tile that feeds a second product Triton puts all eight warps along the rows: the two
warpgroups of a 64-row program then compute the *same* scores (and the same softmax), which is about a third of
the tensor-core work of a tile thrown away. Here the layouts are spelled out:

- Scores ``S = q_latent . c^T + q_extra . k_extra^T`` on a ``[4, 2]`` warp grid: each warpgroup computes its own
  half of the tile's keys, nothing is computed twice. The row max crosses the two warpgroups once per tile (a
  few hundred bytes of shared memory).
- ``P`` is written to shared memory once per tile, and both warpgroups read all of it for ``o += P . c``; each
  warpgroup owns half of the output columns (``[64, 256]`` fp32 per warpgroup, 128 registers per thread).
- Key tiles stream through a two-slot ring of tensor-memory-access copies with one mbarrier per slot; the copy of
  tile ``j + 1`` is issued as soon as the products of tile ``j - 1`` have finished with its slot, before tile
  ``j``'s scores, so one tile is always in flight while the tensor cores work.
- The row sums of ``P`` are accumulated elementwise in the score layout and reduced once after the unmasked
  tiles: one cross-warpgroup reduction per tile (the row max, which ``P`` needs) instead of two. On an H100 with
  the cache reads served from L2 (every page-table entry one page, so the products bound the time) a Tq=4 call
  went from 0.101 to 0.096 ms with it.
- Tiles that may be masked (the slice's tail and the keys of the draft tokens themselves) are read with ordinary
  masked loads and zero-filled, so no garbage past a sequence's end reaches the products (``0 * NaN`` would).

Shared memory at R = 512, e = 64: the queries 72 KB, two key slots 144 KB, ``P`` 8 KB — one program per SM, and
the split plan asks for one wave. Semantics, the partial-state format and the merge are those of the portable
kernel, whose tests are this kernel's reference (Gluon has no CPU interpreter: the CPU tests compile it for
sm_90a and check its layouts, and on a GPU it is compared with the reference and the portable kernel, see
``tests/kernels/test_mla_decode_sm90.py``).

Measured on an H100 (``python ops/bench/mla_kernels.py``, B = 8 x 32K cache): Tq = 4 x 16 heads 0.156 ms with
the portable kernel, 0.129 ms with this one (65 -> 78 % of the copy bandwidth); Tq = 1 x 64 heads 0.156 ->
0.126 ms (docs/BENCHMARKS.md, thirteenth pass).
"""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import constexpr_function

__all__ = [
    "SM90_BLOCK_M", "SM90_BLOCK_N", "mla_split_kernel_sm90", "sm90_constexprs", "sm90_descriptors", "sm90_unsupported",
]

SM90_BLOCK_M = 64  # query rows per program: one warpgroup's wgmma height, split across two warpgroups by keys
SM90_BLOCK_N = 64  # keys per tile
_NUM_WARPS = 8
_SHARED_LIMIT = 232448  # bytes of shared memory one program may use on sm90
# Gluon renamed these after Triton 3.6 (the GPU image's version); the kernel compiles with either
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


def _shared_bytes(R: int, E: int, element_size: int) -> int:
    width = R + E
    return (SM90_BLOCK_M * width + 2 * SM90_BLOCK_N * width + SM90_BLOCK_M * SM90_BLOCK_N) * element_size + 1024


def sm90_unsupported(kv_cache: Tensor, q_latent: Tensor, R: int, E: int, rows: int) -> str | None:
    """Why this kernel cannot serve the problem, or ``None`` when it can (the caller has already checked that
    the cache can be read through tensor descriptors with ``SM90_BLOCK_N``-key tiles)."""
    if not kv_cache.is_cuda or torch.cuda.get_device_capability(kv_cache.device)[0] != 9:
        return "an sm90 (Hopper) GPU"
    if q_latent.dtype != kv_cache.dtype:
        return f"queries in the cache dtype (got {q_latent.dtype} and {kv_cache.dtype})"
    if rows <= 32:  # 16-row blocks of the portable kernel serve these better
        return f"Tq * H > 32 (got {rows})"
    if _shared_bytes(R, E, kv_cache.element_size()) > _SHARED_LIMIT:
        return f"R + e small enough for two key slots in shared memory (got {R} + {E})"
    return None


def sm90_descriptors(kv_cache: Tensor, R: int, E: int):
    """Descriptors over the cache as one ``[num_pages * page_size, R + e]`` matrix: latent halves, extra values."""
    dtype = gl.bfloat16 if kv_cache.dtype == torch.bfloat16 else gl.float16
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    shape, strides = [rows, R + E], [kv_cache.stride(1), 1]
    half = [SM90_BLOCK_N, R // 2]
    extra = [SM90_BLOCK_N, E]
    return (TensorDescriptor(kv_cache, shape, strides, half, gl.NVMMASharedLayout.get_default_for(half, dtype)),
            TensorDescriptor(kv_cache, shape, strides, extra, gl.NVMMASharedLayout.get_default_for(extra, dtype)))


@constexpr_function
def _row_layout(width):
    """Registers of a ``[rows, width]`` 16-bit tile for coalesced loads: 8 values per thread along a row."""
    across = min(32, width // 8)
    return gl.BlockedLayout([1, 8], [32 // across, across], [_NUM_WARPS, 1], [1, 0])


@gluon.jit
def _tail_tile_to_shared(kv_ptr, bt_ptr, b, s_btb, s_kvp, s_kvr, n0, end, c0_s, c1_s, ke_s,
                         R: gl.constexpr, RH: gl.constexpr, E: gl.constexpr, PAGE: gl.constexpr,
                         BN: gl.constexpr, wide: gl.constexpr, narrow: gl.constexpr):
    """Keys ``[n0, n0 + BN)`` into one key slot through masked loads: rows at or past ``end`` become zeros.
    Eight rows at a time, so that the loaded rows and the live accumulators fit in the registers."""
    CH: gl.constexpr = 8
    for r in gl.static_range(0, BN, CH):
        pos = n0 + r + gl.arange(0, CH, layout=gl.SliceLayout(1, wide))
        ok = pos < end
        page = gl.load(bt_ptr + b * s_btb + pos // PAGE, mask=ok, other=0).to(gl.int64)
        row = kv_ptr + page * s_kvp + (pos % PAGE) * s_kvr
        dr = gl.arange(0, RH, layout=gl.SliceLayout(0, wide))
        c0_s.slice(r, CH).store(gl.load(row[:, None] + dr[None, :], mask=ok[:, None], other=0.0))
        c1_s.slice(r, CH).store(gl.load(row[:, None] + RH + dr[None, :], mask=ok[:, None], other=0.0))
        pos_e = n0 + r + gl.arange(0, CH, layout=gl.SliceLayout(1, narrow))
        ok_e = pos_e < end
        page_e = gl.load(bt_ptr + b * s_btb + pos_e // PAGE, mask=ok_e, other=0).to(gl.int64)
        row_e = kv_ptr + page_e * s_kvp + (pos_e % PAGE) * s_kvr
        de = gl.arange(0, E, layout=gl.SliceLayout(0, narrow))
        ke_s.slice(r, CH).store(gl.load(row_e[:, None] + R + de[None, :], mask=ok_e[:, None], other=0.0))


@gluon.jit
def _tile_scores(ql0_s, ql1_s, qe_s, c0, c1, ke, s_zero):
    """``S = q_latent . c^T + q_extra . k_extra^T`` of one key tile, in the layout of ``s_zero``."""
    s = warpgroup_mma(ql0_s, c0.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma(ql1_s, c1.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(qe_s, ke.permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(0, deps=(s,))


@gluon.jit
def _accumulate_tile(p, alpha, acc0, acc1, p_s, c0, c1, o_layout: gl.constexpr):
    """``acc = alpha acc + P . c`` on both latent halves; ``P`` goes through shared memory to both warpgroups."""
    alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    acc0 = acc0 * alpha_o
    acc1 = acc1 * alpha_o
    p_s.store(p.to(p_s.dtype))
    fence_async_shared()
    _cta_barrier()
    acc0 = warpgroup_mma(p_s, c0, acc0, is_async=True)
    acc1 = warpgroup_mma(p_s, c1, acc1, is_async=True)
    return warpgroup_mma_wait(0, deps=(acc0, acc1))


@gluon.jit
def mla_split_kernel_sm90(
    ql_ptr, qe_ptr, kv_ptr, c_desc, e_desc, bt_ptr, len_ptr, op_ptr, lse_ptr,
    s_qlb, s_qlt, s_qlh, s_qeb, s_qet, s_qeh, s_kvp, s_kvr, s_btb,
    s_opb, s_ops, s_opr, s_lb, s_ls,
    H, Tq, split_len, qk_scale,
    R: gl.constexpr, RH: gl.constexpr, E: gl.constexpr, PAGE: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr,
):  # fmt: skip
    dtype: gl.constexpr = c_desc.dtype
    # scores: each warpgroup takes half of the tile's keys; output: each warpgroup half of each latent half
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BN // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, RH // 2, 16])
    wide: gl.constexpr = _row_layout(RH)
    narrow: gl.constexpr = _row_layout(E)
    q_half_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, RH], dtype)
    q_extra_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, E], dtype)
    p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)

    pid_m = gl.program_id(0)
    split = gl.program_id(1)
    b = gl.program_id(2)
    seq_len = gl.load(len_ptr + b).to(gl.int32)

    # queries -> shared memory (rows are (draft token, head) pairs; rows past Tq * H are zeros)
    rows_w = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, wide))
    ok_w = rows_w < Tq * H
    ql_rows = ql_ptr + b * s_qlb + (rows_w // H) * s_qlt + (rows_w % H) * s_qlh
    dr_w = gl.arange(0, RH, layout=gl.SliceLayout(0, wide))
    ql0_s = gl.allocate_shared_memory(dtype, [BM, RH], q_half_l,
                                      gl.load(ql_rows[:, None] + dr_w[None, :], mask=ok_w[:, None], other=0.0))
    ql1_s = gl.allocate_shared_memory(dtype, [BM, RH], q_half_l,
                                      gl.load(ql_rows[:, None] + RH + dr_w[None, :], mask=ok_w[:, None], other=0.0))
    rows_n = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, narrow))
    ok_n = rows_n < Tq * H
    de_n = gl.arange(0, E, layout=gl.SliceLayout(0, narrow))
    qe_rows = qe_ptr + b * s_qeb + (rows_n // H) * s_qet + (rows_n % H) * s_qeh
    qe_s = gl.allocate_shared_memory(dtype, [BM, E], q_extra_l,
                                     gl.load(qe_rows[:, None] + de_n[None, :], mask=ok_n[:, None], other=0.0))
    c0_s = gl.allocate_shared_memory(dtype, [2, BN, RH], c_desc.layout)
    c1_s = gl.allocate_shared_memory(dtype, [2, BN, RH], c_desc.layout)
    ke_s = gl.allocate_shared_memory(dtype, [2, BN, E], e_desc.layout)
    p_s = gl.allocate_shared_memory(dtype, [BM, BN], p_l)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(ready.index(0), count=1)
    mbarrier.init(ready.index(1), count=1)
    fence_async_shared()
    _cta_barrier()

    rows_s = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    query_pos = seq_len - Tq + rows_s // H
    start = split * split_len
    end = gl.minimum(start + split_len, seq_len)
    # tiles wholly before the first draft token and inside the slice need no mask
    n_full = gl.maximum(gl.minimum(end, seq_len - Tq + 1) - start, 0) // BN
    tile_bytes: gl.constexpr = BN * (2 * RH + E) * 2

    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc0 = gl.zeros([BM, RH], gl.float32, layout=o_layout)
    acc1 = gl.zeros([BM, RH], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    l_tile = gl.zeros([BM, BN], gl.float32, layout=s_layout)

    if n_full > 0:
        r0 = gl.load(bt_ptr + b * s_btb + start // PAGE).to(gl.int32) * PAGE + start % PAGE
        mbarrier.expect(ready.index(0), tile_bytes)
        _tma_load(c_desc, [r0, 0], ready.index(0), c0_s.index(0))
        _tma_load(c_desc, [r0, RH], ready.index(0), c1_s.index(0))
        _tma_load(e_desc, [r0, R], ready.index(0), ke_s.index(0))
    for j in range(n_full):
        slot = j % 2
        _cta_barrier()  # both warpgroups are done with P and with the slot tile j + 1 goes to
        if j + 1 < n_full:
            n1 = start + (j + 1) * BN
            r1 = gl.load(bt_ptr + b * s_btb + n1 // PAGE).to(gl.int32) * PAGE + n1 % PAGE
            nxt = ready.index(1 - slot)
            mbarrier.expect(nxt, tile_bytes)
            _tma_load(c_desc, [r1, 0], nxt, c0_s.index(1 - slot))
            _tma_load(c_desc, [r1, RH], nxt, c1_s.index(1 - slot))
            _tma_load(e_desc, [r1, R], nxt, ke_s.index(1 - slot))
        mbarrier.wait(ready.index(slot), (j // 2) & 1)
        c0 = c0_s.index(slot)
        c1 = c1_s.index(slot)
        s = _tile_scores(ql0_s, ql1_s, qe_s, c0, c1, ke_s.index(slot), s_zero) * qk_scale  # log2 domain
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_tile = l_tile * alpha[:, None] + p  # row sums taken once, after the loop
        m_i = m_new
        acc0, acc1 = _accumulate_tile(p, alpha, acc0, acc1, p_s, c0, c1, o_layout)
    l_i = gl.sum(l_tile, axis=1)

    # masked tiles: the slice's tail and the draft tokens' own keys, one at a time through slot 0
    for n0 in range(start + n_full * BN, end, BN):
        _cta_barrier()  # every warpgroup is done with slot 0 and P
        _tail_tile_to_shared(kv_ptr, bt_ptr, b, s_btb, s_kvp, s_kvr, n0, end, c0_s.index(0), c1_s.index(0),
                             ke_s.index(0), R, RH, E, PAGE, BN, wide, narrow)
        fence_async_shared()
        _cta_barrier()
        c0 = c0_s.index(0)
        c1 = c1_s.index(0)
        s = _tile_scores(ql0_s, ql1_s, qe_s, c0, c1, ke_s.index(0), s_zero)
        pos = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        visible = (pos < end)[None, :] & (pos[None, :] <= query_pos[:, None])
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc0, acc1 = _accumulate_tile(p, alpha, acc0, acc1, p_s, c0, c1, o_layout)
    mbarrier.invalidate(ready.index(0))
    mbarrier.invalidate(ready.index(1))

    seen = l_i > 0.0
    lse = gl.where(seen, m_i + gl.log2(gl.where(seen, l_i, 1.0)), float("-inf"))
    gl.store(lse_ptr + b * s_lb + split * s_ls + rows_s, lse, mask=rows_s < Tq * H)
    inv = gl.convert_layout(1.0 / gl.where(seen, l_i, 1.0), gl.SliceLayout(1, o_layout))[:, None]
    rows_o = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
    dr_o = gl.arange(0, RH, layout=gl.SliceLayout(0, o_layout))
    out_rows = op_ptr + b * s_opb + split * s_ops + rows_o[:, None] * s_opr
    ok_o = (rows_o < Tq * H)[:, None]
    gl.store(out_rows + dr_o[None, :], acc0 * inv, mask=ok_o)
    gl.store(out_rows + RH + dr_o[None, :], acc1 * inv, mask=ok_o)


def sm90_constexprs(R: int, E: int, page_size: int) -> dict:
    """Compile-time arguments and launch options of :func:`mla_split_kernel_sm90`, which takes the portable split
    kernel's runtime arguments (grid ``(1, num_splits, B)``)."""
    return dict(R=R, RH=R // 2, E=E, PAGE=page_size, BM=SM90_BLOCK_M, BN=SM90_BLOCK_N, num_warps=_NUM_WARPS)
