"""Per-request sampling: validated options and a sampler that owns the request's random generator.

Design decisions:

- The token rule is ``k3.model.generate.sample_next``, called on the request's own logits row with the
  request's own ``torch.Generator``. Nothing random is shared between requests, so the tokens a request gets
  do not depend on which other requests happen to share its decode batch: batched output equals the
  single-request output of ``generate()`` with the same seed, draw for draw.
- A generator is created per request: seeded with ``seed`` when given, from fresh OS entropy otherwise.
- Logprobs are log-softmax of the raw logits (temperature 1, no filtering), like ``generate()``: the chosen
  token's is always reported (policy-gradient importance ratios need it), the top ``logprobs`` on request.
- ``SamplingOptions.validate`` names the offending field as the public API spells it (``sampling.top_p``,
  ``stop_token_ids[2]``), so a gRPC caller learns exactly what to fix. ``top_p`` 0 means off, like 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from k3.model.generate import sample_next
from k3.services.common.errors import InvalidArgument

MAX_STOP_STRINGS = 16
"""Most stop strings one request may give."""
MAX_STOP_STRING_CHARS = 256
"""Longest stop string (in characters)."""
MAX_SEED = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingOptions:
    """How one request chooses its tokens and when it stops."""

    temperature: float = 0.0
    """0 = greedy (argmax); otherwise logits are divided by it before top-k/top-p filtering."""
    top_p: float = 1.0
    """Nucleus mass kept, in (0, 1]; 0 or 1 turns it off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 turns it off."""
    max_tokens: int = 0
    """Most tokens to generate; 0 = the engine's ``default_max_tokens`` (clamped to the context left)."""
    stop: tuple[str, ...] = ()
    """Stop strings, matched on the detokenised text (needs a tokenizer); the text ends before the match."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation ends right after one of these tokens (which is included in the output)."""
    seed: int | None = None
    """Seed of the request's generator; None draws a fresh one."""
    logprobs: int = 0
    """Number of top logprobs reported per token (0 = only the chosen token's)."""

    def validate(self, vocab_size: int, max_logprobs: int, has_tokenizer: bool) -> SamplingOptions:
        """Return the options with ``top_p`` normalised (0 -> 1); ``InvalidArgument`` names a bad field."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidArgument("sampling.temperature", f"must be a finite number >= 0, got {t!r}",
                                  reason="BAD_SAMPLING")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:  # NaN fails too
            raise InvalidArgument("sampling.top_p", f"must be in [0, 1] (0 or 1 = off), got {p!r}",
                                  reason="BAD_SAMPLING")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgument("sampling.top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}",
                                  reason="BAD_SAMPLING")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise InvalidArgument("sampling.max_tokens",
                                  f"must be an integer >= 0 (0 = the default), got {self.max_tokens!r}",
                                  reason="BAD_SAMPLING")
        if not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool) \
                or not 0 <= self.logprobs <= max_logprobs:
            raise InvalidArgument("sampling.logprobs", f"must be in [0, {max_logprobs}], got {self.logprobs!r}",
                                  reason="BAD_SAMPLING")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise InvalidArgument("sampling.seed", f"must be an unsigned 64-bit integer, got {self.seed!r}",
                                  reason="BAD_SAMPLING")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
                                  reason="BAD_SAMPLING")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidArgument(f"sampling.stop[{i}]",
                                      f"must be a non-empty string of at most {MAX_STOP_STRING_CHARS} characters",
                                      reason="BAD_SAMPLING")
        if self.stop and not has_tokenizer:
            raise InvalidArgument("sampling.stop", "stop strings need a tokenizer and this engine has none",
                                  reason="NO_TOKENIZER")
        for i, t_id in enumerate(self.stop_token_ids):
            if isinstance(t_id, bool) or not isinstance(t_id, int) or not 0 <= t_id < vocab_size:
                raise InvalidArgument(f"stop_token_ids[{i}]", f"must be a token id in [0, {vocab_size}), got {t_id!r}",
                                      reason="BAD_TOKEN_ID")
        return SamplingOptions(
            temperature=float(t), top_p=1.0 if p == 0 else float(p), top_k=self.top_k, max_tokens=self.max_tokens,
            stop=tuple(self.stop), stop_token_ids=tuple(self.stop_token_ids), seed=self.seed,
            logprobs=self.logprobs,
        )


@dataclass
class SampledToken:
    token_id: int
    logprob: float
    """log-softmax of the raw logits at the chosen token."""
    top_logprobs: list[tuple[int, float]]
    """The ``logprobs`` most likely (token id, logprob) pairs, most likely first."""


class RequestSampler:
    """Draws one request's tokens with its own generator (see the module docstring)."""

    def __init__(self, options: SamplingOptions, device: torch.device | str = "cpu"):
        """``options`` must come from ``SamplingOptions.validate``."""
        self.options = options
        self.generator = torch.Generator(device=device)
        if options.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(options.seed)

    def sample(self, logits: Tensor) -> SampledToken:
        """Choose the next token from one row of logits [vocab]."""
        o = self.options
        token_id = int(sample_next(logits[None], o.temperature, o.top_p, o.top_k, self.generator)[0])
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top: list[tuple[int, float]] = []
        if o.logprobs:
            values, ids = torch.topk(logprobs, min(o.logprobs, logprobs.numel()))
            top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
        return SampledToken(token_id, float(logprobs[token_id]), top)
