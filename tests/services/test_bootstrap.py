"""The service bootstrap over real loopback gRPC: errors, auth, limits, deadlines, health, reflection, shutdown."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from servicekit import PROBE, ProbeService, probe_call, probe_stream, rpc_error

from k3.services.common.client import error_detail, make_channel
from k3.services.common.config import ServerConfig
from k3.services.common.errors import INTERNAL_MESSAGE
from k3.services.common.server import BindError, start_server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def probe(serve):
    service = ProbeService()
    handle = serve(service)
    with make_channel(handle.address) as channel:
        yield service, handle, channel


def test_k3_error_becomes_status_with_error_detail(probe):
    _, _, channel = probe
    err = rpc_error(lambda: probe_call(channel, "Fail", b"invalid"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "thing.field: is bad"
    detail = error_detail(err)
    assert (detail.field, detail.reason, detail.message) == ("thing.field", "BAD_THING", "is bad")

    err = rpc_error(lambda: probe_call(channel, "Fail", b"notfound"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert error_detail(err).reason == "NOT_FOUND"
    assert error_detail(err).field == ""


def test_unknown_exception_is_internal_without_traceback(probe, caplog):
    _, _, channel = probe
    err = rpc_error(lambda: probe_call(channel, "Fail", b"boom"))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert err.details() == INTERNAL_MESSAGE
    assert "secret" not in err.details() and "Traceback" not in err.details()
    # The traceback is logged server-side instead.
    assert any("secret internal detail" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


def test_status_chosen_by_handler_is_kept(probe):
    _, _, channel = probe
    err = rpc_error(lambda: probe_call(channel, "Fail", b"abort"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == "handler chose this status"
    assert error_detail(err) is None


def test_streaming_errors_are_mapped_after_the_items_already_sent(probe):
    _, _, channel = probe
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for item in probe_stream(channel, "FailStream", b"invalid"):
            received.append(item)
    assert received == [b"a", b"b"]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_detail(info.value).field == "items[2]"

    err = rpc_error(lambda: probe_stream(channel, "FailStream", b"boom"))
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in err.details()


def test_unknown_method_is_unimplemented(probe):
    _, _, channel = probe
    err = rpc_error(lambda: channel.unary_unary(f"/{PROBE}/NoSuchMethod")(b""))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED


def test_deadline_exceeded_unary_and_stream(probe):
    _, _, channel = probe
    err = rpc_error(lambda: probe_call(channel, "Slow", timeout=0.2))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for item in probe_stream(channel, "SlowStream", timeout=0.3):
            received.append(item)
    assert received == [b"first"]
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_oversized_messages_are_resource_exhausted(serve):
    handle = serve(ProbeService(), max_message_bytes=64 * 1024)
    # A client with a larger limit than the server: the server refuses the request.
    with make_channel(handle.address, ServerConfig(max_message_bytes=1 << 20)) as channel:
        err = rpc_error(lambda: probe_call(channel, "Echo", b"x" * (100 * 1024)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # ... and refuses to send a response over its limit.
        err = rpc_error(lambda: probe_call(channel, "Big", str(100 * 1024).encode()))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert probe_call(channel, "Echo", b"x" * 1000) == b"x" * 1000
    # make_channel applies the same limit on the client side.
    with make_channel(handle.address, ServerConfig(max_message_bytes=64 * 1024)) as channel:
        err = rpc_error(lambda: probe_call(channel, "Big", str(100 * 1024).encode()))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _health(channel: grpc.Channel, service: str = "") -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_and_reflection(probe):
    _, _, channel = probe
    assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    assert _health(channel, PROBE) == health_pb2.HealthCheckResponse.SERVING
    err = rpc_error(lambda: _health(channel, "k3.v1.NoSuchService"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert PROBE in services and "grpc.health.v1.Health" in services


def test_auth_token(serve):
    service = ProbeService()
    handle = serve(service, auth_token="s3cret")
    with make_channel(handle.address) as anonymous:
        err = rpc_error(lambda: probe_call(anonymous, "Echo", b"hi"))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing bearer token" in err.details()
        assert error_detail(err).reason == "UNAUTHENTICATED"
        err = rpc_error(lambda: probe_stream(anonymous, "FailStream"))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        # Probes and tooling stay open.
        assert _health(anonymous) == health_pb2.HealthCheckResponse.SERVING
        assert PROBE in ProtoReflectionDescriptorDatabase(anonymous).get_services()
        err = rpc_error(
            lambda: probe_call(anonymous, "Echo", b"hi", metadata=[("authorization", "Bearer wrong")])
        )
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "invalid bearer token" in err.details()
        err = rpc_error(
            lambda: probe_call(anonymous, "Echo", b"hi", metadata=[("authorization", "Basic s3cret")])
        )
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    with make_channel(handle.address, ServerConfig(auth_token="s3cret")) as channel:
        assert probe_call(channel, "Echo", b"hi") == b"hi"
        assert list(probe_stream(channel, "Stream", b"1")) == [b"0"]


def _wait_until_refused(address: str) -> grpc.RpcError:
    """Poll a fresh channel until the server refuses new calls (it is shutting down)."""
    for _ in range(200):
        with make_channel(address) as channel:
            try:
                probe_call(channel, "Echo", b"ping", timeout=1)
            except grpc.RpcError as err:
                return err
        threading.Event().wait(0.05)
    raise AssertionError(f"{address} kept accepting calls")


def test_graceful_stop_drains_in_flight_stream_and_refuses_new_calls(serve):
    service = ProbeService()
    handle = serve(service, grace_seconds=30)
    with make_channel(handle.address) as channel:
        stream = probe_stream(channel, "Stream", b"5")
        assert next(stream) == b"0"
        assert handle.in_flight == 1
        stopper = threading.Thread(target=handle.stop)
        stopper.start()
        err = _wait_until_refused(handle.address)
        # Refused: no listener any more (UNAVAILABLE), or a connection caught mid-shutdown (CANCELLED).
        assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert not service.closed.is_set()  # the stream is still running: the service must stay open
        service.release.set()
        assert list(stream) == [b"1", b"2", b"3", b"4"]
        assert stream.code() == grpc.StatusCode.OK
        stopper.join(timeout=30)
    assert not stopper.is_alive()
    assert service.closed.is_set() and service.close_calls == 1
    handle.stop()  # idempotent
    assert service.close_calls == 1


def test_stop_cancels_streams_that_outlive_the_grace_period(serve):
    service = ProbeService()
    handle = serve(service)
    with make_channel(handle.address) as channel:
        stream = probe_stream(channel, "Stream", b"3")
        assert next(stream) == b"0"
        handle.stop(grace=0.2)  # returns once the grace period has cut the stream off
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    service.release.set()
    assert service.closed.is_set()


def test_port_in_use_is_a_bind_error_and_closes_the_service(serve):
    handle = serve(ProbeService())
    second = ProbeService()
    with pytest.raises(BindError, match=f"cannot listen on 127.0.0.1:{handle.port}"):
        start_server(second, ServerConfig(port=handle.port))
    assert second.closed.is_set()
