"""``generate``: the single-process reference decoder (prefill once, then one token at a time).

Served output is checked against this function, so its sampling rules are spelled out and kept in one place
(``sample_next``):

- ``temperature == 0``: greedy (argmax; ties go to the lowest id). ``top_p``/``top_k`` are ignored.
- otherwise: logits / temperature, then top-k (keep the k largest; 0 = off), then top-p (keep the smallest
  prefix of the descending-probability order whose mass reaches ``top_p``; the most likely token always
  stays), renormalise, and draw with ``torch.multinomial`` from a ``torch.Generator`` seeded with ``seed``
  (created on the logits' device; ``seed=None`` draws from a non-deterministic seed).
- ``logprobs`` are log-softmax of the raw logits (temperature 1, no filtering) at the chosen token: the
  model's own probability, which is what policy-gradient importance ratios need.
- Generation stops after ``max_new_tokens`` tokens or right after a token in ``stop_token_ids`` (the stop token
  is included in the output; ``finish_reason`` says which).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Generation:
    """Result of ``generate``."""

    token_ids: list[int]
    """Generated ids (prompt excluded; a stop token that ended generation included)."""
    logprobs: list[float]
    """Model log-probability (raw logits, temperature 1) of each generated token."""
    finish_reason: str
    """``"stop"`` (a stop token was produced) or ``"length"`` (``max_new_tokens`` reached)."""


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """Validate sampling parameters; ``ValueError`` names the offending one."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")


def sample_next(logits: Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                generator: torch.Generator | None = None) -> Tensor:
    """Pick one token per row of ``logits`` [B, vocab] -> ids [B] (rules in the module docstring)."""
    check_sampling(temperature, top_p, top_k)
    if temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p  # the first token has mass_before 0 and always stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompt_ids: Sequence[int] | Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
             stop_token_ids: Iterable[int] = ()) -> Generation:
    """Continue ``prompt_ids`` with ``model`` (a ``K3Model``): prefill, then decode token by token."""
    check_sampling(temperature, top_p, top_k)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")
    stop = set(stop_token_ids)
    if any(isinstance(t, bool) or not isinstance(t, int) for t in stop):
        raise ValueError(f"stop_token_ids must be integers, got {sorted(stop, key=repr)!r}")
    device = next(model.parameters()).device
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D sequence of ids, got shape {tuple(prompt.shape)}")
    limit = model.cfg.max_seq_len
    if prompt.numel() + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len {limit}")

    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)

    logits, state = model.prefill(prompt)
    next_logits = logits[-1:]
    token_ids: list[int] = []
    logprobs: list[float] = []
    finish_reason = "length"
    for step in range(max_new_tokens):
        token = sample_next(next_logits, temperature, top_p, top_k, generator)
        token_id = int(token[0])
        token_ids.append(token_id)
        logprobs.append(float(torch.log_softmax(next_logits[0].float(), dim=-1)[token_id]))
        if token_id in stop:
            finish_reason = "stop"
            break
        if step + 1 < max_new_tokens:
            next_logits, (state,) = model.decode(token, [state])
    return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=finish_reason)
