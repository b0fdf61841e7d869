"""Chunked KDA Triton kernels (forward and backward, run by the CPU interpreter) against the fp64 reference.

Ground truth: ``kda_gate`` + ``F.normalize`` + ``sigmoid`` + ``kda_chunk`` evaluated in fp64 on the same
(already rounded) inputs, differentiated by autograd. Every buffer the kernels write starts as NaN
(``ChunkKDAConfig(poison=True)``), so an element a kernel forgets shows up in the comparison.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything defines a Triton kernel

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from utils import TOLERANCE, fresh_generator, rel_rms  # noqa: E402

from k3.kernels.kda.chunk import ChunkKDAConfig, chunk_kda  # noqa: E402
from k3.kernels.kda.reference import kda_chunk, kda_gate  # noqa: E402

pytestmark = pytest.mark.timeout(120)

# K != V so that a swapped dimension cannot pass. Four heads: dA_log has one entry per head, each a sum over
# all tokens of terms that largely cancel; with two, a draw that made both small failed the relative
# tolerance in about one run in 150.
H, K, V = 4, 32, 16
LOWER_BOUND = -5.0
POISON = ChunkKDAConfig(poison=True)
GRAD_NAMES = ("q", "k", "v", "g_raw", "beta_raw", "A_log", "dt_bias", "initial_state")


def _inputs(gen, B, T, n_states, dtype, saturate=False):
    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    q, k, v = draw(B, T, H, K), draw(B, T, H, K), draw(B, T, H, V)
    g_raw, beta_raw = draw(B, T, H, K, scale=1.5), draw(B, T, H)
    if saturate:  # saturated gates must not give NaN
        g_raw[0, 1, 0, :3] = torch.tensor([float("inf"), float("-inf"), 40.0])
    A_log = torch.empty(H).uniform_(0.0, 2.7, generator=gen)  # exp(A_log) in [1, 15]
    dt_bias = torch.randn(H * K, generator=gen) * 0.5
    h0 = torch.randn(n_states, H, K, V, generator=gen)
    return [q, k, v, g_raw, beta_raw, A_log, dt_bias, h0]


def _reference(inputs, *, l2norm=True, beta_sigmoid=True, **kwargs):
    """fp64 composition; +-inf raw gates become +-1e4 (same forward values, finite A_log gradient)."""
    q, k, v, g_raw, beta_raw, A_log, dt_bias, h0 = inputs
    g_raw = g_raw.nan_to_num(posinf=1e4, neginf=-1e4)
    if l2norm:
        q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    beta = torch.sigmoid(beta_raw) if beta_sigmoid else beta_raw
    return kda_chunk(q, k, v, kda_gate(g_raw, A_log, dt_bias, LOWER_BOUND), beta, initial_state=h0, **kwargs)


def _leaves(inputs, dtype=None):
    return [x.detach().to(dtype or x.dtype).requires_grad_(True) for x in inputs]


def _check(name, actual, expected, dtype):
    err = rel_rms(actual, expected)
    assert err <= TOLERANCE[dtype], f"{name}: relative RMS error {err:.3e} > {TOLERANCE[dtype]:.0e} ({dtype})"


def _run_both(inputs, dtype, cu_seqlens=None, config=POISON, **flags):
    """Kernel and fp64 reference on the same inputs with state in/out and chunk states; loss uses o and the
    final state, so every input (the initial state included) receives a gradient. Returns a dict name ->
    (kernel value, reference value)."""
    ours_in, ref_in = _leaves(inputs), _leaves(inputs, torch.float64)
    o, ht, chunks = chunk_kda(
        *ours_in[:7], initial_state=ours_in[7], output_final_state=True, cu_seqlens=cu_seqlens,
        return_chunk_states=True, lower_bound=LOWER_BOUND, config=config, **flags,
    )  # fmt: skip
    ro, rht, rchunks = _reference(
        ref_in, output_final_state=True, cu_seqlens=cu_seqlens, return_chunk_states=True,
        chunk_size=flags.get("chunk_size", 64),
    )  # fmt: skip
    assert o.dtype == dtype and ht.dtype == torch.float32 and chunks.dtype == torch.float32
    gen = torch.Generator().manual_seed(1)
    # the kernel receives d o in o's dtype, so the reference gets that same (rounded) gradient
    do, dht = torch.randn(o.shape, generator=gen).to(dtype), torch.randn(ht.shape, generator=gen)
    ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
    ((ro * do).sum() + (rht * dht).sum()).backward()
    pairs = {"o": (o, ro), "final_state": (ht, rht), "chunk_states": (chunks, rchunks)}
    for name, a, r in zip(GRAD_NAMES, ours_in, ref_in, strict=True):
        assert a.grad is not None and a.grad.dtype == a.dtype, f"d{name}: missing or wrong dtype"
        pairs["d" + name] = (a.grad, r.grad)
    return pairs


def _assert_all(pairs, dtype):
    for name, (actual, expected) in pairs.items():
        assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
        assert torch.isfinite(actual).all(), f"{name}: NaN/inf in kernel output (unwritten or invalid elements)"
        _check(name, actual, expected, dtype)


@pytest.mark.parametrize(("dtype", "chunk_size"), [(torch.float32, 64), (torch.bfloat16, 16)])
def test_dense_batch_forward_backward_states(dtype, chunk_size):
    # T = 70: full chunks and a 6-token tail per row; two rows, four heads, state in and out. Chunks of 16
    # are a single sub-chunk (no off-diagonal blocks in the inverse).
    gen = fresh_generator()
    pairs = _run_both(_inputs(gen, 2, 70, 2, dtype), dtype, chunk_size=chunk_size)
    assert pairs["chunk_states"][0].shape == (2, -(-70 // chunk_size), H, K, V)
    _assert_all(pairs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_forward_backward_states(dtype):
    # Three unequal sequences packed in one row: 70 (chunk + tail), 13 (shorter than a chunk), 47.
    gen = fresh_generator()
    cu = torch.tensor([0, 70, 83, 130], dtype=torch.int32)
    pairs = _run_both(_inputs(gen, 1, 130, 3, dtype, saturate=True), dtype, cu_seqlens=cu)
    assert pairs["chunk_states"][0].shape == (1, 4, H, K, V)
    _assert_all(pairs, dtype)


@pytest.mark.parametrize("intra_solve", ["blocks", "strips"])
@pytest.mark.parametrize(("dtype", "chunk_size"), [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 32),
                                                (torch.bfloat16, 16)])
def test_intra_solves_match_the_reference(intra_solve, dtype, chunk_size):
    # Both ways of forming A_qk and T: four, two and one sub-chunks per chunk, packed sequences with tails and
    # one shorter than a chunk, states in and out, training and inference (where T is written in bf16). The
    # gates are shifted to decay slowly, so that the blocks far below the diagonal of A_kk and T carry weight.
    gen = fresh_generator()
    cu = torch.tensor([0, 70, 83, 130], dtype=torch.int32)
    inputs = _inputs(gen, 1, 130, 3, dtype)
    inputs[3] = inputs[3] - 6.0
    config = ChunkKDAConfig(poison=True, intra_solve=intra_solve)
    pairs = _run_both(inputs, dtype, cu_seqlens=cu, config=config, chunk_size=chunk_size)
    with torch.no_grad():
        o_lean, _ = chunk_kda(
            *inputs[:7], initial_state=inputs[7], cu_seqlens=cu, chunk_size=chunk_size, lower_bound=LOWER_BOUND,
            config=config,
        )  # fmt: skip
    pairs["o (no grad)"] = (o_lean, pairs["o"][1])
    _assert_all(pairs, dtype)


@pytest.mark.parametrize("fields", [dict(bwd_state_f16=False), dict(f16_states=False)])
def test_backward_without_fp16_products_or_fp16_states(fields):
    # bf16 inputs take fp16 products in the backward state kernel and keep the backward's states and state
    # gradients as fp16 tiles with column factors by default; the tf32 products (asked for, or pipelined loops;
    # then the state gradients are fp32) and fp32 states must hold the same tolerance, with a tail chunk and
    # states in and out.
    gen = fresh_generator()
    config = ChunkKDAConfig(poison=True, **fields)
    _assert_all(_run_both(_inputs(gen, 2, 70, 2, torch.bfloat16), torch.bfloat16, config=config), torch.bfloat16)


@pytest.mark.parametrize(
    ("dtype", "fields", "expected"),
    [
        (torch.bfloat16, dict(), [torch.float16, torch.float16]),
        (torch.bfloat16, dict(f16_states=False), [torch.float32, torch.float32]),
        (torch.bfloat16, dict(bwd_state_f16=False), [torch.float16, torch.float32]),
        (torch.float32, dict(), [torch.float32, torch.float32]),
    ],
)
def test_backward_states_are_fp16_only_where_the_state_kernels_form_fp16_products(
    monkeypatch, dtype, fields, expected
):
    # The [chunks, H, K, V] buffers of one backward: the recomputed states, then their gradients.
    import k3.kernels.kda.chunk as chunk_module

    made, alloc = [], chunk_module._alloc

    def recording_alloc(shape, dtype_, device, poison):
        if len(shape) == 4 and shape[1:] == (H, K, V):
            made.append(dtype_)
        return alloc(shape, dtype_, device, poison)

    monkeypatch.setattr(chunk_module, "_alloc", recording_alloc)
    leaves = _leaves(_inputs(fresh_generator(), 1, 40, 1, dtype))
    o, _ = chunk_kda(*leaves[:7], lower_bound=LOWER_BOUND, config=ChunkKDAConfig(poison=True, **fields))
    made.clear()  # the forward's allocations
    o.float().sum().backward()
    assert made == expected
    assert all(torch.isfinite(x.grad).all() for x in leaves[:7])


def test_backward_state_kernel_takes_fp16_products_only_unpipelined_on_fp16_tiles():
    from types import SimpleNamespace

    from k3.kernels.kda.chunk import _bwd_state_f16

    fp16, fp32 = torch.zeros(1, dtype=torch.float16), torch.zeros(1)
    tf32, ieee = SimpleNamespace(prec=3), SimpleNamespace(prec=2)
    assert _bwd_state_f16(ChunkKDAConfig(), fp16, fp16, tf32)
    assert not _bwd_state_f16(ChunkKDAConfig(bwd_state_f16=False), fp16, fp16, tf32)
    assert not _bwd_state_f16(ChunkKDAConfig(bwd_state_num_stages=2), fp16, fp16, tf32)
    assert not _bwd_state_f16(ChunkKDAConfig(), fp32, fp32, tf32)
    assert not _bwd_state_f16(ChunkKDAConfig(), fp16, fp16, ieee)


@pytest.mark.parametrize(
    "tiles",
    [
        dict(
            block_k=16, block_k_fp32=16, gate_block_k=16, block_v=16, bwd_block_k=16, bwd_block_v=16,
            bwd_wy_k_block_v=16, bwd_intra_block_k=16, state_block_v=16, state_block_v_fp32=16,
            bwd_state_block_v=16, bwd_finish_block_k=16, diag_block_k=16, solve_block_k=16,
        ),
        # the three backward K tilings differ; the gate backward on one tile of the whole K; the strips solve
        dict(
            block_k=64, block_k_fp32=32, bwd_block_k=16, bwd_intra_block_k=32, bwd_finish_block_k=128,
            bwd_finish_num_warps=4, intra_solve="strips", intra_block_k=16,
        ),
    ],
)
def test_tiles_smaller_than_the_head_dims(tiles):
    # Several K and V tiles per kernel: partial sums over tiles (dbeta, dA_kk, the K loops) must add up.
    gen = fresh_generator()
    inputs = _inputs(gen, 1, 70, 1, torch.bfloat16)
    ours_in, ref_in = _leaves(inputs), _leaves(inputs, torch.float64)
    config = ChunkKDAConfig(poison=True, **tiles)
    o, ht = chunk_kda(
        *ours_in[:7], initial_state=ours_in[7], output_final_state=True, lower_bound=LOWER_BOUND, config=config
    )
    ro, rht = _reference(ref_in, output_final_state=True)
    with torch.no_grad():  # the inference path, with its own WY tiling (block_k)
        o_lean, _ = chunk_kda(*inputs[:7], initial_state=inputs[7], lower_bound=LOWER_BOUND, config=config)
    do = torch.randn(o.shape, generator=gen).to(o.dtype)
    ((o.double() * do).sum() + ht.double().sum()).backward()
    ((ro * do).sum() + rht.sum()).backward()
    pairs = {"o": (o, ro), "o (no grad)": (o_lean, ro), "final_state": (ht, rht)}
    pairs.update({"d" + n: (a.grad, r.grad) for n, a, r in zip(GRAD_NAMES, ours_in, ref_in, strict=True)})
    _assert_all(pairs, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_states", [False, True])
def test_inference_forward_without_grad(dtype, chunk_states):
    # Under no_grad the forward keeps its intermediates in bf16 (16-bit inputs) and saves nothing; the
    # packed varlen batch with state in and out must still match the reference.
    gen = fresh_generator()
    cu = torch.tensor([0, 70, 83, 130], dtype=torch.int32)
    inputs = _inputs(gen, 1, 130, 3, dtype, saturate=True)
    with torch.no_grad():
        out = chunk_kda(
            *inputs[:7], initial_state=inputs[7], output_final_state=True, cu_seqlens=cu,
            return_chunk_states=chunk_states, lower_bound=LOWER_BOUND, config=POISON,
        )  # fmt: skip
    assert not out[0].requires_grad
    ref = _reference([x.double() for x in inputs], output_final_state=True, cu_seqlens=cu,
                     return_chunk_states=chunk_states)  # fmt: skip
    names = ("o", "final_state", "chunk_states")[: len(out)]
    _assert_all({name: (a, r) for name, a, r in zip(names, out, ref, strict=True)}, dtype)


def test_flags_off_smaller_chunks_custom_scale_and_no_state():
    # Pre-normalised q/k and pre-activated beta passed through untouched; 32-token chunks; no state given
    # or returned. An empty sequence in the middle must not disturb its neighbours.
    dtype = torch.float32
    gen = fresh_generator()
    q, k, v, g_raw, beta_raw, A_log, dt_bias, _ = _inputs(gen, 1, 45, 1, dtype)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    beta = torch.rand(1, 45, H, generator=gen)
    cu = torch.tensor([0, 40, 40, 45])
    ours_in = _leaves([q, k, v, g_raw, beta, A_log, dt_bias])
    ref_in = _leaves([q, k, v, g_raw, beta, A_log, dt_bias], torch.float64)
    o, final = chunk_kda(
        *ours_in, scale=0.3, cu_seqlens=cu, use_qk_l2norm=False, use_beta_sigmoid=False, chunk_size=32,
        lower_bound=LOWER_BOUND, config=POISON,
    )  # fmt: skip
    assert final is None
    ro, _ = _reference(ref_in + [None], l2norm=False, beta_sigmoid=False, scale=0.3, cu_seqlens=cu, chunk_size=32)
    do = torch.randn(o.shape, generator=gen)
    (o.double() * do).sum().backward()
    (ro * do).sum().backward()
    pairs = {"o": (o, ro)}
    pairs.update({"d" + n: (a.grad, r.grad) for n, a, r in zip(GRAD_NAMES, ours_in, ref_in, strict=False)})
    _assert_all(pairs, dtype)


@pytest.mark.parametrize(("precision", "tolerance"), [("bf16", 3e-2), ("ieee", 5e-3)])
def test_precision_modes_forward(precision, tolerance):
    # bf16 inputs: single bf16-operand products are only about 8 bits accurate, exact fp32 products leave
    # just the input/output rounding.
    dtype = torch.bfloat16
    inputs = _inputs(fresh_generator(), 1, 40, 1, dtype)
    o, final = chunk_kda(
        *inputs[:7], initial_state=inputs[7], output_final_state=True, lower_bound=LOWER_BOUND,
        config=ChunkKDAConfig(precision=precision, poison=True),
    )  # fmt: skip
    ro, rht = _reference([x.double() for x in inputs], output_final_state=True)
    for name, actual, expected in (("o", o, ro), ("final_state", final, rht)):
        err = rel_rms(actual, expected)
        assert err <= tolerance, f"{name} with precision={precision}: relative RMS error {err:.3e} > {tolerance}"


def test_empty_input_passes_the_state_through():
    z = torch.zeros(1, 0, H, K)
    h0 = torch.randn(1, H, K, V)
    o, final, chunks = chunk_kda(
        z, z, torch.zeros(1, 0, H, V), z, torch.zeros(1, 0, H), torch.zeros(H), torch.zeros(H * K),
        initial_state=h0, output_final_state=True, return_chunk_states=True,
    )  # fmt: skip
    assert o.shape == (1, 0, H, V) and chunks.shape == (1, 0, H, K, V)
    torch.testing.assert_close(final, h0)


def _good(B=1, T=8):
    return dict(
        q=torch.zeros(B, T, H, K), k=torch.zeros(B, T, H, K), v=torch.zeros(B, T, H, V),
        g_raw=torch.zeros(B, T, H, K), beta_raw=torch.zeros(B, T, H), A_log=torch.zeros(H),
        dt_bias=torch.zeros(H * K),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(q=torch.zeros(8, H, K)), rf"q must be \[B, T, H, K\], got shape \(8, {H}, {K}\)"),
        (dict(k=torch.zeros(1, 8, H, K + 1)), rf"k must have the shape of q \(1, 8, {H}, {K}\), got \(1, 8, {H}, {K + 1}\)"),
        (dict(g_raw=torch.zeros(1, 7, H, K)), r"g_raw must have the shape of q"),
        (dict(v=torch.zeros(1, 8, H + 1, V)), rf"v must be \[B, T, H, V\] with B, T, H = 1, 8, {H}"),
        (dict(beta_raw=torch.zeros(1, 8, H, 1)), rf"beta_raw must be \[B, T, H\] = \(1, 8, {H}\)"),
        (dict(A_log=torch.zeros(H + 1)), rf"A_log must have shape \[H\]=\[{H}\], got \({H + 1},\)"),
        (dict(dt_bias=torch.zeros(H, K)), rf"dt_bias must have shape \[H\*K\]=\[{H * K}\], got \({H}, {K}\)"),
        (dict(v=torch.zeros(1, 8, H, V, dtype=torch.float64)), r"v must be float32, bfloat16 or float16"),
        (dict(beta_raw=torch.zeros(1, 8, H, dtype=torch.int32)), r"beta_raw must be float32, bfloat16"),
        (dict(lower_bound=-6.0), r"lower_bound must be negative with 15 \* \|lower_bound\| <= 80"),
        (dict(lower_bound=0.0), r"lower_bound must be negative"),
        (dict(chunk_size=48), r"chunk_size must be one of \(16, 32, 64\), got 48"),
        (dict(scale=0.0), r"scale must be a positive finite number, got 0.0"),
        (dict(initial_state=torch.zeros(2, H, K, V)), rf"initial_state must be \[B, H, K, V\] = \(1, {H}, {K}, {V}\)"),
        (
            dict(cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(1, H, K, V)),
            rf"initial_state must be \[N \(number of sequences\), H, K, V\] = \(2, {H}, {K}, {V}\)",
        ),
        (dict(cu_seqlens=torch.tensor([0, 3, 9])), r"cu_seqlens must start at 0 and end at T = 8"),
        (dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), r"cu_seqlens must be non-decreasing"),
    ],
)
def test_bad_inputs_are_rejected_with_the_field_named(change, message):
    args = _good()
    args.update(change)
    with pytest.raises(ValueError, match=message):
        chunk_kda(**args)


def test_cu_seqlens_needs_a_packed_batch():
    with pytest.raises(ValueError, match=r"cu_seqlens requires a packed batch with B == 1, got B = 2"):
        chunk_kda(**_good(B=2), cu_seqlens=torch.tensor([0, 8]))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_k", 24, r"ChunkKDAConfig.block_k must be a power of two >= 16, got 24"),
        ("block_k_fp32", 8, r"ChunkKDAConfig.block_k_fp32 must be a power of two >= 16, got 8"),
        ("state_block_v", 8, r"ChunkKDAConfig.state_block_v must be a power of two >= 16, got 8"),
        ("bwd_intra_block_k", 48, r"ChunkKDAConfig.bwd_intra_block_k must be a power of two >= 16, got 48"),
        ("bwd_wy_k_block_v", 96, r"ChunkKDAConfig.bwd_wy_k_block_v must be a power of two >= 16, got 96"),
        ("bwd_intra_num_warps", 6, r"ChunkKDAConfig.bwd_intra_num_warps must be one of 1, 2, 4, 8, 16, got 6"),
        ("num_warps", 3, r"ChunkKDAConfig.num_warps must be one of 1, 2, 4, 8, 16, got 3"),
        ("bwd_wy_k_num_warps", 12, r"ChunkKDAConfig.bwd_wy_k_num_warps must be one of 1, 2, 4, 8, 16, got 12"),
        ("state_num_stages", 0, r"ChunkKDAConfig.state_num_stages must be an int from 1 to 4, got 0"),
        ("bwd_intra_num_stages", 5, r"ChunkKDAConfig.bwd_intra_num_stages must be an int from 1 to 4, got 5"),
        ("state_num_stages_few_programs", 5, r"ChunkKDAConfig.state_num_stages_few_programs must be an int from 1 to 4"),
        ("gate_block_k", 24, r"ChunkKDAConfig.gate_block_k must be a power of two >= 16, got 24"),
        ("intra_block_k", 8, r"ChunkKDAConfig.intra_block_k must be a power of two >= 16, got 8"),
        ("diag_block_k", 48, r"ChunkKDAConfig.diag_block_k must be a power of two >= 16, got 48"),
        ("solve_block_k", 8, r"ChunkKDAConfig.solve_block_k must be a power of two >= 16, got 8"),
        ("recompute", 1, r"ChunkKDAConfig.recompute must be a bool, got 1"),
        ("bwd_state_f16", "no", r"ChunkKDAConfig.bwd_state_f16 must be a bool, got 'no'"),
        ("f16_states", 1, r"ChunkKDAConfig.f16_states must be a bool, got 1"),
        ("poison", "yes", r"ChunkKDAConfig.poison must be a bool, got 'yes'"),
        ("bwd_finish_block_k", 40, r"ChunkKDAConfig.bwd_finish_block_k must be a power of two >= 16, got 40"),
        ("bwd_finish_num_warps", 32, r"ChunkKDAConfig.bwd_finish_num_warps must be one of 1, 2, 4, 8, 16, got 32"),
        ("inverse_num_warps", 0, r"ChunkKDAConfig.inverse_num_warps must be one of 1, 2, 4, 8, 16, got 0"),
        ("solve_num_warps", 3, r"ChunkKDAConfig.solve_num_warps must be one of 1, 2, 4, 8, 16, got 3"),
        ("intra_solve", "rows", r"ChunkKDAConfig.intra_solve must be one of \('strips', 'blocks'\), got 'rows'"),
        ("precision", "fp8", r"ChunkKDAConfig.precision must be one of \('auto', 'bf16', 'tf32', 'split', 'ieee'\), got 'fp8'"),
    ],
)
def test_config_fields_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        ChunkKDAConfig(**{field: value})


def test_state_tiles_narrow_when_few_sequences_would_leave_sms_idle(monkeypatch):
    # One program per (sequence, head, V tile): the widest tile when that fills at least half of 132 SMs,
    # halved (down to 16) otherwise; no narrowing off the GPU (no SM count). Tiles of 64 or less get at most 4
    # warps (faster at 32 and 64; at 16, Triton 3.6's tf32 products at 8 warps made illegal memory accesses on
    # an H200); 128-wide tiles keep the warps asked for.
    import k3.kernels.kda.chunk as chunk_module

    cpu = torch.device("cpu")
    monkeypatch.setattr(chunk_module, "_sm_count", lambda device: 132)
    assert chunk_module._state_launch(128, 8, 128, 128, cpu) == (128, 8)  # 8 x 16 heads: 128 programs
    assert chunk_module._state_launch(128, 8, 64, 128, cpu) == (64, 4)  # 2 x 32 heads: 64 -> 128 programs
    assert chunk_module._state_launch(64, 8, 32, 128, cpu) == (32, 4)  # 1 x 32 heads: 64 -> 128 programs
    assert chunk_module._state_launch(64, 8, 2, 128, cpu) == (16, 4)
    assert chunk_module._state_launch(16, 2, 1, 128, cpu) == (16, 2)
    monkeypatch.setattr(chunk_module, "_sm_count", lambda device: 0)
    assert chunk_module._state_launch(128, 8, 1, 128, cpu) == (128, 8)


def test_inference_state_kernel_pipelines_deeper_when_programs_are_fewer_than_sms(monkeypatch):
    import k3.kernels.kda.chunk as chunk_module

    cpu, cfg = torch.device("cpu"), ChunkKDAConfig(state_num_stages=2, state_num_stages_few_programs=3)
    monkeypatch.setattr(chunk_module, "_sm_count", lambda device: 132)
    assert chunk_module._forward_state_stages(cfg, False, 128, cpu) == 3  # one sequence, 32 heads, 4 V tiles
    assert chunk_module._forward_state_stages(cfg, False, 256, cpu) == 2  # two sequences
    assert chunk_module._forward_state_stages(cfg, True, 128, cpu) == cfg.state_num_stages_fp32  # training


def test_a_launch_out_of_shared_memory_is_retried_with_fewer_pipeline_stages():
    # Triton refuses a kernel that needs more shared memory than the GPU has when it loads it, before anything
    # runs (the fused forward state kernel with 128-wide V tiles at 3 stages: 237 KB on a 227 KB H200); the
    # launch then goes again with one stage fewer, and the error stands only when one stage does not fit.
    from triton.runtime.errors import OutOfResources

    import k3.kernels.kda.chunk as chunk_module

    tried = []

    def launch(stages, fits=2):
        tried.append(stages)
        if stages > fits:
            raise OutOfResources(237568, 232448, "shared memory")
        return stages

    assert chunk_module._launch_within_shared_memory(launch, 3) == 2 and tried == [3, 2]
    tried.clear()
    assert chunk_module._launch_within_shared_memory(launch, 1) == 1 and tried == [1]
    tried.clear()
    with pytest.raises(OutOfResources):
        chunk_module._launch_within_shared_memory(lambda s: launch(s, fits=0), 2)
    assert tried == [2, 1]
    # with a key, the depth that fitted is remembered: the next call launches it directly
    key = ("test", object())
    tried.clear()
    assert chunk_module._launch_within_shared_memory(launch, 3, key) == 2 and tried == [3, 2]
    tried.clear()
    assert chunk_module._launch_within_shared_memory(launch, 3, key) == 2 and tried == [2]
    chunk_module._STAGES_THAT_FIT.pop(key)


@pytest.mark.parametrize("flags", [dict(), dict(use_qk_l2norm=False), dict(use_beta_sigmoid=False)])
def test_training_intermediates_are_fp16_only_where_bounded(flags):
    # A_qk, w, qg, kd are bounded by 1 only with unit q, k and beta in (0, 1): then fp16, otherwise fp32.
    inputs = _inputs(fresh_generator(), 1, 40, 1, torch.bfloat16)
    leaves = _leaves(inputs)
    o, _ = chunk_kda(*leaves[:7], lower_bound=LOWER_BOUND, **flags)
    node = o.grad_fn
    while not hasattr(node, "saved_tensors"):
        node = node.next_functions[0][0]
    fp16 = sum(t.dtype == torch.float16 for t in node.saved_tensors if t is not None)
    assert fp16 == (0 if flags else 4)


def test_recompute_keeps_only_the_inputs_and_gives_the_same_gradients():
    # The backward reruns the forward's chunk-parallel stages on the saved inputs: same kernels, same inputs,
    # so the gradients must be bit-identical to the ones computed from the kept intermediates.
    gen = fresh_generator()
    inputs = _inputs(gen, 1, 70, 1, torch.bfloat16)
    do = torch.randn(1, 70, H, V, generator=gen).to(torch.bfloat16)
    grads, saved_bytes = [], []
    for recompute in (False, True):
        leaves = _leaves(inputs)
        o, ht = chunk_kda(
            *leaves[:7], initial_state=leaves[7], output_final_state=True, lower_bound=LOWER_BOUND,
            config=ChunkKDAConfig(poison=True, recompute=recompute),
        )  # fmt: skip
        node = o.grad_fn  # o is a view of the autograd function's output
        while not hasattr(node, "saved_tensors"):
            node = node.next_functions[0][0]
        saved_bytes.append(sum(t.numel() * t.element_size() for t in node.saved_tensors if t is not None))
        ((o.float() * do.float()).sum() + ht.sum()).backward()
        grads.append([x.grad for x in leaves])
    for name, a, b in zip(GRAD_NAMES, *grads, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"d{name} differs with recompute"
    input_bytes = sum(t.numel() * t.element_size() for t in inputs)
    assert saved_bytes[1] == input_bytes < saved_bytes[0]


def test_the_benchmarks_error_measure_holds_our_kernels_and_catches_a_wrong_one():
    # k3.kernels.bench checks our kernels and reports the peer's errors with kda_chunk_errors: all nine
    # numbers (output with and without autograd, seven gradients) within tolerance for ours, and a kernel with another gate lower
    # bound must show up in the output's error. Eight heads: dA_log has one entry per head, a sum over all
    # tokens of terms that largely cancel, with an absolute error of about 5e-4. With two heads, some draws
    # of A_log make both entries small (0.03 and 0.11 against 0.3 for most) and the relative error passed
    # 5e-3 for 2 of 60 draws; with eight heads the worst of 40 draws was 2.0e-3.
    from k3.kernels.bench import KDA_GRAD_NAMES, _kda_inputs, kda_chunk_errors
    from k3.kernels.dispatch import kda_chunk_raw_reference

    inputs = _kda_inputs(1, 70, 8, K, torch.device("cpu"), torch.bfloat16)
    errors = kda_chunk_errors(lambda *x: chunk_kda(*x, lower_bound=LOWER_BOUND, config=POISON)[0], inputs)
    assert list(errors) == ["o", "o (no grad)", *KDA_GRAD_NAMES]
    assert all(e <= TOLERANCE[torch.bfloat16] for e in errors.values()), errors
    wrong = kda_chunk_errors(lambda *x: kda_chunk_raw_reference(*x, lower_bound=-2.0)[0], inputs)
    assert wrong["o"] > 10 * TOLERANCE[torch.bfloat16] and wrong["o (no grad)"] > 10 * TOLERANCE[torch.bfloat16]
    # the exact function with a bf16 output: the fp32 parameters' gradients must match to fp32 rounding, so the
    # reference has to receive the same bf16-rounded d o as the implementation (an fp64 one moved dA_log by
    # up to 5e-3 on its own)
    exact = kda_chunk_errors(
        lambda *x: kda_chunk_raw_reference(*(t.double() for t in x), lower_bound=LOWER_BOUND)[0].to(x[2].dtype),
        inputs,
    )
    assert exact["dA_log"] < 1e-5 and exact["ddt_bias"] < 1e-5, exact


# two interpreter runs of the bench's check at 1·160·8·128 (K = 128) take about 105 s on two idle cores
@pytest.mark.timeout(300)
def test_the_benchmark_checks_ours_and_reports_the_peer_on_the_same_inputs(monkeypatch):
    # The KDA-chunk section without its timings, on the CPU: our nine numbers become checks, the peer's are
    # reported (a peer with fla's signature, here the torch reference), and a peer that raises is only reported.
    from k3.kernels import bench as bench_module
    from k3.kernels.dispatch import kda_chunk_raw_reference

    def peer(q, k, v, g, beta, A_log, dt_bias, lower_bound, **flags):
        assert flags == dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, safe_gate=True)
        return kda_chunk_raw_reference(q, k, v, g, beta, A_log, dt_bias, lower_bound=lower_bound)[0].to(q.dtype), None

    def broken_peer(*args, **kwargs):
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(bench_module, "_time_kda_chunk", lambda *args: None)
    for fake, reported in ((peer, True), (broken_peer, False)):
        monkeypatch.setattr(bench_module, "_fla", lambda fake=fake: (fake, None))
        b = bench_module.Bench(quick=True, iters=1, only=["kda_chunk"])
        b.dev = torch.device("cpu")
        bench_module.bench_kda_chunk(b)
        names = [f"kda_chunk {n} (bf16)" for n in ("o", "o (no grad)", *bench_module.KDA_GRAD_NAMES)]
        assert [c["check"] for c in b.report.checks] == names
        assert all(c["ok"] for c in b.report.checks), b.report.checks
        assert ("fla chunk_kda" in b.report.peer_errors) == reported
        if reported:  # the torch reference in bf16 out: its errors are the output's rounding, far below 5e-3
            assert max(b.report.peer_errors["fla chunk_kda"].values()) < 5e-3
