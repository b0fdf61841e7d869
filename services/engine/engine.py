"""``Engine``: continuous batching of K3 sequences over a fixed slot pool and a paged MLA latent cache.

One scheduler thread owns the model. Callers (gRPC handlers, RL rollout workers) talk to it through
``submit`` / ``load_state`` + ``resume`` / ``abort`` and read ``RequestStream``s; every request's memory is one
KDA state slot (``slots.SlotPool``) plus MLA latent pages (``pages.PagedLatentCache``).

A scheduler step:

1. bookkeeping under the lock: requests asked to abort are dropped (slot and pages freed), handed-off states
   nobody claimed within ``parked_timeout_s`` are freed, waiting requests are admitted in FIFO order while a
   slot and their pages are free;
2. **chunked prefill**: at most ``prefill_chunk`` prompt tokens of the oldest prefilling request run through
   ``K3Model.prefill``. A long prompt therefore takes several steps, and every step still advances the running
   decodes (3), so a long prompt never stalls the tokens of others. The last chunk's final logits give the
   request's first token;
3. **decode**: up to ``max_batch`` decoding sequences (rotating when more are resident) advance one token
   together through ``K3Model.decode_paged``, which advances their slots and writes their new latent rows in
   place and reads history through the page tables (nothing gathered, so a step's cost does not grow with
   what the engine holds); each samples from its own logits row with its own generator (``sampling``), so
   batch composition never changes a request's tokens.

Requests join and leave the batch at every step: continuous batching. Chunked prefill goes through
``K3Model.prefill``, which takes a ``SequenceState``: the sequence's slot (views, no copy) and its pages
(gathered into contiguous tensors), the new state written back after the chunk.

Numerics: ``decode_paged`` on a batch computes each row as ``K3Model.decode`` would for it alone, and sampling
is per request, so in fp32 the served tokens equal ``k3.model.generate.generate`` token for token (tested).

End of a request's turn: with ``on_final_state``, a finished sequence stays one more step to run its last
token through the model (``generate`` never does, it has nothing to predict), so the state handed to the
callback covers prompt + every generated token -- the state a follow-up turn continues from.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from opentelemetry import metrics, trace
from opentelemetry.context import Context
from torch import Tensor

from k3.model.state import SequenceState
from k3.services.common.config import ConfigError
from k3.services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from k3.services.engine.config import EngineConfig
from k3.services.engine.detokenize import TextStream, Tokenizer
from k3.services.engine.errors import (
    AlreadyExists,
    ComputeUnavailable,
    EngineClosed,
    PagesExhausted,
    QueueFull,
    SlotsExhausted,
    UnknownRequest,
)
from k3.services.engine.metrics import EngineMetrics, EngineStats
from k3.services.engine.pages import PagedLatentCache
from k3.services.engine.sampling import RequestSampler, SamplingOptions
from k3.services.engine.slots import SlotPool
from k3.services.engine.stream import RequestStream, TokenEvent, Usage
from k3.services.engine.tracing import attached, capture, step_span

log = logging.getLogger(__name__)

FinalStateCallback = Callable[[SequenceState, list[int], int], None]
"""Called (in the scheduler thread; keep it short) with the state after prompt + all generated tokens, those
token ids and the prompt's length."""


@dataclass
class PausedSequence:
    """A request taken out of the engine mid-generation by ``Engine.pause`` (partial rollout).

    ``state`` covers the first ``state.num_tokens`` of ``token_ids`` (``None`` when nothing ran yet); the tokens
    after it (at least the last sampled token, which the model has not consumed) still have to be run before
    generating again, under whatever weights the caller resumes with.
    """

    request_id: str
    state: SequenceState | None
    token_ids: list[int]
    """Prompt followed by every token generated so far."""
    prompt_len: int
    generated: int


class Phase(enum.Enum):
    WAITING = "waiting"      # queued for a slot / pages
    PREFILL = "prefill"      # prompt tokens left to run
    PARKED = "parked"        # handed-off state waiting for its stream
    DECODE = "decode"        # generating
    ABSORB = "absorb"        # finished; its last token still runs once for the final state


@dataclass(eq=False)
class _Sequence:
    request_id: str
    tokens: list[int]
    """Prompt followed by every generated token."""
    prompt_len: int
    phase: Phase
    cached_tokens: int = 0
    options: SamplingOptions | None = None
    max_tokens: int = 0
    stream: RequestStream | None = None
    sampler: RequestSampler | None = None
    text: TextStream | None = None
    on_final_state: FinalStateCallback | None = None
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    """Tokens whose effect is in the slot and pages."""
    pending_logits: Tensor | None = None
    """Logits to sample the next token from (a handed-off state's last prompt logits)."""
    next_token: int | None = None
    """Token to run through the model at the next decode step."""
    generated: int = 0
    finished: bool = False
    """The last event (with its finish_reason) was emitted."""
    abort_requested: bool = False
    parked_deadline: float = 0.0
    trace_context: Context | None = None
    """The OpenTelemetry context of the caller that submitted or resumed it (``tracing``)."""
    pause_future: Future | None = None
    """Set by ``pause``: the scheduler takes the sequence out at its next step and resolves it."""


class Engine:
    """Continuous-batching inference over one ``K3Model`` (see the module docstring)."""

    def __init__(self, model, config: EngineConfig, *, tokenizer: Tokenizer | None = None,
                 meter: metrics.Meter | None = None, tracer: trace.Tracer | None = None):
        if config.max_context > model.cfg.max_seq_len:
            raise ConfigError(f"must not exceed the model's max_seq_len ({model.cfg.max_seq_len}), got "
                              f"{config.max_context}", field="max_context")
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.cfg = model.cfg
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._config_hash = model.cfg.config_hash()
        self.slots = SlotPool(model.cfg, config.max_slots, self.device, self.dtype)
        self.pages = PagedLatentCache(model.cfg, config.num_pages, config.page_size, self.device, self.dtype)

        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._by_id: dict[str, _Sequence] = {}
        self._waiting: deque[_Sequence] = deque()
        self._prefilling: deque[_Sequence] = deque()
        self._decoding: list[_Sequence] = []
        self._first_sample: list[_Sequence] = []
        self._steps = 0
        self._closed = False
        self._dead: BaseException | None = None
        self._tracer = tracer
        self.metrics = EngineMetrics(meter, self._gauges)
        self._thread = threading.Thread(target=self._loop, name="k3-engine", daemon=True)
        self._thread.start()

    # ================================================================================================ public API
    def submit(self, prompt_ids: Sequence[int], sampling: SamplingOptions | None = None, *,
               request_id: str | None = None, on_final_state: FinalStateCallback | None = None,
               cached_tokens: int = 0) -> RequestStream:
        """Queue a prompt for generation; returns its stream at once.

        Raises ``InvalidArgument`` for a bad prompt or sampling options, ``AlreadyExists`` for an id in flight,
        and ``SlotsExhausted`` / ``PagesExhausted`` / ``QueueFull`` when it can neither start nor wait.
        """
        request_id = self._check_id(request_id)
        prompt = self._check_tokens(prompt_ids, "prompt_ids")
        if not prompt:
            raise InvalidArgument("prompt_ids", "must not be empty", reason="EMPTY_PROMPT")
        options, max_tokens = self._check_sampling(sampling, len(prompt), "prompt_ids")
        seq = _Sequence(request_id, list(prompt), len(prompt), Phase.WAITING, cached_tokens=cached_tokens)
        self._prepare(seq, options, max_tokens, on_final_state)
        seq.trace_context = capture()
        with self._lock:
            self._check_open()
            if request_id in self._by_id:
                raise AlreadyExists(f"request {request_id!r} is already in flight", field="request_id")
            seq.stream = self._new_stream(request_id)
            self._enqueue(seq)
            self._by_id[request_id] = seq
            self._wakeup.notify()
        return seq.stream

    def generate(self, prompt_ids: Sequence[int], sampling: SamplingOptions | None = None, **kwargs):
        """``submit`` and wait for the ``Completion``."""
        return self.submit(prompt_ids, sampling, **kwargs).result()

    def load_state(self, request_id: str, state: SequenceState, last_logits: Tensor, token_ids: Sequence[int],
                   *, cached_tokens: int = 0) -> int:
        """Park a computed prompt state (a hand-off from a prefill worker) in a free slot; returns the slot.

        ``last_logits`` [vocab] are the logits after the state's last token and ``token_ids`` the tokens the
        state covers. The state waits for ``resume`` for at most ``parked_timeout_s``. Raises
        ``InvalidArgument`` / ``FailedPrecondition`` for a state that does not fit this model,
        ``AlreadyExists``, and ``SlotsExhausted`` / ``PagesExhausted`` when it cannot be held.
        """
        request_id = self._check_id(request_id)
        tokens = self._check_tokens(token_ids, "token_ids")
        self._check_state(state, last_logits, tokens)
        seq = _Sequence(request_id, list(tokens), len(tokens), Phase.PARKED, cached_tokens=cached_tokens)
        with self._lock:
            self._check_open()
            if request_id in self._by_id:
                raise AlreadyExists(f"request {request_id!r} is already in flight", field="request_id")
            if self.slots.free == 0:
                raise SlotsExhausted(f"all {self.config.max_slots} state slots are in use")
            pages = self.pages.allocate(self.pages.pages_for(state.num_tokens))
            if pages is None:
                raise PagesExhausted(f"{self.pages.free} free pages cannot hold {state.num_tokens} tokens")
            seq.slot, seq.pages = self.slots.acquire(), pages
            # Copied under the lock: an abort or expiry must never free the slot halfway through the copy.
            self.slots.write(seq.slot, state.kda)
            self.pages.write(seq.pages, 0, state.mla)
            seq.num_tokens = state.num_tokens
            seq.pending_logits = last_logits.detach().to(self.device, torch.float32).clone()
            seq.parked_deadline = time.monotonic() + self.config.parked_timeout_s
            self._by_id[request_id] = seq
            self._wakeup.notify()
        return seq.slot

    def resume(self, request_id: str, sampling: SamplingOptions | None = None, *,
               on_final_state: FinalStateCallback | None = None) -> RequestStream:
        """Start generating from a parked state; ``UnknownRequest`` if ``request_id`` is not parked."""
        with self._lock:
            seq = self._by_id.get(request_id)
            if seq is None or seq.phase is not Phase.PARKED:
                raise UnknownRequest(f"no handed-off state is waiting under request id {request_id!r}",
                                     field="request_id")
        options, max_tokens = self._check_sampling(sampling, seq.num_tokens, "token_ids")
        with self._lock:
            self._check_open()
            if self._by_id.get(request_id) is not seq or seq.phase is not Phase.PARKED:
                raise UnknownRequest(f"the state of request {request_id!r} is gone (expired or aborted)",
                                     field="request_id")
            self._prepare(seq, options, max_tokens, on_final_state)
            seq.trace_context = capture()
            seq.stream = self._new_stream(request_id)
            seq.phase = Phase.WAITING
            try:
                self._enqueue(seq)
            except Exception:
                seq.phase = Phase.PARKED
                raise
            self._wakeup.notify()
        return seq.stream

    def abort(self, request_id: str) -> bool:
        """Stop a request (queued, parked or running); its slot and pages are free by the next step.
        Returns whether it was found."""
        with self._lock:
            return self._abort_locked(self._by_id.get(request_id))

    def pause(self, request_id: str) -> Future:
        """Take a request out of the engine keeping what it computed (partial rollout); returns a ``Future``.

        The future resolves to a ``PausedSequence`` (the stream then ends with a ``finish_reason == "pause"``
        event) or to ``None`` when the request had already produced its last token or is unknown (its stream
        ends as it would have). A queued request is paused with no state; a running one at its next step, with
        a copy of its slot and pages, so its memory is free at once and ``load_state`` + ``resume`` (on this
        or another engine, under the same or newer weights) continues it.
        """
        future: Future = Future()
        with self._lock:
            seq = self._by_id.get(request_id)
            if seq is None or seq.finished or seq.abort_requested or seq.phase is Phase.PARKED:
                future.set_result(None)
            elif seq.phase is Phase.WAITING:
                self._waiting.remove(seq)
                future.set_result(self._take_paused(seq, with_state=False))
            else:
                if seq.pause_future is not None:
                    return seq.pause_future
                seq.pause_future = future
                self._wakeup.notify()
        return future

    def _take_paused(self, seq: _Sequence, *, with_state: bool) -> PausedSequence:
        """Copy out ``seq``'s state, end its stream with a pause event and free it (lock held)."""
        state = None
        if with_state and seq.num_tokens > 0:
            state = SequenceState(self._config_hash, seq.num_tokens, kda=self.slots.snapshot(seq.slot),
                                  mla=self.pages.gather(seq.pages, seq.num_tokens))
        paused = PausedSequence(seq.request_id, state, list(seq.tokens), seq.prompt_len, seq.generated)
        if seq.stream is not None:
            seq.stream._put(TokenEvent(seq.request_id, None, finish_reason="pause", step=self._steps,
                                       usage=self._usage(seq)))
        self._release(seq)
        return paused

    def _new_stream(self, request_id: str) -> RequestStream:
        stream = RequestStream(request_id, lambda: self._abort_stream(stream), self._steps)
        return stream

    def _abort_stream(self, stream: RequestStream) -> bool:
        """Abort the request of ``stream`` only: a later request reusing the id is left alone."""
        with self._lock:
            seq = self._by_id.get(stream.request_id)
            return self._abort_locked(seq if seq is not None and seq.stream is stream else None)

    def _abort_locked(self, seq: _Sequence | None) -> bool:
        if seq is None:
            return False
        if seq.finished:
            # Its answer is complete; it only runs its last token for the final state. Letting that finish
            # costs one step and keeps the end-of-turn checkpoint when a client goes away after the last token.
            return True
        if seq.phase is Phase.WAITING and seq in self._waiting:
            self._waiting.remove(seq)
            self._finish_aborted(seq)
        elif seq.phase is Phase.PARKED:
            self._finish_aborted(seq)
        else:  # running: the scheduler drops it at the start of its next step
            seq.abort_requested = True
            self._wakeup.notify()
        return True

    def is_parked(self, request_id: str) -> bool:
        with self._lock:
            seq = self._by_id.get(request_id)
            return seq is not None and seq.phase is Phase.PARKED

    def stats(self) -> EngineStats:
        with self._lock:
            g = self._gauges_locked()
            return EngineStats(
                running=g["running"], queued=g["queued"], parked=g["parked"], free_slots=g["free_slots"],
                free_pages=g["free_pages"], tokens_processed=self.metrics.tokens_processed,
                finished=self.metrics.finished, aborted=self.metrics.aborted, expired=self.metrics.expired,
                steps=self._steps,
            )

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the scheduler; every unfinished request ends with an ``abort`` event."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wakeup.notify()
        self._thread.join(timeout)
        with self._lock:
            for seq in list(self._by_id.values()):
                self._finish_aborted(seq, count=False)

    @property
    def closed(self) -> bool:
        return self._closed or self._dead is not None

    # ================================================================================================ validation
    @staticmethod
    def _check_id(request_id: str | None) -> str:
        if request_id is None:
            return uuid.uuid4().hex
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument("request_id", "must be a non-empty string", reason="MISSING_FIELD")
        return request_id

    def _check_tokens(self, token_ids: Sequence[int], field_name: str) -> list[int]:
        ids = token_ids.tolist() if isinstance(token_ids, Tensor) else list(token_ids)
        vocab = self.cfg.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidArgument(f"{field_name}[{i}]", f"must be a token id in [0, {vocab}), got {t!r}",
                                      reason="BAD_TOKEN_ID")
        return ids

    def _check_sampling(self, sampling: SamplingOptions | None, context_tokens: int,
                        prompt_field: str) -> tuple[SamplingOptions, int]:
        """Validated options and the request's token budget."""
        options = (sampling or SamplingOptions()).validate(self.cfg.vocab_size, self.config.max_logprobs,
                                                           self.tokenizer is not None)
        room = self.config.max_context - context_tokens
        if room < 1:
            raise InvalidArgument(prompt_field, f"{context_tokens} prompt tokens leave no room to generate "
                                  f"within max_context {self.config.max_context}", reason="CONTEXT_TOO_LONG")
        if options.max_tokens > room:
            raise InvalidArgument("sampling.max_tokens", f"{context_tokens} prompt tokens + max_tokens "
                                  f"{options.max_tokens} exceed max_context {self.config.max_context}",
                                  reason="CONTEXT_TOO_LONG")
        return options, options.max_tokens or min(self.config.default_max_tokens, room)

    def _check_state(self, state: SequenceState, last_logits: Tensor, tokens: list[int]) -> None:
        if not isinstance(state, SequenceState):
            raise InvalidArgument("state", f"must be a SequenceState, got {type(state).__name__}")
        if state.config_hash != self._config_hash:
            raise FailedPrecondition(f"the state was produced by a model with config hash {state.config_hash}, "
                                     f"this engine's model has {self._config_hash}", field="state",
                                     reason="CONFIG_MISMATCH")
        n = state.num_tokens
        if n < 1 or n >= self.config.max_context:
            raise InvalidArgument("state", f"holds {n} tokens; must be in [1, max_context {self.config.max_context})",
                                  reason="BAD_STATE")
        if len(tokens) != n:
            raise InvalidArgument("token_ids", f"has {len(tokens)} ids for a state of {n} tokens", reason="BAD_STATE")
        if set(state.kda) != set(self.slots.layers) or set(state.mla) != set(self.pages.layers):
            raise InvalidArgument("state", f"has KDA layers {sorted(state.kda)} and MLA layers {sorted(state.mla)}, "
                                  f"the model has {self.slots.layers} and {self.pages.layers}", reason="BAD_STATE")
        for i, kda in state.kda.items():
            try:
                kda.check(1, self.cfg)
            except ValueError as exc:
                raise InvalidArgument(f"state.layers.{i}.kda", str(exc), reason="BAD_STATE") from None
        for i, cache in state.mla.items():
            want = ((n, self.cfg.kv_lora_rank), (n, self.cfg.qk_extra_dim))
            if (tuple(cache.c_kv.shape), tuple(cache.k_extra.shape)) != want:
                raise InvalidArgument(f"state.layers.{i}.mla", f"must have shapes {want[0]} and {want[1]}, got "
                                      f"{tuple(cache.c_kv.shape)} and {tuple(cache.k_extra.shape)}",
                                      reason="BAD_STATE")
        if not isinstance(last_logits, Tensor) or tuple(last_logits.shape) != (self.cfg.vocab_size,):
            shape = tuple(last_logits.shape) if isinstance(last_logits, Tensor) else type(last_logits).__name__
            raise InvalidArgument("last_logits", f"must be [vocab_size={self.cfg.vocab_size}], got {shape}",
                                  reason="BAD_LOGITS")

    def _prepare(self, seq: _Sequence, options: SamplingOptions, max_tokens: int,
                 on_final_state: FinalStateCallback | None) -> None:
        seq.options, seq.max_tokens, seq.on_final_state = options, max_tokens, on_final_state
        seq.sampler = RequestSampler(options, self.device)
        seq.text = TextStream(self.tokenizer, options.stop) if self.tokenizer is not None else None

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineClosed(f"the engine's scheduler died: {self._dead!r}")
        if self._closed:
            raise EngineClosed("the engine is closed")

    # ================================================================================================ admission
    def _pages_needed(self, seq: _Sequence) -> int:
        return self.pages.pages_for(seq.prompt_len + seq.max_tokens) - len(seq.pages)

    def _can_admit(self, seq: _Sequence) -> bool:
        return (seq.slot is not None or self.slots.free > 0) and self._pages_needed(seq) <= self.pages.free

    def _enqueue(self, seq: _Sequence) -> None:
        """Admit now, or queue, or raise the precise exhaustion error (lock held)."""
        if self._pages_needed(seq) > self.config.num_pages - len(seq.pages):
            raise PagesExhausted(f"the request needs {self._pages_needed(seq)} pages, the pool has "
                                 f"{self.config.num_pages}")
        if not self._waiting and self._can_admit(seq):
            self._admit(seq)
        elif len(self._waiting) < self.config.max_queue:
            self._waiting.append(seq)
        elif self.config.max_queue > 0:
            raise QueueFull(f"{len(self._waiting)} requests are already waiting (max_queue)")
        elif seq.slot is None and self.slots.free == 0:
            raise SlotsExhausted(f"all {self.config.max_slots} state slots are in use and max_queue is 0")
        else:
            raise PagesExhausted(f"{self.pages.free} free pages; the request needs {self._pages_needed(seq)} "
                                 "and max_queue is 0")

    def _admit(self, seq: _Sequence) -> None:
        """Give ``seq`` its slot and pages and start it (lock held; ``_can_admit`` was true)."""
        if seq.slot is None:
            seq.slot = self.slots.acquire()
        seq.pages += self.pages.allocate(self._pages_needed(seq))
        if seq.pending_logits is not None:        # a resumed hand-off: its first token comes from its logits
            seq.phase = Phase.DECODE
            self._decoding.append(seq)
            self._first_sample.append(seq)
        else:
            seq.phase = Phase.PREFILL
            self._prefilling.append(seq)

    # ================================================================================================ scheduler
    def _loop(self) -> None:
        try:
            while self._plan():
                self._step()
        except BaseException as exc:  # a bug: fail every request loudly instead of hanging them
            log.exception("engine scheduler died")
            with self._lock:
                self._dead = exc
                for seq in list(self._by_id.values()):
                    if seq.stream is not None:
                        seq.stream._fail(exc)
                    self._release(seq)

    def _plan(self) -> bool:
        """Bookkeeping of step 1; waits while there is nothing to run. False once closed."""
        with self._lock:
            while True:
                if self._closed:
                    return False
                for seq in [s for s in self._by_id.values() if s.abort_requested]:
                    if seq.phase in (Phase.PREFILL, Phase.DECODE, Phase.ABSORB):
                        self._finish_aborted(seq)
                self._take_pause_requests()
                now = time.monotonic()
                for seq in [s for s in self._by_id.values() if s.phase is Phase.PARKED]:
                    if seq.parked_deadline <= now:
                        log.info("freeing the unclaimed state of request %s", seq.request_id)
                        self._release(seq)
                        self.metrics.add_expired()
                while self._waiting and self._can_admit(self._waiting[0]):
                    self._admit(self._waiting.popleft())
                if self._prefilling or self._decoding:
                    self._steps += 1
                    return True
                deadlines = [s.parked_deadline for s in self._by_id.values() if s.phase is Phase.PARKED]
                self._wakeup.wait(timeout=max(0.0, min(deadlines) - now) if deadlines else None)

    def _take_pause_requests(self) -> None:
        """Resolve ``pause`` requests between steps (lock held). A sequence whose first token is still to be
        sampled from handed-off logits waits one step, so a pause never drops logits it cannot return."""
        for seq in [s for s in self._by_id.values() if s.pause_future is not None]:
            if seq.finished or seq.abort_requested:
                future, seq.pause_future = seq.pause_future, None
                future.set_result(None)
            elif seq.pending_logits is None:
                future, seq.pause_future = seq.pause_future, None
                future.set_result(self._take_paused(seq, with_state=True))

    def _step(self) -> None:
        if self._prefilling:
            seq = self._prefilling[0]
            try:
                self._prefill_chunk(seq)
            except Unavailable as exc:  # a remote part of the model (expert pools) failed: this request only
                self._fail_step([seq], exc)
        while self._first_sample:
            seq = self._first_sample.pop(0)
            logits, seq.pending_logits = seq.pending_logits, None
            if not seq.abort_requested:
                self._sample(seq, logits)
        batch = [s for s in self._decoding if s.next_token is not None][: self.config.max_batch]
        if batch:
            try:
                self._decode(batch)
            except Unavailable as exc:
                self._fail_step(batch, exc)

    def _fail_step(self, seqs: list[_Sequence], exc: Unavailable) -> None:
        """End the requests whose step could not be computed (``UNAVAILABLE`` from the model: its routed
        experts run on expert pools, and no pool could serve them within the client's deadlines and retries).

        Only these requests fail -- they shared the failed MoE calls; queued, parked and other running requests
        are untouched and the scheduler keeps going, so the engine serves again as soon as a pool does. Their
        slots and pages may hold a half-updated state, which is why they are released, not retried. A request
        that already sent its last token (absorbing its final state) keeps its answer and only loses the
        end-of-turn checkpoint.
        """
        log.warning("step %d failed for request(s) %s: %s", self._steps, ", ".join(s.request_id for s in seqs), exc)
        error = ComputeUnavailable(f"the model could not compute this request's step: {exc.message}")
        with self._lock:
            for seq in seqs:
                if seq.stream is not None and not seq.finished:
                    seq.stream._fail(error)
                    self.metrics.add_finished("error")
                self._release(seq)

    def _state_of(self, seq: _Sequence) -> SequenceState:
        return SequenceState(self._config_hash, seq.num_tokens, kda=self.slots.views(seq.slot),
                             mla=self.pages.gather(seq.pages, seq.num_tokens))

    def _store(self, seq: _Sequence, state: SequenceState) -> None:
        self.slots.write(seq.slot, state.kda)
        self.pages.write(seq.pages, seq.num_tokens, state.mla, rows_from=seq.num_tokens)
        seq.num_tokens = state.num_tokens

    def _prefill_chunk(self, seq: _Sequence) -> None:
        chunk = seq.tokens[seq.num_tokens: min(seq.prompt_len, seq.num_tokens + self.config.prefill_chunk)]
        with step_span(self._tracer, "k3.engine.prefill_chunk", [seq.trace_context],
                       {"k3.engine.tokens": len(chunk)}):
            logits, state = self.model.prefill(torch.tensor(chunk, dtype=torch.long, device=self.device),
                                               self._state_of(seq))
        self._store(seq, state)
        self.metrics.add_tokens(len(chunk), "prompt")
        if seq.num_tokens == seq.prompt_len:
            with self._lock:
                self._prefilling.popleft()
                self._decoding.append(seq)
                seq.phase = Phase.DECODE
            if not seq.abort_requested:
                self._sample(seq, logits[-1])

    def _decode(self, batch: list[_Sequence]) -> None:
        device = self.device
        tokens = torch.tensor([s.next_token for s in batch], dtype=torch.long, device=device)
        slots = torch.tensor([s.slot for s in batch], dtype=torch.long, device=device)
        seq_lens = torch.tensor([s.num_tokens for s in batch], dtype=torch.int32, device=device)
        table = self.pages.block_table([s.pages for s in batch], max(s.num_tokens for s in batch) + 1).to(device)
        with step_span(self._tracer, "k3.engine.decode_step", [s.trace_context for s in batch],
                       {"k3.engine.batch": len(batch)}):
            # the engine built every index itself (pages reserved at admission), so no value checks
            logits = self.model.decode_paged(tokens, slots, table, seq_lens, self.slots.states, self.pages.kv,
                                             validate=False)
        self.metrics.add_tokens(len(batch), "decode")
        with self._lock:  # rotate: the sequences just run go to the back of the line
            ran = set(map(id, batch))
            self._decoding = [s for s in self._decoding if id(s) not in ran] + batch
        for seq, row in zip(batch, logits, strict=True):
            seq.num_tokens += 1
            seq.next_token = None
            if seq.abort_requested:
                continue
            if seq.phase is Phase.ABSORB:
                self._hand_over_final_state(seq)
            else:
                self._sample(seq, row)

    def _sample(self, seq: _Sequence, logits: Tensor) -> None:
        """Choose, record and emit the next token; finish the request if it ends here."""
        chosen = seq.sampler.sample(logits)
        token = chosen.token_id
        seq.tokens.append(token)
        seq.generated += 1
        text = seq.text.push(token) if seq.text is not None else ""
        finish = ""
        if token in seq.options.stop_token_ids or (seq.text is not None and seq.text.stopped):
            finish = "stop"
        elif seq.generated >= seq.max_tokens:
            finish = "length"
        if finish and seq.text is not None:
            text += seq.text.finish()
        seq.finished = bool(finish)  # before the event: an abort after the last token must not cancel the handover
        seq.stream._put(TokenEvent(
            seq.request_id, token, text, chosen.logprob, chosen.top_logprobs, finish, self._steps,
            self._usage(seq) if finish else None,
        ))
        seq.next_token = token
        if not finish:
            return
        self.metrics.add_finished(finish)
        if seq.on_final_state is not None:
            seq.phase = Phase.ABSORB     # one more step runs `token` so the final state covers it
        else:
            with self._lock:
                self._release(seq)

    def _hand_over_final_state(self, seq: _Sequence) -> None:
        state = SequenceState(self._config_hash, seq.num_tokens, kda=self.slots.snapshot(seq.slot),
                              mla=self.pages.gather(seq.pages, seq.num_tokens))
        try:
            with attached(seq.trace_context):  # its checkpoint belongs to this request's trace
                seq.on_final_state(state, list(seq.tokens), seq.prompt_len)
        except Exception:
            log.exception("final-state callback of request %s failed", seq.request_id)
        with self._lock:
            self._release(seq)

    @staticmethod
    def _usage(seq: _Sequence) -> Usage:
        return Usage(seq.prompt_len, seq.cached_tokens, seq.generated)

    # ================================================================================================ teardown
    def _release(self, seq: _Sequence) -> None:
        """Free everything ``seq`` holds and end its stream (lock held)."""
        if self._by_id.get(seq.request_id) is seq:
            del self._by_id[seq.request_id]
        if seq.slot is not None:
            self.slots.release(seq.slot)
            seq.slot = None
        if seq.pages:
            self.pages.release(seq.pages)
            seq.pages = []
        for container in (self._prefilling, self._waiting):
            if seq in container:
                container.remove(seq)
        if seq in self._decoding:
            self._decoding.remove(seq)
        if seq in self._first_sample:
            self._first_sample.remove(seq)
        if seq.stream is not None:
            seq.stream._end()
        if seq.pause_future is not None:  # finished, aborted or failed before the pause was taken
            future, seq.pause_future = seq.pause_future, None
            future.set_result(None)

    def _finish_aborted(self, seq: _Sequence, count: bool = True) -> None:
        """End ``seq`` with an abort event (lock held). A request that already sent its last event (closing
        engine, final state not yet handed over) is released without one: its answer is complete."""
        already_finished = seq.finished
        if seq.stream is not None and not already_finished:
            seq.stream._put(TokenEvent(seq.request_id, None, finish_reason="abort", step=self._steps,
                                       usage=self._usage(seq)))
        self._release(seq)
        if count and not already_finished:
            self.metrics.add_aborted()

    # ================================================================================================ metrics
    def _gauges_locked(self) -> dict[str, int]:
        parked = sum(1 for s in self._by_id.values() if s.phase is Phase.PARKED)
        return {
            "running": len(self._prefilling) + len(self._decoding),
            "queued": len(self._waiting),
            "parked": parked,
            "free_slots": self.slots.free,
            "free_pages": self.pages.free,
            "kda_state_memory": (self.slots.num_slots - self.slots.free) * self.slots.slot_bytes,
            "kv_latent_memory": (self.pages.num_pages - self.pages.free) * self.pages.page_bytes,
        }

    def _gauges(self) -> dict[str, int]:
        with self._lock:
            return self._gauges_locked()
