"""Admission control with separate budgets for long and short prompts.

Why two classes: prefill time grows with the prompt, so a burst of long prompts occupies the workers far
longer than the same number of short ones. With one shared budget such a burst fills it and every short
request behind it waits or is refused. Here each class has its own concurrency limit and its own
queued-token budget, so long prompts can only exhaust the long budget; short requests keep being admitted.

Per class:

- a request runs at once if fewer than ``max_concurrency`` requests of its class run and nobody of its
  class is waiting (FIFO: a newcomer never overtakes a waiting request);
- otherwise it waits if ``queued_tokens + its prompt tokens <= max_queued_tokens``, and is refused with
  RESOURCE_EXHAUSTED (naming the class, the numbers and the budget) if not;
- a waiting request leaves the queue when it is admitted, cancelled, or its deadline passes
  (DEADLINE_EXCEEDED), and its tokens are released from the budget at that moment.

The lock is held only for bookkeeping; waiting uses one condition variable per class.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from k3.services.common.errors import DeadlineExceeded, ResourceExhausted
from k3.services.router.config import AdmissionConfig

LONG = "long"
SHORT = "short"


class Cancelled(Exception):
    """The request was cancelled while it waited for admission."""


@dataclass(frozen=True)
class ClassStats:
    running: int
    queued: int
    queued_tokens: int
    admitted: int
    rejected: int


class _Waiter:
    __slots__ = ("tokens",)

    def __init__(self, tokens: int):
        self.tokens = tokens


class AdmissionClass:
    """One budget: ``max_concurrency`` running requests and ``max_queued_tokens`` prompt tokens waiting."""

    def __init__(self, name: str, max_concurrency: int, max_queued_tokens: int):
        self.name = name
        self.max_concurrency = max_concurrency
        self.max_queued_tokens = max_queued_tokens
        self._cond = threading.Condition()
        self._running = 0
        self._queue: deque[_Waiter] = deque()
        self._queued_tokens = 0
        self._admitted = 0
        self._rejected = 0

    def acquire(self, tokens: int, deadline: float | None = None,
                cancelled: Callable[[], bool] = lambda: False) -> None:
        """Block until the request may run (see the module docstring); pair with ``release``.

        ``deadline`` is a ``time.monotonic()`` value. Raises ``ResourceExhausted``, ``DeadlineExceeded`` or
        ``Cancelled``. ``wake()`` makes waiters re-check ``cancelled``.
        """
        with self._cond:
            if self._running < self.max_concurrency and not self._queue:
                self._running += 1
                self._admitted += 1
                return
            if self._queued_tokens + tokens > self.max_queued_tokens:
                self._rejected += 1
                raise ResourceExhausted(
                    f"{self.name} requests are over budget: {self._running} running (limit "
                    f"{self.max_concurrency}) and {self._queued_tokens} prompt tokens queued; this prompt's "
                    f"{tokens} tokens would exceed the {self.name} queue budget of {self.max_queued_tokens} "
                    "tokens; retry later",
                    reason="ADMISSION_BUDGET",
                )
            waiter = _Waiter(tokens)
            self._queue.append(waiter)
            self._queued_tokens += tokens
            try:
                while not (self._queue[0] is waiter and self._running < self.max_concurrency):
                    if cancelled():
                        raise Cancelled()
                    timeout = None if deadline is None else deadline - time.monotonic()
                    if timeout is not None and timeout <= 0:
                        raise DeadlineExceeded(f"deadline passed while queued for admission ({self.name})")
                    self._cond.wait(timeout)
            except BaseException:
                self._queue.remove(waiter)
                self._queued_tokens -= tokens
                self._cond.notify_all()  # the head may have changed
                raise
            self._queue.popleft()
            self._queued_tokens -= tokens
            self._running += 1
            self._admitted += 1
            self._cond.notify_all()  # the next waiter may run too if slots are free

    def release(self) -> None:
        with self._cond:
            if self._running <= 0:
                raise RuntimeError(f"release of {self.name} admission without acquire")
            self._running -= 1
            self._cond.notify_all()

    def wake(self) -> None:
        """Let waiters re-check their cancellation."""
        with self._cond:
            self._cond.notify_all()

    def stats(self) -> ClassStats:
        with self._cond:
            return ClassStats(self._running, len(self._queue), self._queued_tokens, self._admitted, self._rejected)


class Admission:
    """The two classes; ``classify`` picks one by prompt length."""

    def __init__(self, config: AdmissionConfig):
        self.long_threshold_tokens = config.long_threshold_tokens
        self.short = AdmissionClass(SHORT, config.short_max_concurrency, config.short_max_queued_tokens)
        self.long = AdmissionClass(LONG, config.long_max_concurrency, config.long_max_queued_tokens)

    def classify(self, prompt_tokens: int) -> AdmissionClass:
        return self.long if prompt_tokens >= self.long_threshold_tokens else self.short

    def wake(self) -> None:
        self.short.wake()
        self.long.wake()
