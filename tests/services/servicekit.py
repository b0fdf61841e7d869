"""Helpers shared by the service tests: a test-only ``Probe`` service and call helpers.

A plainly named module (not ``conftest``) so that test files can import it unambiguously.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from k3.services.common.errors import InvalidArgument, NotFound

PROBE = "k3.test.Probe"


class ProbeService:
    """Raw-bytes methods exercising the bootstrap: errors, streams, slowness, sizes.

    ``release`` gates the second half of ``Stream``; ``closed`` records that the server closed the service.
    """

    name = "probe"
    service_names = (PROBE,)

    def __init__(self) -> None:
        self.release = threading.Event()
        self.closed = threading.Event()
        self.close_calls = 0
        self.stream_finished = threading.Event()

    def fail(self, request: bytes, context):
        if request == b"invalid":
            raise InvalidArgument("thing.field", "is bad", reason="BAD_THING")
        if request == b"notfound":
            raise NotFound("no such thing")
        if request == b"abort":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "handler chose this status")
        raise RuntimeError("secret internal detail")

    def echo(self, request: bytes, context) -> bytes:
        return request

    def big(self, request: bytes, context) -> bytes:
        return b"x" * int(request.decode())

    def slow(self, request: bytes, context) -> bytes:
        # Works until the client's deadline has passed, the way a long handler should notice it.
        while context.is_active():
            time.sleep(0.01)
        return b"too late"

    def slow_stream(self, request: bytes, context) -> Iterator[bytes]:
        yield b"first"
        while context.is_active():
            time.sleep(0.01)
        yield b"too late"

    def stream(self, request: bytes, context) -> Iterator[bytes]:
        """``n`` items; after the first it waits (bounded) for ``release``."""
        n = int(request.decode())
        yield b"0"
        if n > 1:
            self.release.wait(timeout=30)
        for i in range(1, n):
            yield str(i).encode()
        self.stream_finished.set()

    def fail_stream(self, request: bytes, context) -> Iterator[bytes]:
        yield b"a"
        yield b"b"
        if request == b"boom":
            raise RuntimeError("secret stream detail")
        raise InvalidArgument("items[2]", "cannot be produced")

    def add_to_server(self, server: grpc.Server) -> None:
        unary = {"Fail": self.fail, "Echo": self.echo, "Big": self.big, "Slow": self.slow}
        streams = {"Stream": self.stream, "FailStream": self.fail_stream, "SlowStream": self.slow_stream}
        handlers = {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in unary.items()}
        handlers.update({name: grpc.unary_stream_rpc_method_handler(fn) for name, fn in streams.items()})
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PROBE, handlers),))

    def close(self) -> None:
        self.close_calls += 1
        self.closed.set()


def probe_call(channel: grpc.Channel, method: str, request: bytes = b"", **kwargs):
    return channel.unary_unary(f"/{PROBE}/{method}")(request, **kwargs)


def probe_stream(channel: grpc.Channel, method: str, request: bytes = b"", **kwargs):
    return channel.unary_stream(f"/{PROBE}/{method}")(request, **kwargs)


def rpc_error(fn: Callable[[], object]) -> grpc.RpcError:
    """The ``grpc.RpcError`` that ``fn`` raises (fails the test if it does not raise one)."""
    with pytest.raises(grpc.RpcError) as info:
        result = fn()
        if hasattr(result, "__iter__") and not isinstance(result, bytes):
            list(result)
    return info.value
