"""Train a small multimodal model on the generated counting task and report held-out accuracy vs chance.

    python ops/bench/vision_task.py --out runs/vision-count [--bpe 512] [--preset tiny] [--steps 200]

Runs ``k3.model.vision_sft`` (the same loop as ``k3 sft --task vision-count``) with one torch thread: the
``tiny`` language model and the ``vit-tiny`` encoder trained together from scratch on pictures with 0-4 red
shapes among other shapes ("How many red shapes are there?"). Held-out pictures come from a disjoint seeded
stream. Prints one JSON object: accuracy and chance at the start and the end, the answer loss, steps,
samples seen, wall and CPU seconds, and the checkpoint (servable with ``k3 up --checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def train_task_tokenizer(folder: str, vocab_size: int, seed: int) -> None:
    """A BPE trained on 2 000 rendered train chats of the task (text only; images are one placeholder)."""
    import tempfile

    from k3.model.tokenizer import ByteTokenizer, train_tokenizer
    from k3.model.vision_data import CountTask, chat_messages
    from k3.model.xtml import render

    task = CountTask(seed)
    texts = [render(chat_messages(task.sample("train", i), True), thinking=False, add_generation_prompt=False)
             for i in range(2000)]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "chats.txt"
        corpus.write_text("\n".join(texts), encoding="utf-8")
        tokenizer = train_tokenizer([corpus], vocab_size, folder)
    sample = render(chat_messages(task.sample("train", 0), True), thinking=False, add_generation_prompt=False)
    print(f"tokenizer: {len(ByteTokenizer().encode_structure(sample))} byte tokens -> "
          f"{len(tokenizer.encode_structure(sample))} BPE tokens per chat (before image expansion)",
          file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="new run folder")
    parser.add_argument("--preset", default="tiny", help="language-model preset (tiny or small)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--eval-samples", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-minutes", type=float, default=None)
    parser.add_argument("--bpe", type=int, metavar="VOCAB",
                        help="train a byte-level BPE of this many ids (<= the preset's vocabulary) on rendered "
                        "task chats first: the XTML markup then takes a few tokens instead of one per byte")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from k3.model.vision_sft import VisionSFTConfig, vision_sft

    tokenizer = None
    if args.bpe:
        tokenizer = str(Path(args.out + "-tokenizer"))
        train_task_tokenizer(tokenizer, args.bpe, args.seed)
    result = vision_sft(VisionSFTConfig(
        out_dir=args.out, task="vision-count", preset=args.preset, tokenizer=tokenizer, steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr, eval_samples=args.eval_samples, eval_every=args.eval_every, seed=args.seed, threads=1,
        max_minutes=args.max_minutes, progress=not args.no_progress,
    ))
    first, last = result.evaluations[0], result.evaluations[-1]
    print(json.dumps({
        "task": "vision-count", "preset": args.preset, "vision_preset": "vit-tiny", "steps": result.step,
        "samples_seen": result.step * args.batch_size, "held_out": last.samples,
        "accuracy_start": round(first.accuracy, 4), "accuracy": round(last.accuracy, 4),
        "chance": round(last.chance, 4), "answer_loss": round(last.loss, 4),
        "curve": [[e.step, round(e.accuracy, 4)] for e in result.evaluations],
        "wall_s": round(result.wall_seconds, 1), "cpu_s": round(result.cpu_seconds, 1),
        "checkpoint": str(result.checkpoint), "tokenizer": "byte" if tokenizer is None else f"bpe-{args.bpe}",
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
