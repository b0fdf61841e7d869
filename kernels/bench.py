"""Kernel benchmark: ``python -m k3.kernels.bench [--quick] [--json FILE] [--only NAME ...] [--tune] [--kda-shapes ...]``.

One call, on a CUDA machine, that

1. checks every kernel on the GPU against its reference on small shapes (relative RMS error, NaN check); for
   the chunked KDA, the output and all seven input gradients against an fp64 reference, and the peer's
   errors on the same inputs are reported beside ours (``peer_errors`` in the JSON);
2. measures the machine's ceilings in the same process: bandwidth from a large device-to-device copy
   (bytes read + written), bf16 matrix throughput from an 8192^3 product;
3. times every kernel next to a peer, with CUDA events (warm-up, then the median of >= 20 runs), and prints a
   table (kernel, shape, ours ms, peer ms, peer/ours, achieved TB/s or TFLOP/s, % of the measured ceiling);
   ``--json FILE`` writes everything (checks, ceilings, rows) as JSON, rewritten after every check and row,
   so a run stopped part-way keeps what it measured.

Inference-style rows (decode steps, forward-only kernels) are timed as CUDA-graph replays, ours and the peer
alike: that is GPU time without the host's launch overhead (tens of microseconds per Triton launch, as much as
a whole decode kernel), and it is how a serving engine runs its decode step. Training rows (forward+backward
through autograd) run eagerly. The "note" column of the JSON says which.

Peers: fla-core's ``chunk_kda`` (safe gate, lower bound -5, gate + L2 norm + beta sigmoid in the kernel) and
``fused_recurrent_kda`` (imported lazily; "peer unavailable" when fla is not installed);
``torch.nn.functional.scaled_dot_product_attention`` for MLA decode; ``torch._grouped_mm`` for the grouped
GEMM; the plain torch definition (the reference) for SiTU-GLU and the short convolution.

Shapes (bf16 activations, fp32 states) and what the metric counts:

* KDA chunk, B x T x H x D = 2x8192x32x128, 1x32768x32x128, 8x4096x16x128 (``--kda-shapes`` picks others),
  forward and forward+backward.
  Nominal FLOPs per token and head: forward ``6 K V + 6 C K + 4 C V`` (C = 64: state read-out, ``w S``,
  state update; ``A_kk``, ``A_qk``, ``w``; ``u``, ``A_qk v_new``), backward twice that.
* KDA decode, N = 256 sequences, H = 32, K = V = 128, states in a 512-slot pool: bytes = fp32 state read +
  written, plus q, k, v, g, beta, o. The peer writes its final state to a fresh tensor (same traffic).
* Short conv decode, N = 256, D = 3 * 32 * 128 channels (q, k, v together), W = 4.
* MLA decode, B = 8 sequences x 32768 cached tokens, H = 16 query heads (a 96-head layer split over 6 GPUs,
  to the nearest power of two), page size 64, Tq = 1 and Tq = 4 (speculative verification); bytes = cache
  rows read (576 bf16 each) + queries + output. The SDPA peer attends over the same latents already gathered
  into contiguous [B, 1, L, 576] keys / [B, 1, L, 512] values (MQA via ``enable_gqa``), i.e. without paging.
* SiTU-GLU, N = 16384 rows, I = 3072: forward bytes = 2I read + I written per row; backward 3I + 2I.
* Grouped GEMM, the routed experts' up-projection: E = 16 experts, M = 32768 routed tokens (uneven split),
  K = 3584 (latent), N = 6144 (2 x 3072); weights in the model's [E, N, K] layout, passed transposed.
  FLOPs 2 M K N forward, 3x that forward+backward. "ours" is the Triton kernel; ``grouped_mm`` itself picks
  ``torch._grouped_mm`` for bf16 on sm90 (the peer), so the table says where the Triton kernel stands.

* Model (section ``model``, :mod:`k3.kernels.bench_model`): the ``bench-1b`` preset in bf16 with seeded random
  weights; logits of forward, prefill and decode through the kernels against the reference path (switched
  in-process with ``K3_KERNELS``), and prefill / decode tokens/s at batch 1 and 64 (eager).

``--quick`` shrinks every shape (smoke run). ``--tune`` also sweeps launch parameters of our kernels and
prints the fastest. On a machine without CUDA the command exits with status 2 and says so.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["main", "Row", "time_ms"]

CHECK_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-3}


@dataclass
class Row:
    """One line of the table."""

    kernel: str
    shape: str
    ours_ms: float | None
    peer: str
    peer_ms: float | None
    metric: float | None = None  # achieved TB/s or TFLOP/s of ours
    unit: str = ""
    ceiling_pct: float | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """peer time / our time: > 1 means ours is faster."""
        if self.ours_ms and self.peer_ms:
            return self.peer_ms / self.ours_ms
        return None


@dataclass
class Report:
    device: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    ceilings: dict[str, float] = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    tuning: list[dict] = field(default_factory=list)
    peer_errors: dict[str, dict[str, float]] = field(default_factory=dict)
    """Peer -> its relative RMS errors against our reference on the check inputs (reported, not checked)."""


# ------------------------------------------------------------------------------------------------ timing
def time_ms(fn: Callable[[], object], *, warmup: int = 5, iters: int = 20, graph: bool = False) -> float:
    """Median time of ``fn`` on the current stream in milliseconds (CUDA events around each call).

    With ``graph=True`` the call is captured once into a CUDA graph and the replays are timed: that is GPU time
    alone, without the host's launch overhead (a few tens of microseconds per Triton launch), and it is how a
    serving engine runs its decode step.
    """
    run = fn
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compile, allocate) outside the capture
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        run()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def _rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-30))


class Bench:
    """One benchmark run. With ``json_path`` the report is rewritten after every check, row and tuning result,
    so a run stopped part-way (a time limit, say: the peer's first autotuning takes minutes per shape) keeps
    everything it measured."""

    def __init__(self, quick: bool, iters: int, only: list[str] | None, json_path: str | None = None):
        self.quick, self.iters, self.only = quick, iters, only
        self.json_path = json_path
        self.kda_shapes: list[tuple[int, int, int, int]] | None = None  # None: KDA_CHUNK_SHAPES
        self.report = Report()
        self.dev = torch.device("cuda")

    def save(self) -> None:
        _write_json(self.report, self.json_path)

    def wants(self, name: str) -> bool:
        return not self.only or any(o in name for o in self.only)

    def time(self, fn, graph: bool = False) -> float:
        return time_ms(fn, warmup=3 if self.quick else 10, iters=self.iters, graph=graph)

    def check(self, name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
        self.check_error(name, _rel_rms(actual, expected), dtype)

    def check_error(self, name: str, err: float, dtype: torch.dtype) -> None:
        """Records a relative RMS error against the tolerance of ``dtype`` (a NaN or inf error fails)."""
        ok = err <= CHECK_TOL[dtype]
        self.report.checks.append({"check": name, "rel_rms": err, "tolerance": CHECK_TOL[dtype], "ok": bool(ok)})
        self.save()
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: rel RMS {err:.2e} (tol {CHECK_TOL[dtype]:.0e})")

    def try_time(self, fn, what: str, graph: bool = False) -> float | None:
        """Time a peer; a peer that cannot run these inputs gives None (and says why) instead of ending the section."""
        try:
            return self.time(fn, graph)
        except Exception as exc:
            print(f"  {what} could not run: {type(exc).__name__}: {exc}")
            return None

    def guarded(self, name: str, fn: Callable[[], None]) -> None:
        """Run one section; an exception is reported as a failed check instead of ending the benchmark."""
        if not self.wants(name):
            return
        try:
            fn()
        except Exception as exc:  # a broken kernel must show in the report, not abort the other sections
            traceback.print_exc()
            self.report.checks.append({"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            self.save()
            print(f"  [FAIL] {name}: {type(exc).__name__}: {exc}")

    def add(self, row: Row, bytes_moved: float | None = None, flops: float | None = None) -> None:
        if row.ours_ms:
            if bytes_moved is not None:
                row.metric, row.unit = bytes_moved / row.ours_ms / 1e9, "TB/s"
                row.ceiling_pct = 100 * row.metric / self.report.ceilings["copy_TBps"]
            elif flops is not None:
                row.metric, row.unit = flops / row.ours_ms / 1e9, "TFLOP/s"
                row.ceiling_pct = 100 * row.metric / self.report.ceilings["bf16_mm_TFLOPs"]
        self.report.rows.append(row)
        self.save()
        achieved = ""
        if row.metric:
            achieved = f", {row.metric:.2f} {row.unit}"
            if row.ceiling_pct is not None:
                achieved += f" ({row.ceiling_pct:.0f}% of ceiling)"
        print(f"  {row.kernel} {row.shape}: ours {_fmt(row.ours_ms)} ms, {row.peer} {_fmt(row.peer_ms)} ms" + achieved)

    # --------------------------------------------------------------------------------------------- ceilings
    def ceilings(self) -> None:
        n = (1 << 26) if self.quick else (1 << 28)  # fp32 elements: 256 MiB / 1 GiB
        a = torch.empty(n, dtype=torch.float32, device=self.dev).normal_()
        b = torch.empty_like(a)
        ms = self.time(lambda: b.copy_(a))
        self.report.ceilings["copy_TBps"] = 2 * a.numel() * 4 / ms / 1e9
        a = b = None  # free 2 GiB before the matmul
        s = 4096 if self.quick else 8192
        x = torch.randn(s, s, dtype=torch.bfloat16, device=self.dev)
        y = torch.randn(s, s, dtype=torch.bfloat16, device=self.dev)
        ms = self.time(lambda: x @ y)
        self.report.ceilings["bf16_mm_TFLOPs"] = 2 * s**3 / ms / 1e9
        print(f"ceilings: copy {self.report.ceilings['copy_TBps']:.2f} TB/s, "
              f"bf16 matmul {self.report.ceilings['bf16_mm_TFLOPs']:.0f} TFLOP/s")


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


# fla-core's chunk_kda as it is compared with ours: safe gate, lower bound -5, gate, L2 norm and beta
# sigmoid inside its kernels (the same work our chunk_kda does)
FLA_CHUNK_KDA_KWARGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                            safe_gate=True, lower_bound=-5.0)


def _fla():
    """fla-core's KDA ops, or None when fla is not installed (imported lazily: it is an optional peer)."""
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except ImportError:
        return None
    return chunk_kda, fused_recurrent_kda


# ------------------------------------------------------------------------------------------------- KDA
def _kda_inputs(B, T, H, K, dev, dtype=torch.bfloat16, requires_grad=False):
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)
        return t.requires_grad_(requires_grad)

    q, k, v, g_raw = r(B, T, H, K), r(B, T, H, K), r(B, T, H, K), r(B, T, H, K)
    beta_raw = r(B, T, H)
    A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
    dt_bias = torch.randn(H * K, device=dev) * 0.1
    return q, k, v, g_raw, beta_raw, A_log, dt_bias


KDA_CHUNK_SHAPES = [(2, 8192, 32, 128), (1, 32768, 32, 128), (8, 4096, 16, 128)]
KDA_GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias")


def kda_chunk_errors(fn: Callable[..., torch.Tensor], inputs: tuple, seed: int = 1) -> dict[str, float]:
    """Relative RMS errors of a chunked-KDA implementation's output and of its seven input gradients, against
    the fp64 reference (:func:`k3.kernels.dispatch.kda_chunk_raw_reference`) on the same inputs.

    ``fn(q, k, v, g_raw, beta_raw, A_log, dt_bias)`` returns the output ``o`` (gate, L2 norm and beta sigmoid
    applied inside, lower bound -5). ``"o (no grad)"`` is the output of a call under ``torch.no_grad()``: the
    inference path, which may keep its intermediates in lower precision than the training path that the
    gradients go through, and which the benchmark's "fwd" rows time. The same measurement serves our kernels
    (checked against the tolerance) and the peer (reported), so both are held to one reference; fp64 because
    the ``A_log`` and ``dt_bias`` gradients sum terms over all tokens that largely cancel, and an fp32
    reference's own error is of the order of the tolerance there.
    """
    from k3.kernels.dispatch import kda_chunk_raw_reference

    ref_leaves = [t.detach().double().requires_grad_() for t in inputs]
    o_ref, _ = kda_chunk_raw_reference(*ref_leaves)
    gen = torch.Generator(device=o_ref.device).manual_seed(seed)
    # the implementation receives d o in its output dtype, so the reference gets that same rounded gradient:
    # with an fp64 one, bf16 rounding alone moved dA_log (one sum per head) by up to 5.1e-3 at 1·512·4·128
    do = torch.randn(o_ref.shape, generator=gen, device=o_ref.device).to(inputs[2].dtype)
    o_ref.backward(do.double())
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    o = fn(*leaves)
    o.backward(do.to(o.dtype))
    errors = {"o": _rel_rms(o, o_ref)}
    with torch.no_grad():
        errors["o (no grad)"] = _rel_rms(fn(*inputs), o_ref)
    for name, ours, ref in zip(KDA_GRAD_NAMES, leaves, ref_leaves, strict=True):
        errors[name] = _rel_rms(ours.grad, ref.grad) if ours.grad is not None else float("inf")
    return errors


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``"BxTxHxD"`` -> ``(B, T, H, D)``, four positive integers."""
    parts = text.lower().split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise ValueError(f"bad shape {text!r}: expected BxTxHxD with four positive integers, e.g. 2x8192x32x128")
    return shape


def bench_kda_chunk(bench: Bench) -> None:
    from k3.kernels.kda.chunk import chunk_kda

    dev = bench.dev
    # correctness: small shape, forward and backward, against the fp64 reference; the peer's errors on the
    # same inputs are reported beside ours (not checked: its accuracy is its own business, but a speed ratio
    # means little without it). Eight heads: dA_log has one entry per head, a sum of terms that largely cancel,
    # and over two heads its relative error swung with the drawn A_log
    inputs = _kda_inputs(1, 160, 8, 128, dev, torch.bfloat16)
    fla = _fla()

    def check():
        errors = kda_chunk_errors(lambda *x: chunk_kda(*x, lower_bound=-5.0)[0], inputs)
        for name, err in errors.items():
            bench.check_error(f"kda_chunk {name} (bf16)", err, torch.bfloat16)

    def peer_errors():
        try:
            errors = kda_chunk_errors(
                lambda *x: fla[0](*x[:5], A_log=x[5], dt_bias=x[6], **FLA_CHUNK_KDA_KWARGS)[0], inputs
            )
        except Exception as exc:  # the peer's failure is reported, not ours
            print(f"  fla chunk_kda could not run the check inputs: {type(exc).__name__}: {exc}")
            return
        bench.report.peer_errors["fla chunk_kda"] = errors
        print("  fla chunk_kda on the same inputs, rel RMS: " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()))

    bench.guarded("kda_chunk check", check)
    if fla is not None:
        peer_errors()

    shapes = bench.kda_shapes or KDA_CHUNK_SHAPES
    if bench.quick and not bench.kda_shapes:
        shapes = [(1, 2048, 8, 128)]
    for B, T, H, D in shapes:
        _time_kda_chunk(bench, fla, B, T, H, D)


def _time_kda_chunk(bench: Bench, fla, B: int, T: int, H: int, D: int) -> None:
    from k3.kernels.kda.chunk import chunk_kda

    q, k, v, g_raw, beta_raw, A_log, dt_bias = _kda_inputs(B, T, H, D, bench.dev, requires_grad=True)
    per_tok = 6 * D * D + 6 * 64 * D + 4 * 64 * D
    flops_fwd = B * T * H * per_tok
    shape = f"B{B} T{T} H{H} D{D}"
    do = torch.randn(B, T, H, D, device=bench.dev, dtype=torch.bfloat16)

    def ours_fwd():
        with torch.no_grad():
            return chunk_kda(q, k, v, g_raw, beta_raw, A_log, dt_bias, lower_bound=-5.0)

    def ours_fb():
        o, _ = chunk_kda(q, k, v, g_raw, beta_raw, A_log, dt_bias, lower_bound=-5.0)
        o.backward(do)

    peer_fwd = peer_fb = None
    if fla is not None:
        fla_chunk = fla[0]

        def call_peer():
            return fla_chunk(q, k, v, g_raw, beta_raw, A_log=A_log, dt_bias=dt_bias, **FLA_CHUNK_KDA_KWARGS)

        def peer_fwd():
            with torch.no_grad():
                return call_peer()

        def peer_fb():
            o, _ = call_peer()
            o.backward(do)

    for label, ours, peer, flops in (("fwd", ours_fwd, peer_fwd, flops_fwd),
                                     ("fwd+bwd", ours_fb, peer_fb, 3 * flops_fwd)):
        ours_ms = bench.try_time(ours, f"k3 chunk_kda {label}")
        peer_ms = bench.try_time(peer, "fla chunk_kda") if peer else None
        bench.add(Row(f"kda_chunk {label}", shape, ours_ms, "fla chunk_kda" if fla else "peer unavailable",
                      peer_ms, note="nominal FLOPs"), flops=flops)


def bench_kda_decode(bench: Bench) -> None:
    from k3.kernels.kda.decode import (
        fused_recurrent_kda_decode,
        fused_recurrent_kda_decode_reference,
        short_conv_decode,
        short_conv_decode_reference,
    )

    dev = bench.dev
    # correctness
    N, H, K = 6, 4, 128
    q, k, v, g_raw, beta_raw, A_log, dt_bias = (t[:, 0] if t.dim() > 1 else t for t in _kda_inputs(N, 1, H, K, dev))
    pool = torch.randn(10, H, K, K, device=dev)
    slots = torch.tensor([7, 1, 3, 0, 9, 4], device=dev)
    p1, p2 = pool.clone(), pool.clone()
    o = fused_recurrent_kda_decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, p1, slots)
    o_ref = fused_recurrent_kda_decode_reference(q.float(), k.float(), v.float(), g_raw.float(), beta_raw.float(),
                                                 A_log, dt_bias, p2, slots)
    bench.check("kda_decode o (bf16)", o, o_ref, torch.bfloat16)
    bench.check("kda_decode state (bf16 inputs)", p1, p2, torch.bfloat16)
    x = torch.randn(N, 3 * H * K, device=dev, dtype=torch.bfloat16)
    cpool = torch.randn(10, 3 * H * K, 3, device=dev, dtype=torch.bfloat16)
    w = torch.randn(3 * H * K, 4, device=dev)
    c1, c2 = cpool.clone(), cpool.clone()
    y = short_conv_decode(x, c1, w, slots)
    y_ref = short_conv_decode_reference(x.float(), c2.float(), w, slots)
    bench.check("short_conv_decode (bf16)", y, y_ref, torch.bfloat16)

    # timing
    N, H, K = (64, 16, 128) if bench.quick else (256, 32, 128)
    slots_n = 2 * N
    q, k, v, g_raw, beta_raw, A_log, dt_bias = (t[:, 0] if t.dim() > 1 else t for t in _kda_inputs(N, 1, H, K, dev))
    pool = torch.randn(slots_n, H, K, K, device=dev) * 0.01
    slots = torch.randperm(slots_n, device=dev)[:N]
    state_bytes = 2 * N * H * K * K * 4
    io_bytes = (4 * N * H * K + N * H) * 2
    ours_ms = bench.time(lambda: fused_recurrent_kda_decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, pool, slots,
                                                            validate=False), graph=True)
    fla = _fla()
    peer_ms = None
    if fla is not None:
        fused = fla[1]
        h0 = pool[slots].contiguous()
        qb, kb, vb, gb, bb = (t[:, None] for t in (q, k, v, g_raw, beta_raw))
        peer_ms = bench.try_time(lambda: fused(qb, kb, vb, gb, bb, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                                               output_final_state=True, use_qk_l2norm_in_kernel=True,
                                               use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                               lower_bound=-5.0), "fla fused_recurrent_kda", graph=True)
        o_peer, s_peer = fused(qb, kb, vb, gb, bb, A_log=A_log, dt_bias=dt_bias, initial_state=h0,
                               output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
        p = pool.clone()
        o = fused_recurrent_kda_decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, p, slots)
        bench.check("kda_decode vs fla fused_recurrent_kda (o)", o, o_peer[:, 0], torch.bfloat16)
        bench.check("kda_decode vs fla fused_recurrent_kda (state)", p[slots], s_peer, torch.bfloat16)
    bench.add(Row("kda_decode", f"N{N} H{H} K{K} V{K}", ours_ms,
                  "fla fused_recurrent_kda" if fla else "peer unavailable", peer_ms, note="CUDA graph"),
              bytes_moved=state_bytes + io_bytes)

    D = 3 * H * K
    x = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
    cpool = torch.randn(slots_n, D, 3, device=dev, dtype=torch.bfloat16)
    w = torch.randn(D, 4, device=dev)
    ours_ms = bench.time(lambda: short_conv_decode(x, cpool, w, slots, validate=False), graph=True)
    peer_ms = bench.try_time(lambda: short_conv_decode_reference(x, cpool, w, slots, validate=False), "torch",
                             graph=True)
    bench.add(Row("short_conv_decode", f"N{N} D{D} W4", ours_ms, "torch reference", peer_ms, note="CUDA graph"),
              bytes_moved=N * D * (2 + 3 * 2 * 2 + 2))


# ------------------------------------------------------------------------------------------------- MLA
def _paged(B, L, H, Tq, page, dev, dtype=torch.bfloat16, lengths=None):
    R, E = 512, 64
    lengths = lengths or [L] * B
    max_pages = -(-max(lengths) // page)
    num_pages = B * max_pages + 7
    kv = torch.randn(num_pages, page, R + E, device=dev, dtype=dtype)
    perm = torch.randperm(num_pages, device=dev)[:B * max_pages]
    table = perm.view(B, max_pages).int()
    seq_lens = torch.tensor(lengths, device=dev)
    ql = torch.randn(B, Tq, H, R, device=dev, dtype=dtype)
    qe = torch.randn(B, Tq, H, E, device=dev, dtype=dtype)
    return ql, qe, kv, table, seq_lens


def bench_mla(bench: Bench) -> None:
    from k3.kernels.mla.decode import mla_decode, mla_decode_attention
    from k3.kernels.mla.reference import mla_decode_attention_reference, mla_decode_reference

    dev = bench.dev
    for Tq in (1, 3):
        ql, qe, kv, table, lens = _paged(3, 0, 16, Tq, 64, dev, lengths=[70, 1000, 333])
        o = mla_decode_attention(ql, qe, kv, table, lens)
        ref = mla_decode_attention_reference(ql.float(), qe.float(), kv.float(), table, lens)
        bench.check(f"mla_decode_attention Tq={Tq} (bf16)", o, ref, torch.bfloat16)
    H, n, v = 16, 128, 128
    w_kvb = torch.randn(H * (n + v), 512, device=dev, dtype=torch.bfloat16) * 0.05
    q_nope = torch.randn(3, 2, H, n, device=dev, dtype=torch.bfloat16)
    gate = torch.randn(3, 2, H * v, device=dev, dtype=torch.bfloat16)
    _, qe, kv, table, lens = _paged(3, 0, H, 2, 64, dev, lengths=[70, 1000, 333])
    full = mla_decode(q_nope, qe, kv, table, lens, w_kvb, gate)
    full_ref = mla_decode_reference(q_nope.float(), qe.float(), kv.float(), table, lens, w_kvb.float(), gate.float())
    bench.check("mla_decode full absorbed path (bf16)", full, full_ref, torch.bfloat16)

    B, L = (2, 4096) if bench.quick else (8, 32768)
    for Tq in (1, 4):
        _time_mla(bench, B, L, H, Tq)


def _time_mla(bench: Bench, B: int, L: int, H: int, Tq: int) -> None:
    from k3.kernels.mla.decode import mla_decode_attention, split_kernel
    from k3.kernels.mla.reference import gather_pages

    dev = bench.dev
    ql, qe, kv, table, lens = _paged(B, L, H, Tq, 64, dev)
    scale = 192**-0.5
    ours_ms = bench.time(lambda: mla_decode_attention(ql, qe, kv, table, lens, scale=scale, validate=False), graph=True)
    keys = torch.stack([gather_pages(kv, table, L, b) for b in range(B)])[:, None]  # [B, 1, L, 576]
    values = keys[..., :512]
    q = torch.cat([ql, qe], dim=-1).transpose(1, 2)  # [B, H, Tq, 576]
    mask = None
    if Tq > 1:
        mask = torch.arange(L, device=dev)[None, :] <= torch.arange(L - Tq, L, device=dev)[:, None]

    def peer():
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                                                enable_gqa=True)

    peer_ms = bench.try_time(peer, "sdpa", graph=True)
    if peer_ms is not None:
        ours = mla_decode_attention(ql, qe, kv, table, lens, scale=scale)
        bench.check(f"mla_decode vs sdpa Tq={Tq} (bf16)", ours, peer().transpose(1, 2).float(), torch.bfloat16)
    bytes_moved = B * L * 576 * 2 + 2 * B * Tq * H * (512 + 64) * 2
    bench.add(Row("mla_decode attention", f"B{B} L{L} H{H} Tq{Tq} page64", ours_ms, "sdpa (gathered)", peer_ms,
                  note=f"CUDA graph; {split_kernel(ql, kv)} split kernel"),
              bytes_moved=bytes_moved)
    if Tq > 1:
        expected = peer().transpose(1, 2).float() if peer_ms is not None else None
        _mla_multi_token_sweep(bench, ql, qe, kv, table, lens, scale, bytes_moved, peer_ms, expected)


MLA_MULTI_TOKEN_GRID = (  # (block_m, block_n, num_warps, num_stages) for Tq x H = 64 query rows
    (64, 64, 8, 2), (64, 32, 8, 2), (64, 32, 8, 3), (64, 16, 8, 3), (64, 32, 16, 2),
    (32, 64, 8, 2), (32, 32, 8, 2), (32, 32, 4, 2), (16, 64, 4, 2), (16, 32, 4, 3),
)


def _mla_multi_token_sweep(bench: Bench, ql, qe, kv, table, lens, scale, bytes_moved, peer_ms, expected) -> None:
    """Launch parameters for speculative verification, measured in the same run as the default.

    Tq x H query rows against each key tile is register-heavy (an fp32 ``[block_m, 512]`` accumulator), so
    whether one 64-row block, two 32-row blocks or four 16-row blocks (cache tiles shared through L2) is the
    fastest is a property of the card and compiler; the best configuration is recorded as its own row and in
    the JSON's ``tuning`` list, with its correctness checked.
    """
    from k3.kernels.mla.decode import MLAConfig, mla_decode_attention

    Tq, H = ql.shape[1], ql.shape[2]
    grid = MLA_MULTI_TOKEN_GRID[:3] if bench.quick else MLA_MULTI_TOKEN_GRID
    # the portable kernel's launch parameters (the default row above runs the sm90 kernel where it applies)
    configs = [MLAConfig(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, sm90=False) for bm, bn, nw, ns in grid]
    before = len(bench.report.tuning)
    _sweep(bench, f"mla_decode Tq={Tq}", configs,
           lambda c: lambda: mla_decode_attention(ql, qe, kv, table, lens, scale=scale, validate=False, config=c),
           bytes_moved=bytes_moved)
    if len(bench.report.tuning) == before:
        return
    best = MLAConfig(**bench.report.tuning[-1]["best"])
    if expected is not None:
        ours = mla_decode_attention(ql, qe, kv, table, lens, scale=scale, config=best)
        bench.check(f"mla_decode Tq={Tq} best config vs sdpa (bf16)", ours, expected, torch.bfloat16)
    label = f"bm{best.block_m} bn{best.block_n} w{best.num_warps} s{best.num_stages}"
    bench.add(Row("mla_decode att. (best)", f"B{ql.shape[0]} H{H} Tq{Tq} {label}", bench.report.tuning[-1]["ms"],
                  "sdpa (gathered)", peer_ms, note=f"CUDA graph; best of the sweep: {best}"),
              bytes_moved=bytes_moved)


# ------------------------------------------------------------------------------------------------- SiTU
def bench_situ(bench: Bench) -> None:
    from k3.kernels.situ.reference import situ_glu_reference
    from k3.kernels.situ.triton import situ_glu_backward, situ_glu_forward, situ_glu_triton

    dev = bench.dev
    x = (torch.randn(37, 2 * 300, device=dev) * 8).bfloat16()
    x[0, :2] = torch.tensor([float("inf"), float("-inf")])
    dy = torch.randn(37, 300, device=dev).bfloat16()
    xr = x.float().requires_grad_()
    yr = situ_glu_reference(xr)
    yr.backward(dy.float())
    bench.check("situ_glu fwd (bf16)", situ_glu_forward(x), yr, torch.bfloat16)
    bench.check("situ_glu bwd (bf16)", situ_glu_backward(x, dy), xr.grad, torch.bfloat16)

    N, inter = (4096, 3072) if bench.quick else (16384, 3072)
    x = torch.randn(N, 2 * inter, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(N, inter, device=dev, dtype=torch.bfloat16)
    fwd_bytes = N * 3 * inter * 2
    bwd_bytes = N * 5 * inter * 2
    ours_ms = bench.time(lambda: situ_glu_forward(x), graph=True)
    peer_ms = bench.try_time(lambda: situ_glu_reference(x), "torch", graph=True)
    bench.add(Row("situ_glu fwd", f"N{N} I{inter}", ours_ms, "torch", peer_ms, note="CUDA graph"),
              bytes_moved=fwd_bytes)
    xg = x.detach().requires_grad_()

    def ours_fb():  # autograd.grad: no accumulation into x.grad, only the two kernels' traffic
        torch.autograd.grad(situ_glu_triton(xg), xg, dy)

    def peer_fb():
        torch.autograd.grad(situ_glu_reference(xg), xg, dy)

    ours_ms = bench.time(ours_fb)
    peer_ms = bench.time(peer_fb)
    bench.add(Row("situ_glu fwd+bwd", f"N{N} I{inter}", ours_ms, "torch autograd", peer_ms, note="eager"),
              bytes_moved=fwd_bytes + bwd_bytes)
    ours_ms = bench.time(lambda: situ_glu_backward(x, dy), graph=True)
    bench.add(Row("situ_glu bwd kernel", f"N{N} I{inter}", ours_ms, "-", None, note="CUDA graph"),
              bytes_moved=bwd_bytes)


# ------------------------------------------------------------------------------------------------ grouped
def _uneven_offsets(M: int, E: int, dev) -> torch.Tensor:
    weights = torch.linspace(0.5, 1.5, E)
    counts = (weights / weights.sum() * M).floor().long()
    counts[-1] += M - counts.sum()
    return counts.cumsum(0).to(torch.int32).to(dev)


def bench_grouped(bench: Bench) -> None:
    from k3.kernels.moe.grouped_gemm import grouped_mm, pick_backend
    from k3.kernels.moe.reference import grouped_mm_reference

    dev = bench.dev
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(300, 256, device=dev, dtype=dtype)
        w = (torch.randn(5, 384, 256, device=dev, dtype=dtype) * 0.05).transpose(1, 2)
        offs = torch.tensor([0, 64, 64, 250, 300], dtype=torch.int32, device=dev)
        dy = torch.randn(300, 384, device=dev, dtype=dtype)
        xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
        yr = grouped_mm_reference(xr, wr, offs)
        yr.backward(dy.float())
        backends = ["triton"] + (["torch"] if pick_backend(x, w) == "torch" else [])
        for backend in backends:
            xo, wo = x.detach().requires_grad_(), w.detach().requires_grad_()
            y = grouped_mm(xo, wo, offs, backend=backend)
            y.backward(dy)
            tag = f"grouped_mm {backend} ({str(dtype).removeprefix('torch.')})"
            bench.check(f"{tag} y", y, yr, dtype)
            bench.check(f"{tag} dx", xo.grad, xr.grad, dtype)
            bench.check(f"{tag} dw", wo.grad, wr.grad, dtype)

    E, M, K, N = (8, 4096, 1024, 2048) if bench.quick else (16, 32768, 3584, 6144)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(E, N, K, device=dev, dtype=torch.bfloat16) * 0.02).transpose(1, 2).requires_grad_()
    offs = _uneven_offsets(M, E, dev)
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    flops = 2 * M * K * N
    has_torch = pick_backend(x, w) == "torch"
    shape = f"E{E} M{M} K{K} N{N}"

    def run(backend: str, label: str):
        if label == "fwd":
            with torch.no_grad():
                return grouped_mm(x, w, offs, backend=backend, validate=False)
        torch.autograd.grad(grouped_mm(x, w, offs, backend=backend, validate=False), (x, w), dy)

    for label, mult in (("fwd", 1), ("fwd+bwd", 3)):
        ours_ms = bench.time(functools.partial(run, "triton", label))
        peer_ms = bench.time(functools.partial(run, "torch", label)) if has_torch else None
        bench.add(Row(f"grouped_mm {label}", shape, ours_ms, "torch._grouped_mm" if has_torch else "peer unavailable",
                      peer_ms, note="ours = Triton kernel"), flops=mult * flops)


# --------------------------------------------------------------------------------------------------- tune
TUNABLE = ("kda_decode", "mla_decode", "situ_glu", "grouped_mm")


def _sweep(bench: Bench, name: str, configs, make_fn, bytes_moved=None, flops=None) -> None:
    """Time ``make_fn(config)`` for every config (CUDA graphs); print them fastest first, record the best."""
    results = []
    for cfg in configs:
        try:
            ms = bench.time(make_fn(cfg), graph=True)
        except Exception as exc:  # a config that does not compile (too much shared memory, ...)
            print(f"  {name} {cfg}: {type(exc).__name__}")
            continue
        rate = bytes_moved / ms / 1e9 if bytes_moved else flops / ms / 1e9
        results.append((ms, cfg, rate))
    results.sort(key=lambda r: r[0])
    for ms, cfg, rate in results:
        print(f"  {name}: {ms:.4f} ms {rate:.2f} {'TB/s' if bytes_moved else 'TFLOP/s'} {cfg}")
    if results:
        bench.report.tuning.append({"kernel": name, "best": asdict(results[0][1]), "ms": results[0][0]})
        bench.save()


def tune(bench: Bench, which: list[str]) -> None:
    """Sweep launch parameters of our kernels at the benchmark shapes; record the fastest."""
    for name in which:
        {"kda_decode": _tune_decode, "mla_decode": _tune_mla, "situ_glu": _tune_situ,
         "grouped_mm": _tune_grouped}[name](bench)


def _tune_decode(bench: Bench) -> None:
    from k3.kernels.kda.decode import DecodeConfig, fused_recurrent_kda_decode

    dev = bench.dev
    N, H, K = 256, 32, 128
    q, k, v, g_raw, beta_raw, A_log, dt_bias = (t[:, 0] if t.dim() > 1 else t for t in _kda_inputs(N, 1, H, K, dev))
    pool = torch.zeros(2 * N, H, K, K, device=dev)
    slots = torch.randperm(2 * N, device=dev)[:N]
    _sweep(bench, "kda_decode", [DecodeConfig(block_v=bv, num_warps=nw) for bv in (32, 64, 128) for nw in (2, 4, 8)],
           lambda c: lambda: fused_recurrent_kda_decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, pool, slots,
                                                       validate=False, config=c),
           bytes_moved=2 * N * H * K * K * 4)


def _tune_mla(bench: Bench) -> None:
    from k3.kernels.mla.decode import MLAConfig, mla_decode_attention

    dev = bench.dev
    B, L, Hm = 8, 32768, 16
    # The default config first (the sm90 kernel where it applies), then the portable kernel: num_splits None is
    # the occupancy-sized plan; the fixed counts are one and two waves of one or two programs per SM on a
    # 132-SM card, and 17 slices is one wave plus a few programs.
    grids = {
        1: [(16, 64, 4, 2, None), (16, 64, 4, 2, 16), (16, 64, 4, 2, 66), (16, 32, 4, 3, None), (16, 32, 4, 2, None)],
        2: [(32, 64, 8, 2, None), (32, 64, 8, 2, 16), (32, 64, 8, 2, 33), (32, 32, 8, 3, None), (16, 64, 4, 2, None)],
        4: [(64, 64, 8, 2, None), (64, 64, 8, 2, 16), (64, 64, 8, 2, 17), (64, 64, 8, 2, 33), (64, 32, 8, 3, None)],
    }
    for Tq, grid in grids.items():
        ql, qe, kv, table, lens = _paged(B, L, Hm, Tq, 64, dev)
        configs = [MLAConfig()] + [MLAConfig(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns, num_splits=sp,
                                             sm90=False) for bm, bn, nw, ns, sp in grid]
        _sweep(bench, f"mla_decode Tq={Tq}", configs,
               lambda c, ql=ql, qe=qe, kv=kv, table=table, lens=lens: lambda: mla_decode_attention(
                  ql, qe, kv, table, lens, validate=False, config=c),
               bytes_moved=B * L * 576 * 2)


def _tune_situ(bench: Bench) -> None:
    from k3.kernels.situ.triton import SiTUConfig, situ_glu_backward, situ_glu_forward

    dev = bench.dev
    x = torch.randn(16384, 6144, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(16384, 3072, device=dev, dtype=torch.bfloat16)
    situ_configs = [SiTUConfig(block=b, num_warps=nw) for b in (512, 1024, 2048, 4096) for nw in (4, 8)]
    _sweep(bench, "situ_glu fwd", situ_configs, lambda c: lambda: situ_glu_forward(x, config=c),
           bytes_moved=16384 * 3 * 3072 * 2)
    _sweep(bench, "situ_glu bwd", situ_configs, lambda c: lambda: situ_glu_backward(x, dy, config=c),
           bytes_moved=16384 * 5 * 3072 * 2)


def _tune_grouped(bench: Bench) -> None:
    from k3.kernels.moe.grouped_gemm import GroupedConfig, grouped_mm_dw, grouped_mm_forward

    dev = bench.dev
    E, M, Kg, Ng = 16, 32768, 3584, 6144
    xg = torch.randn(M, Kg, device=dev, dtype=torch.bfloat16)
    wg = torch.randn(E, Ng, Kg, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    dyg = torch.randn(M, Ng, device=dev, dtype=torch.bfloat16)
    offs = _uneven_offsets(M, E, dev)
    configs = [GroupedConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
               for bm, bn, bk, nw, ns in ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3),
                                          (128, 128, 64, 4, 4), (128, 256, 32, 8, 4))]
    _sweep(bench, "grouped_mm fwd", configs, lambda c: lambda: grouped_mm_forward(xg, wg, offs, config=c),
           flops=2 * M * Kg * Ng)
    configs = [GroupedConfig(dw_block_k=bk, dw_block_n=bn, dw_block_m=bm, num_warps=nw, num_stages=ns)
               for bk, bn, bm, nw, ns in ((128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4),
                                          (256, 128, 64, 8, 3), (128, 256, 32, 8, 4))]
    _sweep(bench, "grouped_mm dw", configs, lambda c: lambda: grouped_mm_dw(xg, dyg, offs, config=c),
           flops=2 * M * Kg * Ng)


# ---------------------------------------------------------------------------------------------------- main
def bench_model(bench: Bench) -> None:
    from k3.kernels.bench_model import bench_model as run

    run(bench)


SECTIONS = {  # the chunk section last: the fla peer autotunes on first use, which takes minutes
    "kda_decode": bench_kda_decode,
    "mla_decode": bench_mla,
    "situ_glu": bench_situ,
    "grouped_mm": bench_grouped,
    "model": bench_model,
    "kda_chunk": bench_kda_chunk,
}


def _print_table(report: Report) -> None:
    head = f"{'kernel':<22} {'shape':<28} {'ours ms':>9} {'peer':<24} {'peer ms':>9} {'peer/ours':>9} " \
           f"{'achieved':>16} {'% ceil':>7}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in report.rows:
        metric = f"{r.metric:.2f} {r.unit}" if r.metric else "-"
        pct = f"{r.ceiling_pct:.0f}%" if r.ceiling_pct else "-"
        ratio = f"{r.ratio:.2f}" if r.ratio else "-"
        print(f"{r.kernel:<22} {r.shape:<28} {_fmt(r.ours_ms):>9} {r.peer:<24} {_fmt(r.peer_ms):>9} {ratio:>9} "
              f"{metric:>16} {pct:>7}")
    failed = [c for c in report.checks if not c["ok"]]
    print(f"\ncorrectness: {len(report.checks) - len(failed)} of {len(report.checks)} checks passed")
    for c in failed:
        print(f"  FAILED: {c['check']} {c.get('error', '')}")


def _write_json(report: Report, path: str | None) -> None:
    """Writes the report to ``path`` through a temporary file and a rename, so the file is always a whole
    report: the one before or the one after, even if the run is killed while writing."""
    if not path:
        return
    data = asdict(report)
    for row, obj in zip(data["rows"], report.rows, strict=True):
        row["ratio_peer_over_ours"] = obj.ratio
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as fh:
            json.dump(data, fh, indent=2, default=str)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3.kernels.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few iterations (smoke run)")
    parser.add_argument("--json", metavar="FILE", help="write checks, ceilings and timings as JSON")
    parser.add_argument("--iters", type=int, default=None, help="timed runs per measurement (>= 20; default 20 or 5 quick)")
    parser.add_argument("--only", nargs="*", metavar="NAME", help=f"sections to run, of {sorted(SECTIONS)}")
    parser.add_argument("--kda-shapes", nargs="+", metavar="BxTxHxD", default=None,
                        help="KDA chunk shapes to time instead of the three defaults, e.g. 8x4096x16x128")
    parser.add_argument("--tune", nargs="*", metavar="NAME", default=None,
                        help=f"also sweep launch parameters of our kernels (all, or some of {list(TUNABLE)})")
    args = parser.parse_args(argv)
    iters = args.iters if args.iters is not None else (5 if args.quick else 20)
    if iters < 1 or (not args.quick and iters < 20):
        parser.error("--iters must be >= 20 (or >= 1 with --quick)")
    if args.only:
        unknown = [o for o in args.only if o not in SECTIONS]
        if unknown:
            parser.error(f"unknown section(s) {unknown}; choose from {sorted(SECTIONS)}")
    try:
        kda_shapes = [parse_shape(t) for t in args.kda_shapes] if args.kda_shapes else None
    except ValueError as exc:
        parser.error(str(exc))
    if args.tune:
        unknown = [t for t in args.tune if t not in TUNABLE]
        if unknown:
            parser.error(f"unknown --tune kernel(s) {unknown}; choose from {list(TUNABLE)}")
    if not torch.cuda.is_available():
        print("k3.kernels.bench needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.",
              file=sys.stderr)
        return 2
    bench = Bench(args.quick, iters, args.only, json_path=args.json)
    bench.kda_shapes = kda_shapes
    import triton

    props = torch.cuda.get_device_properties(0)
    bench.report.device = f"{props.name}, {props.multi_processor_count} SMs"
    bench.report.versions = {"torch": torch.__version__, "triton": triton.__version__}
    fla = _fla()
    if fla is None:
        print("fla-core: peer unavailable (not installed)")
    else:
        import fla as fla_pkg

        bench.report.versions["fla-core"] = getattr(fla_pkg, "__version__", "?")
    print(f"device: {bench.report.device}; versions: {bench.report.versions}")
    bench.ceilings()
    bench.save()
    for name, fn in SECTIONS.items():
        print(f"\n== {name}")
        bench.guarded(name, lambda fn=fn: fn(bench))
        torch.cuda.empty_cache()
    if args.tune is not None:
        print("\n== tuning")
        try:
            tune(bench, args.tune or list(TUNABLE))
        except Exception:  # tuning is advisory; the table below still prints
            traceback.print_exc()
    _print_table(bench.report)
    bench.save()
    return 0 if all(c["ok"] for c in bench.report.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
