#!/usr/bin/env python3
"""Write a synthetic request trace in Mooncake's format, with the prefix sharing of chat traffic.

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}`` with
one hash id per 512-token block of the prompt (the last block may be partial). Equal ids mean equal block
contents *and* equal prefixes before them, so two prompts share exactly their common leading ids.

The traffic model:

- a few shared system prompts (tool declarations, instructions), chosen with a Zipf-like skew, so many
  conversations start with the same blocks;
- multi-turn conversations: turn ``t`` sends the whole history (system prompt, earlier user messages and
  answers) plus a new user message, so it shares every full block of turn ``t - 1``'s prompt and answer;
- conversations start as a Poisson process and wait a random "think time" between turns; lines are sorted
  by timestamp, so the turns of different conversations interleave as they would in a real log.

Block ids: a block that lies inside a system prompt is named by (system prompt, block number) and thus shared
by all conversations using it; any other block by (conversation, block number, tokens it holds), so a block
that was the partial tail of one turn's prompt gets a new id once later text fills it. Standard library
only; deterministic for a given ``--seed``.

    python ops/traces/synth.py --conversations 200 --seed 0 --out trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys

BLOCK_TOKENS = 512


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW-HIGH, got {text!r}") from None
    if lo < 0 or hi < lo:
        raise argparse.ArgumentTypeError(f"expected 0 <= LOW <= HIGH, got {text!r}")
    return lo, hi


class BlockIds:
    """Hands out hash ids, one per distinct (prefix owner, block number, tokens held)."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def get(self, key: tuple) -> int:
        if key not in self._ids:
            self._ids[key] = len(self._ids)
        return self._ids[key]


def prompt_hash_ids(ids: BlockIds, system: int, system_tokens: int, conversation: int, length: int) -> list[int]:
    out = []
    for j in range(-(-length // BLOCK_TOKENS)):
        end = min((j + 1) * BLOCK_TOKENS, length)
        if end <= system_tokens and end == (j + 1) * BLOCK_TOKENS:
            out.append(ids.get(("system", system, j)))
        else:
            out.append(ids.get(("conversation", conversation, j, end)))
    return out


def generate(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    system_lengths = [rng.randint(*args.system_tokens) for _ in range(args.system_prompts)]
    weights = [1.0 / (k + 1) for k in range(args.system_prompts)]
    ids = BlockIds()
    records = []
    start = 0.0
    for c in range(args.conversations):
        start += rng.expovariate(args.rate)
        system = rng.choices(range(args.system_prompts), weights)[0]
        history = system_lengths[system]
        t = start
        for _ in range(rng.randint(*args.turns)):
            input_length = history + max(1, rng.randint(*args.user_tokens))
            output_length = rng.randint(*args.output_tokens)
            records.append({
                "timestamp": int(t * 1000),
                "input_length": input_length,
                "output_length": output_length,
                "hash_ids": prompt_hash_ids(ids, system, system_lengths[system], c, input_length),
            })
            history = input_length + output_length
            t += rng.expovariate(1.0 / args.think_seconds)
    records.sort(key=lambda r: r["timestamp"])
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=200, help="conversations to generate")
    parser.add_argument("--system-prompts", type=int, default=8, help="distinct shared system prompts")
    parser.add_argument("--system-tokens", type=_range, default=(1000, 6000), help="system prompt length range")
    parser.add_argument("--turns", type=_range, default=(1, 6), help="turns per conversation")
    parser.add_argument("--user-tokens", type=_range, default=(20, 1500), help="new user tokens per turn")
    parser.add_argument("--output-tokens", type=_range, default=(20, 800), help="answer tokens per turn")
    parser.add_argument("--rate", type=float, default=2.0, help="new conversations per second")
    parser.add_argument("--think-seconds", type=float, default=20.0, help="mean pause between turns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="output file (default: stdout)")
    args = parser.parse_args(argv)
    for name in ("conversations", "system_prompts"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.rate <= 0 or args.think_seconds <= 0:
        parser.error("--rate and --think-seconds must be > 0")
    if args.turns[0] < 1:
        parser.error("--turns must be at least 1")
    lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in generate(args))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(lines)
    else:
        sys.stdout.write(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
