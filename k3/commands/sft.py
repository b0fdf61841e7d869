"""``k3 sft``: supervised fine-tuning of a pretrained checkpoint on XTML chat data.

``k3 sft --checkpoint DIR --out DIR2 [--steps N] [--mix reasoning=0.5,tools=0.5] [--seed S] ...`` starts a
run; ``k3 sft --out DIR2 --resume`` continues it from its latest checkpoint (options given with ``--resume``
must match the run, except those that only decide how it runs: eval/save cadence, time limit, threads,
progress). The loss is on assistant tokens only; see ``k3.model.sft`` and ``k3.model.sft_data``.
Torch and the data libraries are imported only when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from k3.commands.vision_options import add_vision_options, run_vision, wants_vision

# CLI option -> SFTConfig field, for the options that map one to one.
_FIELDS = {
    "checkpoint": "checkpoint", "steps": "steps", "mix": "mix", "seed": "seed", "lr": "lr",
    "batch_tokens": "batch_tokens", "eval_every": "eval_every", "eval_conversations": "eval_conversations",
    "save_every": "save_every", "keep_last": "keep_last", "max_minutes": "max_minutes", "stop_at": "stop_at",
    "threads": "threads", "device": "device",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sft", help="supervised fine-tuning on chat data (assistant tokens only)",
        description="Fine-tune a pretrained checkpoint on offline XTML conversations: reasoning-gym tasks at "
                    "low/high/max thinking effort and synthetic multi-turn tool use.",
    )
    parser.add_argument("--checkpoint", help="pretrained checkpoint or run folder to start from (new runs)")
    parser.add_argument("--out", required=True, help="run folder for checkpoints, metrics.jsonl and loss.png")
    parser.add_argument("--steps", type=int, help="optimizer steps of the whole run (default 200)")
    parser.add_argument("--mix", help="share of each conversation kind (default reasoning=0.5,tools=0.5)")
    parser.add_argument("--seed", type=int, help="seed of the conversations and their order (default 0)")
    parser.add_argument("--lr", type=float, help="peak learning rate (default 0.005)")
    parser.add_argument("--batch-tokens", type=int, help="token budget per step (default 4096)")
    parser.add_argument("--eval-every", type=int, help="evaluate every N steps (default 50)")
    parser.add_argument("--eval-conversations", type=int, help="held-out conversations for the eval loss")
    parser.add_argument("--save-every", type=int, help="checkpoint every N steps (default 100)")
    parser.add_argument("--keep-last", type=int, help="keep the N newest checkpoints (default 2, 0 = all)")
    parser.add_argument("--max-minutes", type=float, help="stop with a checkpoint after this many minutes")
    parser.add_argument("--stop-at", type=int, help="stop with a checkpoint after this step (resume continues)")
    parser.add_argument("--threads", type=int, help="CPU threads for torch")
    parser.add_argument("--device", help="torch device (default cpu)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    parser.add_argument("--no-progress", action="store_true", help="no live progress bar")
    add_vision_options(parser, data=True)
    parser.set_defaults(func=run_sft)


def _given(args: argparse.Namespace) -> dict[str, Any]:
    return {field: getattr(args, option) for option, field in _FIELDS.items() if getattr(args, option) is not None}


def run_sft(args: argparse.Namespace) -> int:
    from k3.cli import CLIError
    from k3.model.checkpoint import CheckpointError
    from k3.model.sft import SFTConfig, SFTError, resume_sft_config, sft

    if wants_vision(args):  # image-text training: k3.commands.vision_options
        return run_vision(args, checkpoint=args.checkpoint, preset=None)
    given = _given(args)
    try:
        if args.resume:
            cfg = resume_sft_config(args.out, **given, progress=not args.no_progress)
        else:
            if "checkpoint" not in given:
                raise CLIError("--checkpoint is required to start a new run (or pass --resume)")
            cfg = SFTConfig(out_dir=args.out, progress=not args.no_progress, **given)
        result = sft(cfg)
    except (SFTError, CheckpointError) as exc:
        raise CLIError(str(exc)) from None
    done = "finished" if result.finished else f"stopped ({result.stopped}) at step {result.step}"
    print(f"sft {done}: {result.step}/{result.steps} steps, {result.tokens:,} tokens, "
          f"{result.wall_seconds:.1f} s")
    if result.eval_losses:
        first, last = result.eval_losses[0], result.eval_losses[-1]
        print(f"held-out assistant loss {first[1]:.4f} (step {first[0]}) -> {last[1]:.4f} (step {last[0]})")
    print(f"checkpoint: {result.checkpoint}")
    print(f"loss curve: {result.plot}")
    print(f"metrics:    {result.metrics}")
    return 0
