"""Fixtures shared across test folders. Each external system keeps its own delimited block below."""

# ===== Redis =============================================================================================
# `redis_url` points at a real Redis: K3_REDIS_URL if set, otherwise a throwaway `redis-server` started
# from PATH for the test session. `redis_server_factory` starts extra servers that a test may stop and
# restart (outage tests). Without a redis-server binary these fixtures fail the test when CI is set (a CI
# run must never silently skip its Redis coverage) and skip it with the reason otherwise.

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
import redis as redis_client


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_server_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        reason = "redis-server is not installed (apt-get install redis-server) and K3_REDIS_URL is not set"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must run the Redis tests")
        pytest.skip(reason)
    return binary


class RedisServer:
    """A `redis-server` child process on 127.0.0.1 without persistence; can be stopped and restarted."""

    def __init__(self, binary: str, port: int | None = None):
        self.binary = binary
        self.port = port or _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._workdir = tempfile.mkdtemp(prefix="k3-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout: float = 10.0) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        args += ["--dir", self._workdir]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis_client.Redis.from_url(self.url, socket_connect_timeout=0.2, socket_timeout=0.5)
        deadline = time.monotonic() + ready_timeout
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis_client.ConnectionError:
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("K3_REDIS_URL")
    if url:
        yield url
        return
    server = RedisServer(_redis_server_binary())
    server.start()
    try:
        yield server.url
    finally:
        server.cleanup()


@pytest.fixture
def redis_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Starts private servers (``factory()``) that the test may stop/start; all are removed afterwards."""
    binary = _redis_server_binary()
    servers: list[RedisServer] = []

    def factory(port: int | None = None) -> RedisServer:
        server = RedisServer(binary, port)
        servers.append(server)
        server.start()
        return server

    yield factory
    for server in servers:
        server.cleanup()


# ===== end Redis =========================================================================================


# ===== Kafka =============================================================================================
# `kafka_bootstrap` is the host:port of a real Kafka broker: K3_KAFKA_BOOTSTRAP if set, otherwise a broker
# started for the session through ops/kafka (needs Java 17+ and the jars cached by ops/kafka/fetch.sh; a
# test run never downloads). `kafka_broker_factory` starts private brokers (own port and data directory)
# that a test may stop and restart. Without Kafka these fixtures fail the test when CI is set and skip it
# with the reason otherwise. Tests that use them carry `@pytest.mark.kafka`.


def kafka_unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the Kafka tests")
    pytest.skip(reason)


def _local_kafka(run_dir):
    from k3.services.bus.local_broker import LocalKafka, free_port_pair

    broker = LocalKafka(port=free_port_pair(), run_dir=run_dir)
    problem = broker.problem()
    if problem:
        kafka_unavailable(f"no local Kafka broker can start: {problem}")
    return broker


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory) -> Iterator[str]:
    bootstrap = os.environ.get("K3_KAFKA_BOOTSTRAP")
    if bootstrap:
        yield bootstrap
        return
    broker = _local_kafka(tmp_path_factory.mktemp("kafka"))
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def kafka_broker_factory(tmp_path) -> Iterator[Callable[[], object]]:
    """``factory()`` starts a private broker (a ``LocalKafka``); every one is stopped after the test."""
    brokers = []

    def factory():
        broker = _local_kafka(tmp_path / f"kafka-{len(brokers)}")
        brokers.append(broker)
        broker.start()
        return broker

    yield factory
    for broker in brokers:
        broker.stop()


# ===== end Kafka =========================================================================================
