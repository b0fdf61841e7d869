"""One decode step two ways: ``K3Model.decode`` (states in and out) against ``K3Model.decode_paged`` (in place).

    python ops/bench/decode_step.py [--preset small] [--batch 1 16] [--context 512 4096] [--device cpu]

For every (batch, context) pair: ``batch`` sequences of ``context`` cached tokens (random states, seeded: the
time of a step does not depend on the values) run one decode step

- through ``K3Model.decode``, which takes and returns ``SequenceState``s: it stacks the KDA states, appends the
  new latent row to each MLA cache (a copy of the cache) and, on the kernel path, packs the caches into pages;
- through ``K3Model.decode_paged`` on the same states moved into a slot pool and pages of 64 tokens, as the
  serving engine holds them: the step writes one row per sequence and reads the rest where it lies.

With ``--graph`` (CUDA only) the in-place step is also captured in a CUDA graph and replayed: the step has no
host synchronisation on the kernel path (tested), so the whole step, every layer's launches, becomes one graph
launch. The replay's logits are checked against the same step run eagerly ("diff"), beside the difference
between two eager runs of that step ("repeat"): the MoE's combine adds with atomics, so a step need not repeat
bit for bit, and with random weights a bf16 model amplifies such differences.

Both run the same kernels (``K3_KERNELS`` decides, as everywhere); their logits are compared (relative max
difference) so the times are of the same computation. Times are medians over ``--iters`` calls after one
warm-up (CUDA-synchronised on a GPU). Prints a table and, with ``--json PATH``, writes the rows there.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

from k3.commands.train import int_at_least

positive = int_at_least(1)


def random_state(model, context: int, gen):
    """A ``SequenceState`` of ``context`` tokens with seeded random contents, in the model's dtype."""
    import torch

    from k3.model.state import SequenceState

    dev, dtype = model.embed.weight.device, model.embed.weight.dtype
    state = SequenceState.fresh(model.cfg, dev, dtype)
    state.num_tokens = context
    for kda in state.kda.values():
        for name, value in kda.to_dict().items():
            getattr(kda, name).copy_(0.1 * torch.randn(value.shape, generator=gen).to(value.dtype))
    for cache in state.mla.values():
        cache.c_kv = torch.randn(context, model.cfg.kv_lora_rank, generator=gen).to(dev, dtype)
        cache.k_extra = torch.randn(context, model.cfg.qk_extra_dim, generator=gen).to(dev, dtype)
    return state


def median_ms(fn, iters: int, cuda: bool) -> float:
    import torch

    fn()  # warm-up (compiles kernels on a GPU)
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def third_step(paged, tokens):
    """The logits of ``paged``'s third eager step: what a graph replays after its two warm-up calls."""
    return [paged.logits(tokens) for _ in range(3)][-1]


def graph_step(paged, tokens):
    """``paged.logits(tokens)`` captured in a CUDA graph: ``(replay, logits)``, ``logits`` being the tensor each
    replay rewrites. Two warm-up calls first, on a side stream as capture requires (they compile the kernels).

    The graph holds raw addresses of ``paged``'s pools, pages and tables, so ``graph.buffers`` keeps ``paged``
    alive as long as the graph: were it collected, a replay would read memory since reused or returned."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            paged.logits(tokens)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = paged.logits(tokens)
    graph.buffers = paged
    return graph.replay, logits


def rel_max_diff(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=positive, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=positive, nargs="+", default=[512, 4096])
    parser.add_argument("--iters", type=positive, default=5)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--graph", action="store_true", help="also time the in-place step as a CUDA graph (cuda)")
    parser.add_argument("--threads", type=positive, default=1, help="CPU intra-op threads")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    import torch

    from k3.kernels.bench_model import PagedBatch
    from k3.model.presets import get_preset
    from k3.model.transformer import K3Model

    if args.device == "cuda" and not torch.cuda.is_available():
        print("decode_step: --device cuda needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.device not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device}")
    if args.graph and args.device != "cuda":
        parser.error("--graph needs --device cuda")
    try:
        cfg = get_preset(args.preset)
    except ValueError as exc:
        parser.error(str(exc))
    if max(args.context) >= cfg.max_seq_len:
        parser.error(f"--context must stay below the preset's max_seq_len {cfg.max_seq_len}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device, cuda = torch.device(args.device), args.device == "cuda"
    with device:
        model = K3Model(cfg).eval().to(getattr(torch, args.dtype))
    gen = torch.Generator().manual_seed(1)
    rows = []
    print(f"{args.preset} ({args.dtype}, {args.device}, {torch.get_num_threads()} thread(s)); ms per step, "
          f"median of {args.iters}")
    graph_head = f" {'graph':>10} {'speed-up':>9} {'diff':>8} {'repeat':>8}" if args.graph else ""
    print(f"{'batch':>5} {'context':>8} {'decode':>10} {'paged':>10} {'speed-up':>9} {'max diff':>9}{graph_head}")
    with torch.no_grad():
        for context in args.context:
            state = random_state(model, context, gen)
            for batch in args.batch:
                states = [state] * batch
                tokens = torch.randint(0, cfg.vocab_size, (batch,), generator=gen).to(device)
                paged = PagedBatch(model, states, room=1)
                want, _ = model.decode(tokens, states)
                got = paged.logits(tokens)
                diff = rel_max_diff(got, want)
                decode_ms = median_ms(functools.partial(model.decode, tokens, states), args.iters, cuda)
                paged_ms = median_ms(functools.partial(paged.logits, tokens), args.iters, cuda)
                row = dict(batch=batch, context=context, decode_ms=decode_ms, paged_ms=paged_ms,
                           speedup=decode_ms / paged_ms, max_rel_diff=diff)
                line = (f"{batch:>5} {context:>8} {decode_ms:>10.2f} {paged_ms:>10.2f} "
                        f"{decode_ms / paged_ms:>8.2f}x {diff:>9.1e}")
                del paged
                if args.graph:
                    # the third step of a fresh copy, eagerly (twice: the floor of the comparison, since the MoE's
                    # combine adds with atomics) and as the replay after two warm-ups
                    want, again = (third_step(PagedBatch(model, states, room=1), tokens) for _ in range(2))
                    replay, logits = graph_step(PagedBatch(model, states, room=1), tokens)
                    replay()
                    row["graph_max_rel_diff"] = rel_max_diff(logits, want)
                    row["eager_repeat_max_rel_diff"] = rel_max_diff(again, want)
                    row["graph_ms"] = median_ms(replay, args.iters, cuda)
                    row["graph_speedup"] = decode_ms / row["graph_ms"]
                    line += (f" {row['graph_ms']:>10.2f} {row['graph_speedup']:>8.2f}x {row['graph_max_rel_diff']:>8.1e}"
                             f" {row['eager_repeat_max_rel_diff']:>8.1e}")
                    del want, again, replay, logits
                rows.append(row)
                print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(preset=args.preset, dtype=args.dtype, device=args.device, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
