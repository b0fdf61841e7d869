"""Server interceptors: in-flight count, telemetry (spans + metrics), bearer-token auth, exception mapping.

The server installs them outermost first: in-flight count, telemetry, auth, errors. Telemetry therefore observes every
outcome (including UNAUTHENTICATED) and the error interceptor, closest to the handler, turns exceptions into
statuses before anything else sees them.

Design decisions:

- Each interceptor wraps the *behaviour* of the method handler (unary or server-streaming alike), so the
  wrapping runs in the handler's thread, sees the servicer context, and covers a stream until its last
  message, not just until the generator object is returned.
- Tracing is written here rather than taken from ``opentelemetry-instrumentation-grpc``: the providers are
  passed explicitly (no global tracer provider) and one wrapper gives spans and metrics the same notion of
  the final status code. Context comes from the W3C ``traceparent`` metadata and is attached only while
  handler code runs (around each step of a stream), never across a ``yield``.
- Deadlines: gRPC itself ends the RPC with DEADLINE_EXCEEDED for the client when the deadline passes, even if
  the handler is still running. Handlers doing long work should check ``context.time_remaining()`` or
  ``context.is_active()`` and stop; the error interceptor refuses to start a handler whose deadline has
  already passed, and a stream is not resumed once its RPC is no longer active.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from k3.services.common.errors import (
    INTERNAL_MESSAGE,
    DeadlineExceeded,
    Internal,
    K3Error,
    Unauthenticated,
    abort,
)
from k3.services.common.telemetry import Telemetry

log = logging.getLogger(__name__)

# Services anyone may call: probes and tooling must work without the token.
OPEN_SERVICES = frozenset(
    {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection"}
)

Behavior = Callable[[Any, grpc.ServicerContext], Any]
# (behavior, response_streaming, handler_call_details) -> wrapped behavior
Wrapper = Callable[[Behavior, bool, grpc.HandlerCallDetails], Behavior]


def split_method(method: str) -> tuple[str, str]:
    """``/k3.v1.CacheStore/Put`` -> ``("k3.v1.CacheStore", "Put")``."""
    _, service, name = method.split("/", 2) if method.count("/") >= 2 else ("", "", method)
    return service, name


def wrap_handler(handler: grpc.RpcMethodHandler | None, details: grpc.HandlerCallDetails, wrapper: Wrapper):
    """A copy of ``handler`` whose behaviour is ``wrapper(behaviour, response_streaming, details)``."""
    if handler is None:  # unknown method: let gRPC answer UNIMPLEMENTED
        return None
    kinds = (
        (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
        (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
        (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
        (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
    )
    for behavior, factory in kinds:
        if behavior is not None:
            return factory(
                wrapper(behavior, handler.response_streaming, details),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


class ErrorInterceptor(grpc.ServerInterceptor):
    """``K3Error`` -> its rich status; any other exception -> INTERNAL (traceback logged, never sent)."""

    def intercept_service(self, continuation, handler_call_details):
        return wrap_handler(continuation(handler_call_details), handler_call_details, self._wrap)

    @staticmethod
    def _handle(exc: Exception, context: grpc.ServicerContext, method: str) -> None:
        if isinstance(exc, K3Error):
            abort(context, exc)
        code = context.code()
        if code is not None and code != grpc.StatusCode.OK:
            # The handler chose a status itself (context.abort / set_code): keep it.
            raise exc
        log.error("unhandled exception in %s", method, exc_info=exc)
        abort(context, Internal(INTERNAL_MESSAGE))

    def _wrap(self, behavior: Behavior, streaming: bool, details: grpc.HandlerCallDetails) -> Behavior:
        method = details.method

        def check_deadline(context: grpc.ServicerContext) -> None:
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                abort(context, DeadlineExceeded("deadline expired before the handler started"))

        if not streaming:

            def unary(request, context):
                check_deadline(context)
                try:
                    return behavior(request, context)
                except Exception as exc:
                    self._handle(exc, context, method)

            return unary

        def stream(request, context):
            check_deadline(context)
            try:
                for item in behavior(request, context):
                    yield item
                    if not context.is_active():  # cancelled or past its deadline: stop producing
                        return
            except Exception as exc:
                self._handle(exc, context, method)

        return stream


class InFlightInterceptor(grpc.ServerInterceptor):
    """Counts the RPCs being handled (a stream counts until its last message), for shutdown to report."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def _add(self, delta: int) -> None:
        with self._lock:
            self._count += delta

    def intercept_service(self, continuation, handler_call_details):
        return wrap_handler(continuation(handler_call_details), handler_call_details, self._wrap)

    def _wrap(self, behavior: Behavior, streaming: bool, details: grpc.HandlerCallDetails) -> Behavior:
        if not streaming:

            def unary(request, context):
                self._add(1)
                try:
                    return behavior(request, context)
                finally:
                    self._add(-1)

            return unary

        def stream(request, context):
            self._add(1)
            try:
                yield from behavior(request, context)
            finally:
                self._add(-1)

        return stream


def _bearer(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class AuthInterceptor(grpc.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on every method except health and reflection."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("auth token must not be empty")
        self._token = token.encode()

    def intercept_service(self, continuation, handler_call_details):
        service, _ = split_method(handler_call_details.method)
        handler = continuation(handler_call_details)
        if service in OPEN_SERVICES:
            return handler
        given = _bearer(handler_call_details.invocation_metadata)
        if given is not None and hmac.compare_digest(given.encode(), self._token):
            return handler
        error = Unauthenticated(
            "missing bearer token in 'authorization' metadata" if given is None else "invalid bearer token"
        )

        def deny(behavior, streaming, details):
            def refuse(request, context):
                abort(context, error)

            def refuse_stream(request, context):
                abort(context, error)
                yield  # pragma: no cover - makes this a generator, like the handler it replaces

            return refuse_stream if streaming else refuse

        return wrap_handler(handler, handler_call_details, deny)


@contextmanager
def _activated(span: trace.Span | None) -> Iterator[None]:
    if span is None:
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)


def _final_code(context: grpc.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    code = context.code()
    if code is not None:
        return code
    if isinstance(exc, GeneratorExit):
        return grpc.StatusCode.CANCELLED
    if exc is not None:
        return grpc.StatusCode.UNKNOWN
    if not context.is_active():
        # Finished after the client stopped waiting: the client saw its deadline or its cancellation.
        remaining = context.time_remaining()
        return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED
    return grpc.StatusCode.OK


class TelemetryInterceptor(grpc.ServerInterceptor):
    """Server spans (parented on the caller's W3C context) and per-method request metrics.

    Metrics (OpenTelemetry instruments, attributes ``rpc.service``, ``rpc.method`` and, where known,
    ``rpc.grpc.status_code``): ``rpc.server.requests`` (counter), ``rpc.server.duration`` (histogram, s),
    ``rpc.server.active_requests`` (up-down counter, the in-flight gauge).
    """

    def __init__(self, telemetry: Telemetry):
        self._telemetry = telemetry
        self._tracer = telemetry.tracer() if telemetry.tracing else None
        self._meter = telemetry.meter() if telemetry.metrics else None
        if self._meter is not None:
            self._requests = self._meter.create_counter(
                "rpc.server.requests", unit="{request}", description="RPCs handled, by final status"
            )
            self._duration = self._meter.create_histogram(
                "rpc.server.duration", unit="s", description="Time from the start of an RPC to its last message"
            )
            self._active = self._meter.create_up_down_counter(
                "rpc.server.active_requests", unit="{request}", description="RPCs in flight"
            )

    def intercept_service(self, continuation, handler_call_details):
        return wrap_handler(continuation(handler_call_details), handler_call_details, self._wrap)

    def _start(self, details: grpc.HandlerCallDetails, attributes: dict[str, str]):
        span = None
        if self._tracer is not None:
            carrier = {k: v for k, v in details.invocation_metadata or () if isinstance(v, str)}
            parent = self._telemetry.propagator.extract(carrier)
            span = self._tracer.start_span(
                f"{attributes['rpc.service']}/{attributes['rpc.method']}",
                context=parent,
                kind=SpanKind.SERVER,
                attributes={"rpc.system": "grpc", **attributes},
            )
        if self._meter is not None:
            self._active.add(1, attributes)
        return span, time.perf_counter()

    def _finish(self, span, started: float, attributes, context, exc: BaseException | None) -> None:
        code = _final_code(context, exc)
        if self._meter is not None:
            self._active.add(-1, attributes)
            final = {**attributes, "rpc.grpc.status_code": code.value[0]}
            self._requests.add(1, final)
            self._duration.record(time.perf_counter() - started, final)
        if span is not None:
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code != grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, code.name))
            span.end()

    def _wrap(self, behavior: Behavior, streaming: bool, details: grpc.HandlerCallDetails) -> Behavior:
        service, method = split_method(details.method)
        attributes = {"rpc.service": service, "rpc.method": method}

        if not streaming:

            def unary(request, context):
                span, started = self._start(details, attributes)
                exc = None
                try:
                    with _activated(span):
                        return behavior(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    self._finish(span, started, attributes, context, exc)

            return unary

        def stream(request, context):
            span, started = self._start(details, attributes)
            exc = None
            iterator = None
            try:
                with _activated(span):
                    iterator = iter(behavior(request, context))
                while True:
                    # Handler code runs inside next(); the span is current only there, not across yield.
                    with _activated(span):
                        try:
                            item = next(iterator)
                        except StopIteration:
                            break
                    yield item
            except BaseException as e:
                exc = e
                raise
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
                self._finish(span, started, attributes, context, exc)

        return stream
