"""Where the chunked KDA kernels spend their time: per-kernel GPU time of one call, for launch configs side by side.

For every ``--config`` (``ChunkKDAConfig`` fields as ``name=value`` pairs; the defaults when none is given) it
times the inference forward (``torch.no_grad``, CUDA events, median of 20) and, with ``--backward``, forward +
backward, then runs one more call under ``torch.profiler`` and prints the mean GPU time of each of our
kernels. Use it to see which stage a change moved; ``python -m k3.kernels.bench`` stays the measurement against
the peer.

    python ops/bench/kda_stages.py --backward
    python ops/bench/kda_stages.py --config num_warps=8 --config state_block_v=64,state_num_warps=8

Needs a CUDA GPU (exit status 2 without one).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence


def parse_config(text: str):
    """``"name=value,name=value"`` -> ``ChunkKDAConfig`` (ints where the field is an int); errors name the field."""
    from k3.kernels.kda.chunk import ChunkKDAConfig

    fields = {f.name: f for f in dataclasses.fields(ChunkKDAConfig)}
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
    return ChunkKDAConfig(**kwargs)


def _kernel_means(fn) -> dict[str, float]:
    import torch

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {
        e.key.removesuffix("_kernel").lstrip("_"): e.device_time_total / e.count / 1e3
        for e in prof.key_averages()
        if e.key.startswith("_") and e.key.endswith("_kernel")
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=4, default=[2, 8192, 32, 128], metavar=("B", "T", "H", "D"))
    p.add_argument("--config", action="append", default=[], help="ChunkKDAConfig fields, e.g. num_warps=8,block_k=32")
    p.add_argument("--backward", action="store_true", help="also time and profile forward + backward")
    args = p.parse_args(argv)
    try:
        configs = [parse_config(text) for text in args.config] or [parse_config("")]
    except ValueError as exc:
        p.error(str(exc))
    import torch

    if not torch.cuda.is_available():
        print("kda_stages needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.", file=sys.stderr)
        return 2
    from k3.kernels.bench import _kda_inputs, time_ms
    from k3.kernels.kda.chunk import chunk_kda

    B, T, H, D = args.shape
    dev = torch.device("cuda")
    q, k, v, g_raw, beta_raw, A_log, dt_bias = _kda_inputs(B, T, H, D, dev, requires_grad=args.backward)
    do = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    print(f"B{B} T{T} H{H} D{D} on {torch.cuda.get_device_name(0)}")
    for cfg in configs:

        def forward(cfg=cfg):
            with torch.no_grad():
                return chunk_kda(q, k, v, g_raw, beta_raw, A_log, dt_bias, config=cfg)

        def forward_backward(cfg=cfg):
            o, _ = chunk_kda(q, k, v, g_raw, beta_raw, A_log, dt_bias, config=cfg)
            o.backward(do)

        print(f"\n{cfg}")
        runs = [("fwd", forward)] + ([("fwd+bwd", forward_backward)] if args.backward else [])
        for label, fn in runs:
            ms = time_ms(fn, warmup=5, iters=20)
            stages = "  ".join(f"{name} {t:.3f}" for name, t in _kernel_means(fn).items())
            print(f"  {label:8s} {ms:8.3f} ms | per kernel (ms): {stages}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
