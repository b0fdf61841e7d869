"""One request end to end: admission, routing, prefill, the decode stream, usage, cancellation.

``Pipeline.run(job, deadline)`` is a generator of ``Event``s (decode pieces, then one ``Finished``); the
servicer turns them into Generate or Chat responses. Design decisions:

- **One cancellation path.** Every request has an ``InFlight`` record registered under its id. An Abort,
  the client going away and the deadline passing all end in ``InFlight.cancel(reason)``, which cancels the
  outstanding downstream call (the worker's handler sees its RPC cancelled), sends ``CancelPrefill`` and
  ``CancelDecode`` by request id (the prefill may have handed the state off already; a state parked in a
  decode slot must be freed even if no stream claimed it yet), and wakes admission waiters. The cancel
  calls are fire-and-forget with a short deadline: they must never hold the caller up.
- **Deadlines travel down.** The remaining client deadline becomes the timeout of the Prefill call and of
  the Decode stream, so a worker stops on its own even if the cancel messages were lost.
- **An abort is an answer, a disconnect is not.** An aborted request ends with ``finish_reason="abort"`` and
  its usage (the client is still listening); a disconnected or timed-out one ends without a message.
- **Worker errors keep their status.** A worker's INVALID_ARGUMENT or RESOURCE_EXHAUSTED reaches the client
  with its code and reason; its field is translated to the client's request (``token_ids[3]`` ->
  ``prompt_token_ids[3]``, ``sampling.*`` as is) or left empty when only the router sets it. UNAVAILABLE marks the worker failed for a while (``routing``)
  and is returned as UNAVAILABLE naming the worker; nothing is retried, because a prefill may already
  have handed state to a decode worker.
- **Usage** is computed here from the prompt length, the prefill's ``cached_tokens`` and the tokens
  streamed, at the configured prices, and added to the running totals once per request.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from k3.protos.v1 import common_pb2, engine_pb2, inference_pb2
from k3.services.cache.hashing import chain_block_hashes
from k3.services.common.client import error_detail
from k3.services.common.errors import DeadlineExceeded, K3Error, Unavailable
from k3.services.router.admission import Admission, Cancelled
from k3.services.router.config import PricesConfig
from k3.services.router.latency import LatencyRecorder, RequestClock
from k3.services.router.routing import Router, Worker
from k3.services.router.usage import UsageTotals, make_usage

log = logging.getLogger(__name__)

ABORT = "abort"
CLIENT_GONE = "client disconnected"
DEADLINE = "deadline exceeded"


class UpstreamError(K3Error):
    """A worker's error status, passed on with its code, field and reason."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "", reason: str | None = None):
        self.code = code
        super().__init__(message, field=field, reason=reason or code.name)


def client_field(worker_field: str, prompt_field: str) -> str:
    """A worker's error field as the client's request names it ("" for fields only the router sets)."""
    if worker_field.startswith("sampling"):
        return worker_field
    if worker_field == "token_ids" or worker_field.startswith("token_ids["):
        return prompt_field if prompt_field == "messages" else prompt_field + worker_field[len("token_ids"):]
    return ""


def upstream_error(exc: grpc.RpcError, what: str, prompt_field: str) -> K3Error:
    """A worker's failure as the router's error: status, reason and (translated) field kept."""
    code = exc.code()
    detail = error_detail(exc)
    message = f"{what}: {exc.details()}"
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(message, reason="WORKER_UNAVAILABLE")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message)
    if detail is not None:
        return UpstreamError(code, f"{what}: {detail.message}", field=client_field(detail.field, prompt_field),
                             reason=detail.reason)
    return UpstreamError(code, message)


class AlreadyExists(K3Error):
    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "ALREADY_EXISTS"


@dataclass
class Job:
    """A validated request, ready to run."""

    kind: str  # "generate" or "chat" (a metrics attribute)
    request_id: str
    token_ids: list[int]
    message_ends: list[int]
    sampling: inference_pb2.SamplingParams  # max_tokens resolved (never 0)
    stop_token_ids: list[int]
    prompt_field: str  # where the prompt came from in the client's request (for error fields)
    images: list[engine_pb2.VisualInput] = field(default_factory=list)  # visual tokens for prefill
    key_ids: list[int] | None = None  # cache-key ids when images make them differ from token_ids


@dataclass
class Piece:
    """One decode message (token ids, text, logprobs)."""

    response: inference_pb2.GenerateResponse


@dataclass
class Finished:
    """The end of a request; ``last`` is the final decode message's content (its finish reason removed)."""

    finish_reason: str
    usage: common_pb2.Usage
    last: inference_pb2.GenerateResponse | None = None


Event = Piece | Finished


@dataclass
class InFlight:
    """A request the router is working on (see the module docstring for the cancellation path)."""

    request_id: str
    phase: str = "admission"  # admission, prefill, decode, done
    reason: str | None = None
    prefill: Worker | None = None
    decode: Worker | None = None
    call: object | None = None  # the outstanding downstream call or future
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def cancelled(self) -> bool:
        return self.reason is not None


class Pipeline:
    """Runs jobs against the workers chosen by ``router`` under ``admission``."""

    def __init__(self, router: Router, admission: Admission, prices: PricesConfig, totals: UsageTotals,
                 probe_timeout: float, latency: LatencyRecorder | None = None):
        self.router = router
        self.latency = latency or LatencyRecorder()
        self.admission = admission
        self.prices = prices
        self.totals = totals
        self._probe_timeout = probe_timeout
        self._lock = threading.Lock()
        self._flights: dict[str, InFlight] = {}

    # -- registry of requests in flight ---------------------------------------------------------------------
    def register(self, request_id: str) -> InFlight:
        """Claim ``request_id`` (a fresh one if empty); ALREADY_EXISTS if it is in flight."""
        with self._lock:
            if not request_id:
                request_id = uuid.uuid4().hex
            if request_id in self._flights:
                raise AlreadyExists(f"request {request_id!r} is already in flight", field="request_id")
            flight = InFlight(request_id)
            self._flights[request_id] = flight
            return flight

    def unregister(self, flight: InFlight) -> None:
        with self._lock:
            if self._flights.get(flight.request_id) is flight:
                del self._flights[flight.request_id]

    def get(self, request_id: str) -> InFlight | None:
        with self._lock:
            return self._flights.get(request_id)

    def in_flight(self) -> list[InFlight]:
        with self._lock:
            return list(self._flights.values())

    def abort(self, request_id: str) -> bool:
        flight = self.get(request_id)
        if flight is None:
            return False
        self.cancel(flight, ABORT)
        return True

    def cancel(self, flight: InFlight, reason: str) -> None:
        """Stop ``flight`` wherever it is (idempotent; the first reason wins)."""
        with flight.lock:
            if flight.reason is not None or flight.phase == "done":
                return
            flight.reason = reason
            call, prefill, decode = flight.call, flight.prefill, flight.decode
        log.info("request %s cancelled (%s) during %s", flight.request_id, reason, flight.phase)
        if call is not None:
            call.cancel()
        self._send_cancels(flight.request_id, prefill, decode)
        self.admission.wake()

    def _send_cancels(self, request_id: str, prefill: Worker | None, decode: Worker | None) -> None:
        message = engine_pb2.CancelRequestById(request_id=request_id)
        if prefill is not None:
            prefill.stub.CancelPrefill.future(message, timeout=self._probe_timeout)
        if decode is not None:
            decode.stub.CancelDecode.future(message, timeout=self._probe_timeout)

    def _track(self, flight: InFlight, call) -> None:
        """Make ``call`` the one ``cancel`` stops; cancels it at once if the request is already cancelled."""
        with flight.lock:
            flight.call = call
            cancelled = flight.reason is not None
        if cancelled:
            call.cancel()

    # -- running a job -----------------------------------------------------------------------------------------
    def run(self, job: Job, flight: InFlight, deadline: float | None) -> Iterator[Event]:
        """The events of ``job`` (decode pieces, then ``Finished``); raises ``K3Error`` on failure."""
        prompt_tokens = len(job.token_ids)
        clock = self.latency.start(job.kind)  # TTFT counts the wait for admission too
        budget = self.admission.classify(prompt_tokens)
        try:
            budget.acquire(prompt_tokens, deadline, cancelled=lambda: flight.cancelled)
        except Cancelled:
            yield from self._ended(job, flight, cached=0, completion=0)
            return
        try:
            yield from self._admitted(job, flight, deadline, clock)
        finally:
            budget.release()
            clock.finish()

    def _admitted(self, job: Job, flight: InFlight, deadline: float | None,
                  clock: RequestClock) -> Iterator[Event]:
        keys = chain_block_hashes(job.key_ids if job.key_ids is not None else job.token_ids)
        choice = self.router.choose_prefill(keys)
        decode = self.router.choose_decode()
        prefill = choice.worker
        log.debug("request %s: prefill %s (%d cached blocks, score %.1f), decode %s", job.request_id,
                  prefill.address, choice.cached_blocks, choice.score, decode.address)
        with flight.lock:
            flight.prefill, flight.decode, flight.phase = prefill, decode, "prefill"
        self.router.prefill.acquire(prefill)
        self.router.decode.acquire(decode)
        completion = 0
        cached = 0
        finished = False
        try:
            if flight.cancelled:
                yield from self._ended(job, flight, cached, completion)
                return
            response = self._prefill(job, flight, prefill, decode, deadline)
            if response is None:
                yield from self._ended(job, flight, cached, completion)
                return
            cached = response.cached_tokens
            with flight.lock:
                flight.phase = "decode"
            self.router.prefill.release(prefill)
            prefill = None
            last: inference_pb2.GenerateResponse | None = None
            for piece in self._decode(job, flight, decode, deadline):
                completion += len(piece.token_ids)
                clock.tokens_arrived(len(piece.token_ids))
                if piece.finish_reason:
                    last = piece  # the worker's last message; the stream ends right after it
                elif piece.token_ids or piece.text:
                    yield Piece(piece)
            if flight.cancelled:
                yield from self._ended(job, flight, cached, completion)
                return
            if last is None:
                raise Unavailable(f"decode worker {decode.address} ended the stream without a finish reason",
                                  reason="WORKER_PROTOCOL")
            finished = True
            usage = self._usage(job, cached, completion)
            yield Finished(last.finish_reason, usage, _without_finish(last))
        finally:
            with flight.lock:
                flight.phase = "done"
                flight.call = None
            if prefill is not None:
                self.router.prefill.release(prefill)
            self.router.decode.release(decode)
            if not finished and not flight.cancelled:
                # Failed, or the consumer stopped early: make sure no worker keeps working for nobody.
                self._send_cancels(job.request_id, flight.prefill, flight.decode)

    def _prefill(self, job: Job, flight: InFlight, prefill: Worker, decode: Worker,
                 deadline: float | None) -> engine_pb2.PrefillResponse | None:
        request = engine_pb2.PrefillRequest(
            request_id=job.request_id, token_ids=job.token_ids, message_ends=job.message_ends,
            decode_address=decode.address, images=job.images,
        )
        future = prefill.stub.Prefill.future(request, timeout=_timeout(deadline))
        self._track(flight, future)
        try:
            return future.result()
        except grpc.FutureCancelledError:
            return None
        except grpc.RpcError as exc:
            if flight.cancelled:
                return None
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.router.prefill.mark_failed(prefill)
            raise upstream_error(exc, f"prefill worker {prefill.address}", job.prompt_field) from None

    def _decode(self, job: Job, flight: InFlight, decode: Worker,
                deadline: float | None) -> Iterator[inference_pb2.GenerateResponse]:
        request = engine_pb2.StreamRequest(
            request_id=job.request_id, sampling=job.sampling, stop_token_ids=job.stop_token_ids,
            message_ends=job.message_ends,
        )
        call = decode.stub.Stream(request, timeout=_timeout(deadline))
        self._track(flight, call)
        try:
            yield from call
        except grpc.RpcError as exc:
            if flight.cancelled:
                return
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.router.decode.mark_failed(decode)
            raise upstream_error(exc, f"decode worker {decode.address}", job.prompt_field) from None
        finally:
            call.cancel()  # no-op once the stream has ended; stops it if our consumer went away

    def _usage(self, job: Job, cached: int, completion: int) -> common_pb2.Usage:
        usage = make_usage(self.prices, len(job.token_ids), cached, completion)
        self.totals.add(usage, job.kind)
        return usage

    def _ended(self, job: Job, flight: InFlight, cached: int, completion: int) -> Iterator[Event]:
        """A cancelled request: its usage counts in the totals either way; an abort is answered, a
        disconnect or deadline is not (module docstring)."""
        usage = self._usage(job, cached, completion)
        if flight.reason == ABORT:
            yield Finished("abort", usage)
        elif flight.reason == DEADLINE:
            raise DeadlineExceeded("the request's deadline passed")


def _without_finish(response: inference_pb2.GenerateResponse) -> inference_pb2.GenerateResponse:
    copy = inference_pb2.GenerateResponse()
    copy.CopyFrom(response)
    copy.finish_reason = ""
    copy.ClearField("usage")
    return copy


def _timeout(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceeded("the request's deadline passed")
    return remaining

