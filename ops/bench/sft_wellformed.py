"""Measure how well-formed a checkpoint's chat replies are (run it before and after ``k3 sft``).

    python ops/bench/sft_wellformed.py --checkpoint runs/sft/ [--n 50] [--max-new-tokens 448]

For held-out prompts (the eval split of ``k3.model.sft_data``: never trained on), half reasoning tasks and
half tool-use dialogues, the conversation up to the first assistant turn is rendered with the generation
prompt at the conversation's thinking effort, a reply is generated greedily (stopping at ``<|end_of_msg|>``)
and parsed by the strict XTML parser as it streams. The default length limit covers the longest reference
reply of the held-out set (about 400 byte-level tokens). Printed as JSON:

- ``wellformed``: share of replies that parse in strict mode (a reply cut off by ``--max-new-tokens`` does
  not), overall and per kind;
- ``reasoning.accuracy``: share of reasoning prompts whose well-formed reply's response scores 1.0 under
  reasoning-gym's scorer (``mean_score`` averages the partial scores); per effort as well;
- ``tools.right_tool``: share of the tool-needing prompts whose reply is well-formed and calls exactly the
  expected set of tool names; ``tools.no_call_when_none``: share of the prompts needing no tool whose reply is
  well-formed and calls none.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def _reply(model: Any, tokenizer: Any, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], Any, str | None]:
    """Greedy reply, parsed strictly while it streams: ``(ids, parsed message or None, error or None)``.

    Generation stops at ``<|end_of_msg|>``, at ``max_new_tokens``, or as soon as the strict parser rejects
    the stream (nothing generated afterwards could make it well-formed again), which keeps the measurement
    of an untrained model cheap. Same greedy rule as ``k3.model.generate`` (argmax, lowest id on ties).
    """
    import torch

    from k3.model.xtml import StreamParser, XTMLParseError

    end = tokenizer.special_id("end_of_msg")
    parser = StreamParser(mode="strict", thinking=True, tokenizer=tokenizer)
    budget = max(1, min(max_new_tokens, model.cfg.max_seq_len - len(prompt_ids)))
    device = next(model.parameters()).device
    logits, state = model.prefill(torch.as_tensor(prompt_ids, dtype=torch.long, device=device))
    next_logits = logits[-1:]
    ids: list[int] = []
    try:
        for _ in range(budget):
            token = next_logits.argmax(dim=-1)
            token_id = int(token[0])
            ids.append(token_id)
            if not 0 <= token_id < tokenizer.vocab_size:
                # The model's vocabulary may be larger than its tokenizer's: such an id is no text at all.
                raise XTMLParseError("id outside the tokenizer's vocabulary", position=len(ids) - 1, unit="token",
                                     expected=f"an id below {tokenizer.vocab_size}", found=str(token_id))
            parser.feed(token_id)
            if token_id == end:
                break
            next_logits, (state,) = model.decode(token, [state])
        return ids, parser.finish(), None
    except XTMLParseError as exc:
        return ids, None, str(exc)


def _share(values: list[bool]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def measure(checkpoint: str, n: int, max_new_tokens: int, seed: int, samples: int) -> dict[str, Any]:
    import torch

    from k3.model.checkpoint import load_model
    from k3.model.sft_data import ConversationBank
    from k3.model.xtml import render_ids

    model, _, tokenizer = load_model(checkpoint)
    bank = ConversationBank(seed)
    convs = bank.held_out("reasoning", (n + 1) // 2) + bank.held_out("tools", n // 2)
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    with torch.no_grad():
        for conv in convs:
            prompt = render_ids(conv.first_turn(), tokenizer, list(conv.tools) if conv.tools else None,
                                thinking_effort=conv.effort, add_generation_prompt=True)
            ids, message, error = _reply(model, tokenizer, prompt, max_new_tokens)
            row: dict[str, Any] = {"kind": conv.kind, "name": conv.name, "effort": conv.effort,
                                   "wellformed": message is not None, "error": error, "tokens": len(ids)}
            if conv.kind == "reasoning":
                row["score"] = bank.score(conv, message.content.strip()) if message is not None else 0.0
            else:
                called = sorted({c["name"] for c in message.tool_calls}) if message is not None else None
                row["expected"], row["called"] = sorted(set(conv.expected_tools)), called
            row["reply"] = "".join(tokenizer.decode([t]) if 0 <= t < tokenizer.vocab_size else f"<?{t}>"
                                   for t in ids)
            rows.append(row)
    reasoning = [r for r in rows if r["kind"] == "reasoning"]
    tools = [r for r in rows if r["kind"] == "tools"]
    needing = [r for r in tools if r["expected"]]
    none = [r for r in tools if not r["expected"]]
    by_effort = {
        effort: {"n": len(group), "wellformed": _share([r["wellformed"] for r in group]),
                 "accuracy": _share([r["score"] == 1.0 for r in group])}
        for effort in ("low", "high", "max")
        if (group := [r for r in reasoning if r["effort"] == effort])
    }
    return {
        "checkpoint": checkpoint,
        "n": len(rows),
        "max_new_tokens": max_new_tokens,
        "wellformed": _share([r["wellformed"] for r in rows]),
        "reasoning": {
            "n": len(reasoning),
            "wellformed": _share([r["wellformed"] for r in reasoning]),
            "accuracy": _share([r["score"] == 1.0 for r in reasoning]),
            "mean_score": round(sum(r["score"] for r in reasoning) / len(reasoning), 4) if reasoning else None,
            "by_effort": by_effort,
        },
        "tools": {
            "n": len(tools),
            "wellformed": _share([r["wellformed"] for r in tools]),
            "right_tool": _share([r["wellformed"] and r["called"] == r["expected"] for r in needing]),
            "no_call_when_none": _share([r["wellformed"] and r["called"] == [] for r in none]),
            "needing_tools": len(needing),
        },
        "seconds": round(time.monotonic() - started, 1),
        "mean_reply_tokens": round(sum(r["tokens"] for r in rows) / len(rows), 1),
        "samples": [{k: r[k] for k in ("kind", "name", "effort", "wellformed", "error", "reply")}
                    for r in rows[:samples]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder (latest)")
    parser.add_argument("--n", type=int, default=50, help="held-out prompts, half reasoning, half tools")
    parser.add_argument("--max-new-tokens", type=int, default=448, help="reply length limit (default 448)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the conversation bank (default 0)")
    parser.add_argument("--samples", type=int, default=0, help="include the first K replies in the JSON")
    parser.add_argument("--threads", type=int, help="CPU threads for torch")
    args = parser.parse_args(argv)
    if args.n < 1 or args.max_new_tokens < 1 or args.samples < 0:
        parser.error("--n and --max-new-tokens must be positive, --samples >= 0")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from k3.model.checkpoint import CheckpointError

    try:
        result = measure(args.checkpoint, args.n, args.max_new_tokens, args.seed, args.samples)
    except CheckpointError as exc:
        print(f"sft_wellformed: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
