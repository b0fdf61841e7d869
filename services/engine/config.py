"""``EngineConfig``: the resource budget of one inference engine (slots, pages, batch, chunking, queue).

Design decisions:

- Every limit is explicit and fixed at start: the slot pool and the page pool are allocated once, so memory use
  never grows with load and "full" is a clean ``RESOURCE_EXHAUSTED`` instead of an out-of-memory crash.
- ``max_slots`` (sequences resident: prefilling, decoding, or handed off and waiting for their stream) is
  separate from ``max_batch`` (sequences advanced by one decode step): more sequences may be resident than are
  batched, and the scheduler rotates through them.
- Validation raises ``ConfigError`` naming the field, so the service config loader reports ``engine.page_size``
  with the file or variable it came from. Checks against the model (``max_context`` vs the model's
  ``max_seq_len``) happen when the engine is built, since the config does not know the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3.services.common.config import ConfigError, documented


@dataclass
class EngineConfig:
    """Limits and batching knobs of ``k3.services.engine.Engine`` (the ``engine`` section of ``k3 serve decode``)."""

    max_batch: int = documented(8, doc="Most sequences advanced together by one decode step.")
    max_slots: int = documented(
        16, doc="Sequences resident at once (each holds one fixed-size KDA + conv state slot)."
    )
    page_size: int = documented(
        64, doc="Tokens per page of the paged MLA latent cache. The GPU decode kernel reads 64-token key tiles: "
                "pages of a multiple of 64 let it load whole tiles by tensor-memory-access copies (and use the "
                "Hopper kernel); smaller pages work through per-row loads."
    )
    num_pages: int = documented(
        512, doc="Pages in the MLA latent page pool (shared by all sequences and all MLA layers)."
    )
    prefill_chunk: int = documented(
        256, doc="Prompt tokens run per scheduler step; long prompts take several steps, interleaved with decoding."
    )
    max_context: int = documented(
        4096, doc="Longest sequence (prompt + generated tokens); at most the model's max_seq_len."
    )
    max_queue: int = documented(
        64, doc="Requests waiting for a slot or pages; one more is refused with RESOURCE_EXHAUSTED."
    )
    default_max_tokens: int = documented(
        256, doc="Generated-token budget of a request that sets none (clamped to what max_context leaves)."
    )
    max_logprobs: int = documented(20, doc="Largest number of top logprobs a request may ask for per token.")
    parked_timeout_s: float = documented(
        60.0, doc="A handed-off state not claimed by a stream within this many seconds is freed."
    )

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_slots", "page_size", "num_pages", "prefill_chunk", "max_context",
                     "default_max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"must be a positive integer, got {value!r}", field=name)
        for name in ("max_queue", "max_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"must be an integer >= 0, got {value!r}", field=name)
        if not self.parked_timeout_s > 0:
            raise ConfigError(f"must be > 0, got {self.parked_timeout_s!r}", field="parked_timeout_s")
        if self.max_batch > self.max_slots:
            raise ConfigError(
                f"must not exceed max_slots ({self.max_slots}), got {self.max_batch}", field="max_batch"
            )
        # One sequence of max_context tokens must fit the page pool, or such a request could never run.
        if self.pages_for(self.max_context) > self.num_pages:
            raise ConfigError(
                f"holds {self.num_pages * self.page_size} tokens, fewer than max_context ({self.max_context})",
                field="num_pages",
            )

    def pages_for(self, tokens: int) -> int:
        """Pages needed to hold ``tokens`` latent rows."""
        return -(-tokens // self.page_size)
