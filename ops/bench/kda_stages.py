"""Where the chunked KDA kernels spend their time: per-kernel GPU time of one call, for launch configs side by side.

For every ``--config`` (``ChunkKDAConfig`` fields as ``name=value`` pairs; the defaults when none is given) it
times the inference forward (``torch.no_grad``, CUDA events, median of 20) and, with ``--backward``, forward +
backward, then runs one more call under ``torch.profiler`` and prints the mean GPU time of each of our
kernels, and the GPU memory one call allocates at its peak. Use it to see which stage a change moved;
``python -m k3.kernels.bench`` stays the measurement against the peer. ``--rev REV`` adds the kernels as of a
git revision (``kernels/kda/chunk.py`` at ``REV``, with that revision's default config) to the same table, so a
change is timed against its predecessor in one process; ``--source FILE`` does the same for an edited copy of
that module (a variant under development, or a tree copied without its git history). ``--peer`` adds
fla-core's ``chunk_kda`` on the same inputs, with the time of each of its kernels. ``--check`` first holds every
variant to the bench's correctness measure (output with and without autograd, and the seven gradients, against
the fp64 reference at two small shapes) and counts non-finite elements of its training output at the timed
shape: a variant can be fast and wrong only on the GPU.

    python ops/bench/kda_stages.py --backward
    python ops/bench/kda_stages.py --config num_warps=8 --config state_block_v=64,state_num_warps=8
    python ops/bench/kda_stages.py --backward --rev HEAD~1
    python ops/bench/kda_stages.py --backward --source /tmp/chunk_variant.py
    python ops/bench/kda_stages.py --backward --peer
    python ops/bench/kda_stages.py --backward --check --source /tmp/chunk_variant.py

Needs a CUDA GPU (exit status 2 without one).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import math
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHUNK_SOURCE = "kernels/kda/chunk.py"


def parse_config(text: str, config_class=None):
    """``"name=value,name=value"`` -> ``ChunkKDAConfig`` (ints where the field is an int); errors name the field.
    ``config_class``: the config class of another copy of the module (``--source``); the installed one by default."""
    if config_class is None:
        from k3.kernels.kda.chunk import ChunkKDAConfig as config_class

    fields = {f.name: f for f in dataclasses.fields(config_class)}
    kwargs: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"bad config item {item!r}: expected name=value with name one of {sorted(fields)}")
        if fields[name].type in ("int", int):
            try:
                kwargs[name] = int(value)
            except ValueError:
                raise ValueError(f"config field {name} needs an integer, got {value!r}") from None
        elif fields[name].type in ("bool", bool):
            kwargs[name] = value.lower() in ("1", "true", "yes")
        else:
            kwargs[name] = value
    return config_class(**kwargs)


def load_revision(rev: str):
    """``kernels/kda/chunk.py`` as of git revision ``rev``, imported as a module of its own.

    The source is written to a temporary file (Triton reads a kernel's source from its file) and registered in
    ``sys.modules`` under a private name, so it lives beside the installed ``k3.kernels.kda.chunk``."""
    if not rev or rev.startswith("-"):
        raise ValueError(f"bad revision {rev!r}: expected a git revision such as HEAD~1 or a commit id")
    proc = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{CHUNK_SOURCE}"], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise ValueError(f"cannot read {CHUNK_SOURCE} at revision {rev!r}: {proc.stderr.strip()}")
    name = "kda_chunk_at_" + re.sub(r"\W", "_", rev)
    path = Path(tempfile.mkdtemp(prefix="kda_stages_")) / f"{name}.py"
    path.write_text(proc.stdout)
    return _import_as(name, path)


def load_source(path: str):
    """A copy of ``kernels/kda/chunk.py`` at ``path`` (edited or not), imported as a module of its own.

    Imported in place (Triton reads each kernel's source from this file); the module must define
    ``chunk_kda`` and ``ChunkKDAConfig`` like the original."""
    file = Path(path)
    if file.suffix != ".py" or not file.is_file():
        raise ValueError(f"bad source {path!r}: expected an existing .py file, a copy of {CHUNK_SOURCE}")
    name = "kda_chunk_from_" + re.sub(r"\W", "_", file.stem)
    try:
        module = _import_as(name, file)
    except Exception as exc:  # a broken variant is a bad argument, reported with its error
        raise ValueError(f"cannot import {path!r}: {type(exc).__name__}: {exc}") from exc
    if not (callable(getattr(module, "chunk_kda", None)) and hasattr(module, "ChunkKDAConfig")):
        del sys.modules[name]
        raise ValueError(f"{path!r} defines no chunk_kda / ChunkKDAConfig: not a copy of {CHUNK_SOURCE}")
    return module


def _import_as(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their class's module up while it is being executed
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


CHECK_SHAPES = ((1, 160, 8, 128), (2, 1000, 4, 128))  # B, T, H, D: a partial chunk, two sequences


def check_lines(kda, dev, shape, check_shapes=CHECK_SHAPES) -> tuple[list[str], bool]:
    """``(report lines, passed)`` for one variant ``kda`` (``chunk_kda`` with its config bound).

    At each of ``check_shapes``: the bench's ``kda_chunk_errors`` (relative RMS against fp64, bf16 inputs),
    held to the bench's bf16 tolerance. At ``shape`` (the timed one, too large for the fp64 reference): the
    number of non-finite elements of the output of a call with autograd, which the no-grad timing never
    looks at."""
    import torch

    from k3.kernels.bench import CHECK_TOL, _kda_inputs, kda_chunk_errors

    tol = CHECK_TOL[torch.bfloat16]
    lines, passed = [], True
    for B, T, H, D in check_shapes:
        errors = kda_chunk_errors(lambda *x: kda(*x, lower_bound=-5.0)[0], _kda_inputs(B, T, H, D, dev))
        worst = max(errors, key=lambda name: math.inf if math.isnan(errors[name]) else errors[name])
        ok = all(e <= tol for e in errors.values())  # False for NaN as well
        passed &= ok
        lines.append(
            f"  check {B}·{T}·{H}·{D}: {'ok' if ok else 'FAIL'}, worst {worst} {errors[worst]:.2e} (tol {tol:.0e})"
        )
    inputs = _kda_inputs(*shape, dev, requires_grad=True)
    o, _ = kda(*inputs, lower_bound=-5.0)
    bad = int((~torch.isfinite(o)).sum())
    passed &= bad == 0
    B, T, H, D = shape
    lines.append(f"  check {B}·{T}·{H}·{D}: training output {'finite' if bad == 0 else f'FAIL, {bad} non-finite'}")
    return lines, passed


def _kernel_means(fn, ours: bool = True) -> dict[str, float]:
    """Mean GPU time (ms) of each kernel of one call of ``fn``: our ``_*_kernel`` kernels (short names), or with
    ``ours=False`` every kernel (a peer's names are its own)."""
    import torch

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    means = {}
    for e in prof.key_averages():
        if e.device_time_total <= 0:
            continue
        if not ours:
            means[e.key[:48]] = e.device_time_total / e.count / 1e3
        elif e.key.startswith("_") and e.key.endswith("_kernel"):
            means[e.key.removesuffix("_kernel").lstrip("_")] = e.device_time_total / e.count / 1e3
    return means


def _peak_mib(fn) -> float:
    """GPU memory one call of ``fn`` allocates at its peak, above what was allocated before it (MiB)."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=4, default=[2, 8192, 32, 128], metavar=("B", "T", "H", "D"))
    p.add_argument("--config", action="append", default=[], help="ChunkKDAConfig fields, e.g. num_warps=8,block_k=32")
    p.add_argument("--backward", action="store_true", help="also time and profile forward + backward")
    p.add_argument("--rev", action="append", default=[], help="also time the kernels as of this git revision")
    p.add_argument("--source", action="append", default=[], metavar="FILE",
                   help="also time the kernels of this copy of kernels/kda/chunk.py")
    p.add_argument("--check", action="store_true",
                   help="first check every variant against the fp64 reference (exit status 1 if one fails)")
    p.add_argument("--peer", action="store_true",
                   help="also time fla-core's chunk_kda on the same inputs, with each of its kernels")
    args = p.parse_args(argv)
    try:
        configs = [parse_config(text) for text in args.config] or [parse_config("")]
    except ValueError as exc:
        p.error(str(exc))
    from k3.kernels.kda.chunk import chunk_kda

    runs = [(str(cfg), chunk_kda, cfg) for cfg in configs]
    others = [("revision", load_revision, rev) for rev in args.rev]
    others += [("source", load_source, source) for source in args.source]
    for kind, load, what in others:  # each with its own default config
        try:
            module = load(what)
        except ValueError as exc:
            p.error(str(exc))
        cfg = module.ChunkKDAConfig()
        runs.append((f"{kind} {what}: {cfg}", module.chunk_kda, cfg))
    peer = None
    if args.peer:
        from k3.kernels.bench import FLA_CHUNK_KDA_KWARGS, _fla

        fla = _fla()
        if fla is None:
            p.error("--peer needs fla-core installed (pip install fla-core==0.6.0)")
        peer = functools.partial(fla[0], **FLA_CHUNK_KDA_KWARGS)
    import torch

    if not torch.cuda.is_available():
        print("kda_stages needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.", file=sys.stderr)
        return 2
    from k3.kernels.bench import _kda_inputs, time_ms

    B, T, H, D = args.shape
    dev = torch.device("cuda")
    q, k, v, g_raw, beta_raw, A_log, dt_bias = _kda_inputs(B, T, H, D, dev, requires_grad=args.backward)
    do = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    print(f"B{B} T{T} H{H} D{D} on {torch.cuda.get_device_name(0)}")
    calls = [(title, functools.partial(kda, config=cfg), True) for title, kda, cfg in runs]
    if peer is not None:
        calls.append(("fla-core chunk_kda (safe gate, lower bound -5, gate/L2/beta in kernel)", peer, False))
    failed = []
    if args.check:
        for title, kda, ours in calls:
            if ours:
                lines, passed = check_lines(kda, dev, args.shape)
                print(f"\n{title}\n" + "\n".join(lines))
                if not passed:
                    failed.append(title)
    for title, kda, ours in calls:

        def forward(kda=kda):
            with torch.no_grad():
                return kda(q, k, v, g_raw, beta_raw, A_log=A_log, dt_bias=dt_bias)

        def forward_backward(kda=kda):
            o, _ = kda(q, k, v, g_raw, beta_raw, A_log=A_log, dt_bias=dt_bias)
            o.backward(do)

        print(f"\n{title}")
        passes = [("fwd", forward)] + ([("fwd+bwd", forward_backward)] if args.backward else [])
        for label, fn in passes:
            try:
                ms = time_ms(fn, warmup=5, iters=20)
            except Exception as exc:  # a variant that fails to build or run is reported; the others still run
                print(f"  {label:8s} failed: {type(exc).__name__}: {str(exc)[:400]}")
                break
            stages = "  ".join(f"{name} {t:.3f}" for name, t in _kernel_means(fn, ours).items())
            print(f"  {label:8s} {ms:8.3f} ms, peak {_peak_mib(fn):6.0f} MiB | per kernel (ms): {stages}")
    if failed:
        print("\nfailed the checks: " + "; ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
