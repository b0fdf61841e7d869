"""``k3 serve cache`` as a real subprocess: health, reflection, errors, config errors and SIGTERM draining."""

from __future__ import annotations

import hashlib
import os
import select
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from k3.protos.v1 import cache_pb2, cache_pb2_grpc, common_pb2
from k3.services.common.client import error_detail, make_channel

pytestmark = pytest.mark.timeout(120)

BLOCKS = 96
BLOCK_FLOATS = 64 * 1024  # 256 KiB per block: the stream (24 MiB) is far larger than any transport buffer


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("K3_")}


def _k3(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "k3", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        **kwargs,
    )


def _read_address(proc: subprocess.Popen, timeout: float = 60) -> str:
    """Wait for ``k3 serve: <name> listening on <host>:<port>`` on stdout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if "listening on" in line:
                return line.rsplit(" ", 1)[1].strip()
            if not line and proc.poll() is not None:
                break
    proc.kill()
    raise AssertionError(f"server did not start: {proc.communicate()[1]}")


@pytest.fixture
def cache_server(tmp_path):
    config = tmp_path / "cache.yaml"
    config.write_text(
        "server:\n  grace_seconds: 60\n"
        f"store:\n  memory_bytes: {64 << 20}\n  max_value_bytes: {1 << 20}\n"
    )
    proc = _k3("serve", "cache", "--config", str(config), "--port", "0")
    try:
        yield proc, _read_address(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _block(i: int) -> cache_pb2.Block:
    tensor = common_pb2.Tensor(dtype="float32", shape=[BLOCK_FLOATS], data=bytes([i]) * (4 * BLOCK_FLOATS))
    return cache_pb2.Block(
        key=hashlib.blake2b(i.to_bytes(4, "little"), digest_size=32).digest(),
        kind="kda_checkpoint",
        tensors=[tensor],
        names=["state"],
    )


def test_health_reflection_and_field_errors(cache_server):
    _, address = cache_server
    with make_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "k3.v1.CacheStore"):
            response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "k3.v1.CacheStore" in database.get_services()
        assert database.FindFileContainingSymbol("k3.v1.CacheStore").name == "k3/v1/cache.proto"

        stub = cache_pb2_grpc.CacheStoreStub(channel)
        block = _block(0)
        block.kind = "foo"
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(cache_pb2.PutRequest(block=block), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == (
            "block.kind: unknown kind 'foo' (expected one of mla_block, kda_checkpoint, vision_tokens)"
        )
        detail = error_detail(info.value)
        assert (detail.field, detail.reason) == ("block.kind", "UNKNOWN_KIND")


def test_sigterm_drains_the_in_flight_stream_then_exits_zero(cache_server):
    proc, address = cache_server
    blocks = [_block(i) for i in range(BLOCKS)]
    with make_channel(address) as channel:
        stub = cache_pb2_grpc.CacheStoreStub(channel)
        for block in blocks:
            stub.Put(cache_pb2.PutRequest(block=block), timeout=30)
        request = cache_pb2.GetManyRequest(keys=[b.key for b in blocks], kind="kda_checkpoint")
        stream = stub.GetMany(request, timeout=90)
        first = next(stream)  # the stream is running; the client now stops reading, so it cannot finish
        proc.send_signal(signal.SIGTERM)

        # New calls are refused once shutdown has begun (poll a fresh channel each time).
        for _ in range(400):
            with make_channel(address) as fresh:
                try:
                    cache_pb2_grpc.CacheStoreStub(fresh).Stats(cache_pb2.StatsRequest(), timeout=2)
                except grpc.RpcError as err:
                    assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("the server kept accepting new calls after SIGTERM")
        assert proc.poll() is None  # still draining

        rest = list(stream)
        assert stream.code() == grpc.StatusCode.OK
    received = [first, *rest]
    assert len(received) == BLOCKS
    assert [r.block.key for r in received] == [b.key for b in blocks]
    assert received[-1].block.tensors[0].data == blocks[-1].tensors[0].data

    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "received SIGTERM" in stderr
    assert "draining 1 in-flight RPC(s)" in stderr
    assert "Traceback" not in stderr


def test_unknown_service_is_one_line_exit_2():
    proc = _k3("serve", "nope")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    from k3.services.registry import SERVICES

    assert err == f"k3: error: unknown service 'nope' (known: {', '.join(sorted(SERVICES))})\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("server:\n  port: [\n", "invalid YAML at line 3 column 1"),
        ("server:\n  prot: 1\n", "server.prot: unknown key (known: auth_token,"),
        ("store:\n  memory_bytes: lots\n", "store.memory_bytes: must be int, got str 'lots'"),
    ],
)
def test_config_errors_are_one_line_exit_2(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    proc = _k3("serve", "cache", "--config", str(path))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.count("\n") == 1 and err.startswith(f"k3: error: config: {path}: ")
    assert message in err
