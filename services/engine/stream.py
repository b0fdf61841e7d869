"""What a caller gets back from the engine: one ``TokenEvent`` per generated token, through a ``RequestStream``.

Design decisions:

- One event per token, produced by the scheduler thread and handed over through a per-request queue, so a
  consumer (a gRPC stream handler, an RL rollout loop) reads at its own pace and the scheduler never waits for
  it. The last event of a request carries ``finish_reason`` and ``usage``; an aborted request ends with an event
  that has no token and ``finish_reason == "abort"``.
- The iterator ends only once the engine is completely done with the request, including handing over its
  final state (see ``Engine.submit``'s ``on_final_state``), so "the stream ended" means "nothing of this
  request is still running".
- If the engine dies, every open stream raises ``EngineClosed`` instead of hanging. A request whose step could
  not be computed (expert pools unavailable) raises ``ComputeUnavailable`` while the engine goes on.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from k3.services.engine.errors import ComputeUnavailable, EngineClosed


@dataclass
class Usage:
    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens restored from a cache instead of computed (known to whoever restored them)."""
    completion_tokens: int


@dataclass
class TokenEvent:
    request_id: str
    token_id: int | None
    """The generated token; None only on an abort event."""
    text: str = ""
    """Detokenised text released with this token ("" without a tokenizer, or while held back)."""
    logprob: float | None = None
    """log-softmax of the raw logits at ``token_id``."""
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str = ""
    """"" while running; "stop", "length" or "abort" on the last event."""
    step: int = 0
    """Scheduler step that produced the event (orders events across requests)."""
    usage: Usage | None = None
    """Set on the last event."""


@dataclass
class Completion:
    """Everything a finished stream produced (``RequestStream.result``)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    usage: Usage | None
    events: list[TokenEvent]


_END = object()


class RequestStream:
    """Iterator over one request's ``TokenEvent``s (see the module docstring)."""

    def __init__(self, request_id: str, abort: Callable[[], bool], submitted_step: int):
        self.request_id = request_id
        self.submitted_step = submitted_step
        """The scheduler step counter when the request was accepted."""
        self._abort = abort
        self._queue: queue.Queue = queue.Queue()
        self._done = False

    # -- engine side -------------------------------------------------------------------------------------------
    def _put(self, event: TokenEvent) -> None:
        self._queue.put(event)

    def _end(self) -> None:
        self._queue.put(_END)

    def _fail(self, error: Exception) -> None:
        self._queue.put(error)

    # -- consumer side -----------------------------------------------------------------------------------------
    def abort(self) -> bool:
        """Ask the engine to stop this request (its slot and pages are freed at the next step)."""
        return self._abort()

    def __iter__(self) -> Iterator[TokenEvent]:
        return self

    def __next__(self) -> TokenEvent:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, ComputeUnavailable):  # this request failed, the engine did not
            self._done = True
            raise item
        if isinstance(item, Exception):
            self._done = True
            raise EngineClosed(f"request {self.request_id!r} could not finish: {item}") from item
        return item

    def result(self) -> Completion:
        """Consume the stream to its end and collect it."""
        events = list(self)
        tokens = [e for e in events if e.token_id is not None]
        last = events[-1] if events else None
        return Completion(
            token_ids=[e.token_id for e in tokens],
            logprobs=[e.logprob for e in tokens],
            text="".join(e.text for e in events),
            finish_reason=last.finish_reason if last else "",
            usage=last.usage if last else None,
            events=events,
        )
