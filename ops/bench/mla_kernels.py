"""The two split kernels of the absorbed MLA decode side by side: the portable Triton one and the sm90 Gluon one.

For each (Tq, heads) it checks both kernels against the torch reference on ragged sequences, then times each with
CUDA-graph replays (median of 50) over B sequences of L cached tokens, twice: with the block table as drawn
(pages scattered over the pool: the cache comes from HBM) and with every entry pointing to one page (the reads
are served from L2, so the time is about what the products and the softmax take). The second figure tells how
far a kernel is from the memory bound on a card with more bandwidth than this one. The copy ceiling is measured
in the same process.

    python ops/bench/mla_kernels.py
    python ops/bench/mla_kernels.py --batch 8 --length 32768 --rows 4x16 1x64 2x32

Needs a CUDA GPU (exit status 2 without one); the sm90 kernel needs a Hopper card (other cards time the portable
kernel only).
"""

from __future__ import annotations

import argparse
import sys


def _rel_rms(actual, expected) -> float:
    return float((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())


def _rows(spec: str) -> tuple[int, int]:
    """``TqxH`` -> ``(Tq, H)``, both positive."""
    try:
        Tq, H = (int(v) for v in spec.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TqxH such as 4x16, got {spec!r}") from None
    if Tq < 1 or H < 1:
        raise argparse.ArgumentTypeError(f"Tq and H must be positive, got {spec!r}")
    return Tq, H


def _time(fn, inputs, config) -> float:
    from k3.kernels.bench import time_ms

    return time_ms(lambda: fn(*inputs, validate=False, config=config), graph=True, iters=50)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--rows", nargs="+", type=_rows, default=[(4, 16), (1, 64), (2, 32)], metavar="TqxH",
                        help="query tokens x heads per problem (default: 4x16 1x64 2x32)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from k3.kernels.bench import _paged, time_ms
    from k3.kernels.mla.decode import MLAConfig, mla_decode_attention
    from k3.kernels.mla.reference import mla_decode_attention_reference

    dev = torch.device("cuda")
    x = torch.empty(1 << 28, device=dev, dtype=torch.uint8)
    y = torch.empty_like(x)
    copy = 2 * x.numel() / time_ms(lambda: y.copy_(x), graph=True, iters=50) / 1e9
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy {copy:.2f} TB/s")
    hopper = torch.cuda.get_device_capability()[0] == 9
    kernels = {"portable": MLAConfig(sm90=False), **({"sm90": MLAConfig(sm90=True)} if hopper else {})}
    B, L = args.batch, args.length
    cache_bytes = B * L * 576 * 2
    for Tq, H in args.rows:
        ql, qe, kv, table, lens = _paged(B, L, H, Tq, 64, dev)
        one_page = torch.full_like(table, int(table[0, 0]))
        small = _paged(5, 0, H, Tq, 64, dev, lengths=[70, 1000, 333, 64, 4097])
        expected = mla_decode_attention_reference(*(t.float() for t in small[:3]), *small[3:])
        for name, cfg in kernels.items():
            err = _rel_rms(mla_decode_attention(*small, config=cfg).float(), expected)
            ms, ms_l2 = (_time(mla_decode_attention, (ql, qe, kv, pages, lens), cfg) for pages in (table, one_page))
            rate = cache_bytes / ms / 1e9
            print(f"Tq={Tq} H={H:<3d} {name:8s} {ms:.4f} ms  {rate:.2f} TB/s  {100 * rate / copy:3.0f}% of copy | "
                  f"one page (L2) {ms_l2:.4f} ms | rel RMS vs reference {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
