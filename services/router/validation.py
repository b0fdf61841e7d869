"""Edge validation of the public API's scalar fields, prompts and context length.

Every check raises ``InvalidArgument`` whose ``field`` is the proto field path (``sampling.top_p``,
``prompt_token_ids[3]``) and whose ``reason`` is a stable machine-readable word, before any work is
admitted or routed; nothing malformed ever reaches a worker. Chat-specific fields are checked in ``chat``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from k3.protos.v1 import inference_pb2
from k3.services.common.errors import InvalidArgument
from k3.services.router.config import LimitsConfig

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]+")
MAX_TEMPERATURE = 100.0


def check_request_id(request_id: str, limits: LimitsConfig) -> None:
    """A client-chosen id is optional; if given it must be short and printable (it appears in logs)."""
    if not request_id:
        return
    if len(request_id) > limits.max_request_id_chars:
        raise InvalidArgument(
            "request_id", f"is {len(request_id)} characters, more than {limits.max_request_id_chars}",
            reason="TOO_LONG",
        )
    if not _REQUEST_ID.fullmatch(request_id):
        raise InvalidArgument(
            "request_id", "may contain only letters, digits and . _ : -", reason="BAD_CHARACTERS"
        )


def check_sampling(sampling: inference_pb2.SamplingParams, limits: LimitsConfig, field: str = "sampling") -> None:
    """Range checks of every sampling field (0 means "off" or "default" where the proto says so)."""
    t = sampling.temperature
    if not math.isfinite(t) or not 0 <= t <= MAX_TEMPERATURE:
        raise InvalidArgument(f"{field}.temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {t}",
                              reason="OUT_OF_RANGE")
    p = sampling.top_p
    if not math.isfinite(p) or not 0 <= p <= 1:
        raise InvalidArgument(f"{field}.top_p", f"must be in [0, 1] (0 or 1 = off), got {p}", reason="OUT_OF_RANGE")
    if sampling.top_k < 0:
        raise InvalidArgument(f"{field}.top_k", f"must be >= 0 (0 = off), got {sampling.top_k}",
                              reason="OUT_OF_RANGE")
    if sampling.max_tokens < 0:
        raise InvalidArgument(f"{field}.max_tokens", f"must be >= 0 (0 = the default), got {sampling.max_tokens}",
                              reason="OUT_OF_RANGE")
    if not 0 <= sampling.logprobs <= limits.max_logprobs:
        raise InvalidArgument(f"{field}.logprobs", f"must be in [0, {limits.max_logprobs}], got {sampling.logprobs}",
                              reason="OUT_OF_RANGE")
    if len(sampling.stop) > limits.max_stop_strings:
        raise InvalidArgument(f"{field}.stop", f"has {len(sampling.stop)} strings, at most {limits.max_stop_strings}"
                              " are allowed", reason="TOO_MANY")
    for i, stop in enumerate(sampling.stop):
        if not stop:
            raise InvalidArgument(f"{field}.stop[{i}]", "must not be empty", reason="EMPTY")
        if len(stop) > limits.max_stop_chars:
            raise InvalidArgument(f"{field}.stop[{i}]", f"is {len(stop)} characters, at most {limits.max_stop_chars}",
                                  reason="TOO_LONG")


def check_token_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> None:
    for i, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"{field}[{i}]", f"token id {token} is outside the vocabulary [0, {vocab_size})",
                                  reason="OUT_OF_VOCABULARY")


def check_prompt_text(text: str, limits: LimitsConfig, field: str) -> None:
    size = len(text.encode("utf-8"))
    if size > limits.max_prompt_bytes:
        raise InvalidArgument(field, f"is {size} bytes, more than the limit of {limits.max_prompt_bytes}",
                              reason="PROMPT_TOO_LARGE")


def resolve_max_tokens(prompt_tokens: int, requested: int, max_context: int, limits: LimitsConfig,
                       prompt_field: str, field: str = "sampling.max_tokens") -> int:
    """The generation limit: ``requested`` (checked against the context) or the default (clamped to it).

    A prompt that leaves no room for one generated token, or a requested limit that does not fit after the
    prompt, is INVALID_ARGUMENT with reason CONTEXT_OVERFLOW and the numbers in the message.
    """
    if prompt_tokens == 0:
        raise InvalidArgument(prompt_field, "must not be empty", reason="EMPTY")
    limit = min(limits.max_prompt_tokens, max_context - 1)
    if prompt_tokens > limit:
        raise InvalidArgument(
            prompt_field,
            f"has {prompt_tokens} tokens; at most {limit} fit (context {max_context}, at least one token must be "
            "generated)",
            reason="CONTEXT_OVERFLOW" if limit == max_context - 1 else "PROMPT_TOO_LARGE",
        )
    room = max_context - prompt_tokens
    if requested == 0:
        return min(limits.default_max_tokens, room)
    if requested > room:
        raise InvalidArgument(
            field,
            f"{requested} tokens do not fit: the prompt has {prompt_tokens} tokens and the context {max_context}, "
            f"so at most {room} can be generated",
            reason="CONTEXT_OVERFLOW",
        )
    return requested
