"""The ``model`` section of ``python -m k3.kernels.bench``: the ``bench-1b`` preset end to end on one GPU.

What it does, in one process:

1. Builds ``bench-1b`` (``k3.model.presets``) on the GPU with seeded random weights (the KDA gate's ``W_fb``,
   zero at initialisation, gets small random values too, so the gates differ per token and channel), and an
   fp32 copy of the same (bf16-rounded) weights.
2. Correctness, on short prompts (two sequences of different lengths): forward logits, prefill logits and the
   logits of a few decode steps (``K3Model.decode`` and, from the same states moved into pools and pages,
   ``K3Model.decode_paged``) of the kernel path (``K3_KERNELS=auto``: Triton on CUDA) against the reference
   path (``K3_KERNELS=reference``, switched in-process), as relative RMS error. The bf16 kernel path passes
   when its error against the fp32 reference is at most ``max(2 x the bf16 reference path's own error, 5e-3)``
   (both paths round to bf16 in different places; the kernels must not be less accurate than the readable
   path); the fp32 kernel path must match the fp32 reference within 1e-4.
3. Throughput of the kernel path in bf16, with the reference path as the peer where it fits in time and
   memory: prefill of one 2048-token prompt (``K3Model.prefill``, which also builds the decoding state), a
   batch of 64 prompts of 2048 tokens (``K3Model.forward``: the batched prefill computation, logits for every
   position, no state), and one decode step at batch 1 and 64 over 2048-token contexts, both as
   ``K3Model.decode`` (per-sequence states in and out: the caches are stacked, grown and repacked for the
   kernel on every step) and as ``K3Model.decode_paged`` (what the serving engine runs: state pools and latent
   pages read and advanced in place), the latter against the former, and ``decode_paged`` once more as the
   replays of a CUDA graph (it has no host synchronisation), against itself run eagerly. Everything else runs
   eagerly, so those decode tokens/s include the host's launch overhead. Times are CUDA-event medians;
   tokens/s = tokens per call / time.

Memory: bf16 weights about 2.4 GB, the fp32 copy 4.8 GB (freed before the throughput runs); the largest
activation is the batch-64 forward's logits (64 x 2048 x 32768 bf16, 8.6 GB). A measurement that runs out of
memory is reported as missing, not fatal.
"""

from __future__ import annotations

import copy
import functools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from k3.kernels import dispatch

__all__ = ["bench_model", "kernel_mode_as"]

PRESET = "bench-1b"
BF16_FLOOR = 5e-3
FP32_TOL = 1e-4


@contextmanager
def kernel_mode_as(mode: str) -> Iterator[None]:
    """Run the block with ``K3_KERNELS=mode`` (``auto``, ``reference`` or ``triton``), restoring it after."""
    if mode not in dispatch.MODES:
        raise ValueError(f"mode must be one of {dispatch.MODES}, got {mode!r}")
    old = os.environ.get(dispatch.ENV_VAR)
    os.environ[dispatch.ENV_VAR] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(dispatch.ENV_VAR, None)
        else:
            os.environ[dispatch.ENV_VAR] = old


def _rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - e).pow(2).mean().sqrt() / e.pow(2).mean().sqrt().clamp_min(1e-30))


def build_model(cfg, device: torch.device, seed: int = 0):
    """``K3Model(cfg)`` initialised on ``device`` from ``seed`` (fp32), with random KDA ``W_fb`` as well."""
    from k3.model.transformer import K3Model

    torch.manual_seed(seed)
    with torch.device(device):
        model = K3Model(cfg).eval()
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.layers:
            if layer.kind == "kda":
                layer.attn.w_fb.weight.normal_(0.0, 0.02, generator=gen)
    return model


class PagedBatch:
    """Sequences moved into the serving engine's memory: a ``SlotPool`` row and ``room`` more tokens of
    ``PagedLatentCache`` pages each, their states written in.

    It holds exactly the arguments ``K3Model.decode_paged`` takes; ``step`` runs one in-place decode step and
    counts the token.
    """

    def __init__(self, model, states: list, room: int, page_size: int = 64):
        from k3.services.engine.pages import PagedLatentCache
        from k3.services.engine.slots import SlotPool

        cfg = model.cfg
        dev, dtype = model.embed.weight.device, model.embed.weight.dtype
        self.model = model
        longest = max(s.num_tokens for s in states) + room
        slot_pool = SlotPool(cfg, len(states), dev, dtype)
        pages = PagedLatentCache(cfg, len(states) * -(-longest // page_size), page_size, dev, dtype)
        slots, tables = [], []
        for state in states:
            slots.append(slot_pool.acquire())
            tables.append(pages.allocate(pages.pages_for(longest)))
            slot_pool.write(slots[-1], state.kda)
            pages.write(tables[-1], 0, state.mla)
        self.slots = torch.tensor(slots, device=dev)
        self.block_table = pages.block_table(tables, longest).to(dev)
        self.seq_lens = torch.tensor([s.num_tokens for s in states], dtype=torch.int32, device=dev)
        self.kda_pools, self.kv_pages = slot_pool.states, pages.kv

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """One step for every sequence without counting it (a timing loop repeats the same step)."""
        return self.model.decode_paged(tokens, self.slots, self.block_table, self.seq_lens, self.kda_pools,
                                       self.kv_pages, validate=False)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.logits(tokens)
        self.seq_lens += 1
        return logits


def run_paths(model, ids: torch.Tensor, lengths: list[int], steps: int) -> dict[str, torch.Tensor]:
    """Logits of the four inference paths for the current ``K3_KERNELS`` mode.

    ``forward``: ``model(ids)`` for ``ids [B, T]``; ``prefill``: ``model.prefill`` of ``ids[b, :lengths[b]]``
    (each row's logits, concatenated); ``decode``: ``steps`` decode steps after those prefills, fed the next
    tokens of ``ids`` (``[steps, B, vocab]``); ``decode_paged``: the same steps through ``decode_paged`` from
    the same prefill states moved into pools and pages (``PagedBatch``).
    """
    with torch.no_grad():
        out = {"forward": model(ids)}
        prefill, states = [], []
        for b, n in enumerate(lengths):
            logits, state = model.prefill(ids[b, :n])
            prefill.append(logits)
            states.append(state)
        out["prefill"] = torch.cat(prefill)
        paged = PagedBatch(model, states, room=steps)
        steps_out, paged_out = [], []
        for s in range(steps):
            tokens = torch.stack([ids[b, n + s] for b, n in enumerate(lengths)])
            logits, states = model.decode(tokens, states)
            steps_out.append(logits)
            paged_out.append(paged.step(tokens))
        out["decode"] = torch.stack(steps_out)
        out["decode_paged"] = torch.stack(paged_out)
    return out


def _record(bench, name: str, ok: bool, **details) -> None:
    bench.report.checks.append({"check": name, "ok": bool(ok), **details})
    shown = ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}" for k, v in details.items())
    print(f"  [{'ok' if ok else 'FAIL'}] {name}: {shown}")


def check_model(bench, model, kernel_mode: str = "auto") -> None:
    """Kernel path (``K3_KERNELS=kernel_mode``) against the reference path, bf16 and fp32 (see the module
    docstring); ``kernel_mode="triton"`` lets the CPU tests run it under Triton's interpreter."""
    cfg = model.cfg
    dev = bench.dev
    T, steps = (80, 2) if bench.quick else (320, 4)
    lengths = [T - 2 * steps, T // 2 + 3]  # different lengths: ragged MLA caches in the decode steps
    gen = torch.Generator(device=dev).manual_seed(2)
    ids = torch.randint(0, cfg.vocab_size, (2, T), device=dev, generator=gen)
    exact_model = copy.deepcopy(model).float()
    with kernel_mode_as("reference"):
        exact = run_paths(exact_model, ids, lengths, steps)
    with kernel_mode_as(kernel_mode):
        fp32_kernels = run_paths(exact_model, ids, lengths, steps)
    del exact_model
    torch.cuda.empty_cache()
    with kernel_mode_as("reference"):
        ref = run_paths(model, ids, lengths, steps)
    with kernel_mode_as(kernel_mode):
        ours = run_paths(model, ids, lengths, steps)
    for path in ("forward", "prefill", "decode", "decode_paged"):
        err32 = _rel_rms(fp32_kernels[path], exact[path])
        _record(bench, f"{PRESET} {path} logits, kernels vs reference (fp32)", err32 <= FP32_TOL,
                rel_rms=err32, tolerance=FP32_TOL)
        ours_err, ref_err = _rel_rms(ours[path], exact[path]), _rel_rms(ref[path], exact[path])
        tol = max(2 * ref_err, BF16_FLOOR)
        _record(bench, f"{PRESET} {path} logits, kernels (bf16) vs fp32 reference", ours_err <= tol,
                rel_rms=ours_err, reference_path_rel_rms=ref_err, tolerance=tol,
                kernels_vs_reference_bf16=_rel_rms(ours[path], ref[path]))


def _timed(bench, what: str, fn: Callable[[], object], iters: int, graph: bool = False) -> float | None:
    """CUDA-event median of ``fn`` in ms (one warm-up call; replays of its CUDA graph with ``graph``), or None
    (with the reason) if it fails."""
    from k3.kernels.bench import time_ms

    try:
        return time_ms(fn, warmup=1, iters=iters, graph=graph)
    except Exception as exc:  # a missing figure and a failed check; the other measurements still run
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    torch.cuda.empty_cache()
    _record(bench, f"{PRESET} {what} ran", False, error=error)
    return None


def time_model(bench, model) -> None:
    """Prefill and decode tokens/s at batch 1 and 64, kernel path against the reference path."""
    from k3.kernels.bench import Row

    cfg, dev = model.cfg, bench.dev
    prompt, big_batch, iters = (256, 8, 2) if bench.quick else (2048, 64, 3)
    gen = torch.Generator(device=dev).manual_seed(3)
    ids = torch.randint(0, cfg.vocab_size, (big_batch, prompt), device=dev, generator=gen)

    def add(label: str, shape: str, tokens: int, ours_ms, peer_ms, note: str) -> None:
        row = Row(f"{PRESET} {label}", shape, ours_ms, "reference path" if peer_ms else "-", peer_ms,
                  note=note + "; metric = tokens/s of ours")
        if ours_ms:
            row.metric, row.unit = tokens / ours_ms * 1e3, "tok/s"
        bench.add(row)

    with torch.no_grad():
        # prefill, batch 1: one prompt through K3Model.prefill (state built)
        one = ids[0]
        with kernel_mode_as("auto"):
            ours = _timed(bench, "prefill B1 (kernels)", lambda: model.prefill(one), iters)
        with kernel_mode_as("reference"):
            peer = _timed(bench, "prefill B1 (reference)", lambda: model.prefill(one), iters)
        add("prefill", f"B1 T{prompt}", prompt, ours, peer, "K3Model.prefill, eager")

        # prefill, batch 64: the batched forward (the reference's [B, H, T, T] scores would take > 40 GB)
        with kernel_mode_as("auto"):
            ours = _timed(bench, f"prefill B{big_batch} (kernels)", lambda: model(ids), iters)
        torch.cuda.empty_cache()
        add("prefill", f"B{big_batch} T{prompt}", big_batch * prompt, ours, None,
            "K3Model.forward (all logits, no state), eager")

        # decode: one step over contexts of `prompt` tokens (the state is a value: every call starts from it)
        with kernel_mode_as("auto"):
            _, state = model.prefill(one)
        decode_ms = {}
        for batch in (1, big_batch):
            step = functools.partial(model.decode, ids[:batch, 0], [state] * batch)
            with kernel_mode_as("auto"):
                ours = decode_ms[batch] = _timed(bench, f"decode B{batch} (kernels)", step, iters + 2)
            with kernel_mode_as("reference"):
                peer = _timed(bench, f"decode B{batch} (reference)", step, iters + 2)
            add("decode step", f"B{batch} ctx{prompt}", batch, ours, peer, "K3Model.decode, eager (no CUDA graph)")
        # the same step as a server runs it (states in a pool, latents in pages, both advanced in place), against
        # K3Model.decode on the kernels just timed; and, since that step never synchronises with the host, as a
        # CUDA graph's replays against itself eager: the GPU's own time, without 24 layers' launches from Python
        for batch in (1, big_batch):
            paged = PagedBatch(model, [state] * batch, room=1)
            step = functools.partial(paged.logits, ids[:batch, 0])
            with kernel_mode_as("auto"):
                eager = _timed(bench, f"paged decode B{batch} (kernels)", step, iters + 2)
                graphed = _timed(bench, f"paged decode B{batch} (kernels, CUDA graph)", step, iters + 2, graph=True)
            del paged, step
            torch.cuda.empty_cache()
            shape = f"B{batch} ctx{prompt}"
            for label, ours, peer, peer_ms, how in (
                ("decode step, paged", eager, "K3Model.decode (kernels)", decode_ms[batch], "eager (no CUDA graph)"),
                ("decode step, paged, graph", graphed, "paged, eager", eager, "replays of one CUDA graph"),
            ):
                row = Row(f"{PRESET} {label}", shape, ours, peer, peer_ms,
                          note=f"K3Model.decode_paged, {how}; metric = tokens/s of ours")
                if ours:
                    row.metric, row.unit = batch / ours * 1e3, "tok/s"
                bench.add(row)


def bench_model(bench) -> None:
    """The section: build, check, time (each part guarded by the caller's section guard)."""
    from k3.model.presets import get_preset

    cfg = get_preset(PRESET)
    started = time.perf_counter()
    free, total = torch.cuda.mem_get_info()
    need = 16 * 2**30  # weights (bf16 + fp32 copy) and the largest activations of the checks
    if free < need:
        raise RuntimeError(f"{PRESET} needs about {need / 2**30:.0f} GiB free, the GPU has {free / 2**30:.1f} GiB")
    model = build_model(cfg, bench.dev).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    print(f"  {PRESET}: {params / 1e9:.2f} B parameters, bf16, built in {time.perf_counter() - started:.1f} s")
    bench.guarded("model check", lambda: check_model(bench, model))
    torch.cuda.empty_cache()
    bench.guarded("model timing", lambda: time_model(bench, model))
    print(f"  model section took {time.perf_counter() - started:.0f} s")
