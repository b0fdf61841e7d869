"""Channels to k3 services, and reading the ``ErrorDetail`` of a failed call.

Design decisions:

- ``make_channel`` mirrors the server side: the same message-size limits (so a too-large message fails the
  same way in both directions), the cluster's bearer token, and a client span per call whose W3C context
  travels in the metadata. Channels are plaintext: in-cluster transport security belongs to the mesh.
- The client interceptors add metadata and observe completion through the call's done-callback, so they
  work for unary and streaming calls alike without consuming the response.
"""

from __future__ import annotations

import abc
import collections

import grpc
from grpc_status import rpc_status
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from k3.protos.v1 import common_pb2
from k3.services.common.config import ServerConfig
from k3.services.common.interceptors import split_method
from k3.services.common.telemetry import Telemetry


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


def _with_metadata(details: grpc.ClientCallDetails, extra: list[tuple[str, str]]) -> _CallDetails:
    metadata = list(details.metadata or ()) + extra
    return _CallDetails(
        details.method,
        details.timeout,
        metadata,
        details.credentials,
        getattr(details, "wait_for_ready", None),
        getattr(details, "compression", None),
    )


class _ClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """One ``_intercept`` for all four call shapes."""

    @abc.abstractmethod
    def _intercept(self, continuation, details, request_or_iterator): ...

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return self._intercept(continuation, client_call_details, request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return self._intercept(continuation, client_call_details, request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return self._intercept(continuation, client_call_details, request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return self._intercept(continuation, client_call_details, request_iterator)


class BearerTokenInterceptor(_ClientInterceptor):
    def __init__(self, token: str):
        self._metadata = [("authorization", f"Bearer {token}")]

    def _intercept(self, continuation, details, request_or_iterator):
        return continuation(_with_metadata(details, self._metadata), request_or_iterator)


class TracingClientInterceptor(_ClientInterceptor):
    """A CLIENT span per call, child of the current context; its context is injected into the metadata."""

    def __init__(self, telemetry: Telemetry):
        self._tracer = telemetry.tracer()
        self._propagator = telemetry.propagator

    def _intercept(self, continuation, details, request_or_iterator):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        service, name = split_method(method)
        span = self._tracer.start_span(
            f"{service}/{name}",
            kind=SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name},
        )
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        try:
            call = continuation(_with_metadata(details, list(carrier.items())), request_or_iterator)
        except BaseException:
            span.set_status(Status(StatusCode.ERROR, "call failed to start"))
            span.end()
            raise
        call.add_done_callback(lambda done: self._finish(span, done))
        return call

    @staticmethod
    def _finish(span: trace.Span, call) -> None:
        code = call.code()
        if code is not None:
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code != grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, code.name))
        span.end()


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def make_channel(
    address: str, config: ServerConfig | None = None, *, telemetry: Telemetry | None = None
) -> grpc.Channel:
    """A channel to ``address`` with ``config``'s message limits and bearer token, traced via ``telemetry``.

    ``config`` is the calling process's own server config: services of one deployment share the limits and
    the token. Close the channel when done (``channel.close()`` or ``with``).
    """
    config = config or ServerConfig()
    channel = grpc.insecure_channel(address, options=channel_options(config.max_message_bytes))
    interceptors: list[_ClientInterceptor] = []
    if config.auth_token:
        interceptors.append(BearerTokenInterceptor(config.auth_token))
    if telemetry is not None and telemetry.tracing:
        interceptors.append(TracingClientInterceptor(telemetry))
    return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


def error_detail(error: grpc.RpcError) -> common_pb2.ErrorDetail | None:
    """The ``k3.v1.ErrorDetail`` a k3 server attached to a failed call, or None if there is none."""
    try:
        status = rpc_status.from_call(error)
    except ValueError:  # trailer inconsistent with the call's code/message
        return None
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(common_pb2.ErrorDetail.DESCRIPTOR):
            out = common_pb2.ErrorDetail()
            detail.Unpack(out)
            return out
    return None
