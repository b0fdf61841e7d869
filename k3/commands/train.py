"""``k3 train``: pretrain a small preset on the offline corpus, with checkpoints, exact resume and a loss plot.

Options left out on the command line keep their ``TrainConfig`` defaults for a new run; with ``--resume`` they
keep the run's saved values, and giving a different value for a setting that changes what the run computes
(preset, steps, lr, ...) is an error rather than a silently different run. Ctrl-C finishes the current step,
saves a checkpoint and exits with status 130; ``--resume`` continues from it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from k3.commands.vision_options import add_vision_options, run_vision, wants_vision

PRESETS = ("tiny", "small")

# CLI option -> TrainConfig field, for the options that map one to one.
_FIELDS = {
    "preset": "preset", "steps": "steps", "seed": "seed", "lr": "lr", "batch_tokens": "batch_tokens",
    "eval_every": "eval_every", "save_every": "save_every", "tokenizer": "tokenizer_dir",
    "max_minutes": "max_minutes", "stop_at": "stop_at", "stages": "stages", "corpus": "corpus_root",
    "corpus_bytes": "corpus_max_bytes", "threads": "threads", "device": "device", "cache_dir": "cache_dir",
}


def int_at_least(minimum: int):
    """An argparse type: an integer of at least ``minimum``, with a clear message otherwise."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _stages(text: str) -> tuple[tuple[float, int], ...]:
    """``0.5:128,0.3:256,0.2:512`` -> ((0.5, 128), (0.3, 256), (0.2, 512))."""
    stages = []
    for part in text.split(","):
        fraction, sep, seq_len = part.strip().partition(":")
        if not sep:
            raise argparse.ArgumentTypeError(f"stage {part!r} lacks ':' (FRACTION:SEQ_LEN)")
        try:
            stages.append((float(fraction), int(seq_len)))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected FRACTION:SEQ_LEN pairs separated by commas (e.g. 0.5:128,0.5:256), got {text!r}"
            ) from None
    return tuple(stages)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train", help="pretrain a small preset on the offline corpus (checkpoints, resume, loss plot)",
        description="Pretrain a K3 preset on the Python standard library's sources and docs (offline). "
                    "Writes DIR/checkpoint-STEP/, DIR/latest, DIR/metrics.jsonl and DIR/loss.png.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="run folder (new and empty, or with --resume)")
    p.add_argument("--resume", action="store_true", help="continue the run in DIR from its latest checkpoint")
    p.add_argument("--preset", choices=PRESETS, help="model preset (default: tiny)")
    p.add_argument("--steps", type=int_at_least(1), help="optimizer steps of the whole run (default: 20)")
    p.add_argument("--seed", type=int_at_least(0), help="seed of initialisation and batches (default: 0)")
    p.add_argument("--lr", type=_positive_float, help="peak learning rate (default: 0.02)")
    p.add_argument("--batch-tokens", type=int_at_least(1), help="tokens per step (default: 512)")
    p.add_argument("--eval-every", type=int_at_least(0), help="steps between evals, 0: start/end (default: 10)")
    p.add_argument("--save-every", type=int_at_least(0), help="steps between checkpoints, 0: end (default: 10)")
    p.add_argument("--stages", type=_stages, metavar="F:LEN,...",
                   help="progressive context, fractions of steps and sequence lengths (default: 0.5:128,0.3:256,0.2:512)")
    p.add_argument("--tokenizer", metavar="DIR", help="saved tokenizer folder (default: byte-level tokenizer)")
    p.add_argument("--corpus", metavar="DIR", help="folder of text files (default: the Python standard library)")
    p.add_argument("--corpus-bytes", type=int_at_least(1), help="corpus size cap in bytes (default: 16000000)")
    p.add_argument("--cache-dir", metavar="DIR", help="tokenised corpus cache (default: DIR/cache)")
    p.add_argument("--max-minutes", type=_positive_float, help="stop with a checkpoint after this many minutes")
    p.add_argument("--stop-at", type=int_at_least(1), metavar="STEP",
                   help="stop with a checkpoint after STEP (the schedule still spans --steps)")
    p.add_argument("--threads", type=int_at_least(1), help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--device", help="torch device (default: cpu)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    add_vision_options(p, data=False)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from k3.cli import CLIError
    from k3.model.checkpoint import CheckpointError, latest_checkpoint
    from k3.model.train import TrainConfig, TrainError, resume_config, train

    if wants_vision(args):  # image-text training from a fresh preset: k3.commands.vision_options
        return run_vision(args, checkpoint=None, preset=args.preset)
    out = Path(args.out)
    given = {field: getattr(args, option) for option, field in _FIELDS.items() if getattr(args, option) is not None}
    given["progress"] = not args.no_progress
    try:
        if args.resume:
            if not out.is_dir() or latest_checkpoint(out) is None:
                raise CLIError(f"--resume: {str(out)!r} has no checkpoint to resume from (no {out / 'latest'})")
            cfg = resume_config(out, **given)
        else:
            if out.exists() and (not out.is_dir() or any(out.iterdir())):
                raise CLIError(f"--out {str(out)!r} exists and is not empty; pass --resume to continue that run "
                               f"or choose another folder")
            cfg = TrainConfig(out_dir=str(out), **given)
        result = train(cfg)
    except (TrainError, CheckpointError) as exc:
        raise CLIError(str(exc)) from None

    losses = result.eval_losses
    if len(losses) >= 2:
        first, last = losses[0][1], losses[-1][1]
        print(f"eval loss {first:.4f} (step {losses[0][0]}) -> {last:.4f} (step {losses[-1][0]}), "
              f"{100 * (first - last) / first:.1f}% lower")
    print(f"steps {result.step}/{result.steps}, {result.tokens:,} tokens, {result.wall_seconds:.1f} s this run")
    print(f"checkpoint: {result.checkpoint}")
    print(f"loss curve: {result.plot}")
    print(f"metrics:    {result.metrics}")
    if result.stopped == "interrupted":
        print(f"interrupted at step {result.step}; continue with: k3 train --out {out} --resume")
        return 130
    if result.stopped is not None:
        print(f"stopped at step {result.step} ({result.stopped}); continue with: k3 train --out {out} --resume")
    return 0
