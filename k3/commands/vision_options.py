"""Image-text training options shared by ``k3 train`` and ``k3 sft`` (``k3.model.vision_sft``).

``k3 train --task vision-count --preset tiny --out DIR`` trains a fresh language model and vision encoder
together on the generated counting task; ``k3 sft --checkpoint RUN --task vision-count --out DIR`` (or
``--vision-data FILE.jsonl``, lines ``{"images": [...], "question": ..., "answer": ...}``) starts the
language model from a pretrained checkpoint instead. The checkpoint holds the encoder in ``vision/``;
``k3 up --checkpoint DIR`` then serves it with the vision service. Not a subcommand of its own: this module
only adds the options and runs the loop.
"""

from __future__ import annotations

import argparse


def add_vision_options(parser: argparse.ArgumentParser, *, data: bool) -> None:
    group = parser.add_argument_group("image-text training (vision encoder trained with the model)")
    group.add_argument("--task", choices=["vision-count"], help="train on a generated image-text task")
    if data:
        group.add_argument("--vision-data", metavar="FILE",
                           help="JSONL of image-text samples (images, question, answer); every 10th is held out")
    group.add_argument("--vision-preset", default="vit-tiny", help="vision encoder preset (default: vit-tiny)")
    group.add_argument("--batch-size", type=int, help="image-text samples per step (default: 32)")
    group.add_argument("--eval-samples", type=int, help="held-out samples per evaluation (default: 200)")


def wants_vision(args: argparse.Namespace) -> bool:
    return bool(args.task or getattr(args, "vision_data", None))


def run_vision(args: argparse.Namespace, *, checkpoint: str | None, preset: str | None) -> int:
    """Run ``vision_sft`` from the parsed options of ``k3 train``/``k3 sft`` and print the outcome."""
    from k3.cli import CLIError
    from k3.model.checkpoint import CheckpointError
    from k3.model.vision_sft import VisionSFTConfig, VisionSFTError, vision_sft

    if getattr(args, "resume", False):
        raise CLIError("--resume is not supported for image-text training; start a new run from the "
                       "checkpoint with --checkpoint")
    options = {
        "out_dir": args.out, "task": args.task, "data": getattr(args, "vision_data", None),
        "checkpoint": checkpoint, "vision_preset": args.vision_preset, "progress": not args.no_progress,
    }
    if options["data"] is not None:
        options["task"] = None if args.task is None else args.task
    for option, name in (("steps", "steps"), ("lr", "lr"), ("seed", "seed"), ("batch_size", "batch_size"),
                         ("eval_samples", "eval_samples"), ("eval_every", "eval_every"), ("threads", "threads"),
                         ("device", "device"), ("max_minutes", "max_minutes")):
        value = getattr(args, option, None)
        if value is not None:
            options[name] = value
    if preset is not None:
        options["preset"] = preset
    if getattr(args, "tokenizer", None) is not None:
        options["tokenizer"] = args.tokenizer
    try:
        result = vision_sft(VisionSFTConfig(**options))
    except (VisionSFTError, CheckpointError) as exc:
        raise CLIError(str(exc)) from None
    first, last = result.evaluations[0], result.evaluations[-1]
    print(f"held-out accuracy {first.accuracy:.1%} (step {first.step}) -> {last.accuracy:.1%} (step {last.step}); "
          f"chance {last.chance:.1%}; {last.samples} held-out samples")
    done = "finished" if result.stopped is None else f"stopped ({result.stopped})"
    print(f"{done}: {result.step} steps, {result.wall_seconds:.1f} s ({result.cpu_seconds:.1f} CPU s)")
    print(f"checkpoint: {result.checkpoint} (vision encoder in {result.checkpoint / 'vision'})")
    return 0
