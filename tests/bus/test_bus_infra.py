"""The local infrastructure scripts (ops/) and `k3 infra`, run for real."""

import os
import shutil
import subprocess
import sys

import pytest
import redis

from k3.services.bus.local_broker import InfraError, LocalKafka, free_port_pair, ops_dir, run_ops_script

pytestmark = pytest.mark.timeout(120)


def k3(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "k3", *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def bare_path(tmp_path) -> str:
    """A PATH with a shell and core tools but none of the servers (no java, mvn, redis-server)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "cat", "sed", "head", "tail", "mkdir", "rm", "dirname", "sleep", "kill"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


@pytest.mark.parametrize(
    ("component", "message"),
    [
        ("redis", "k3: error: redis: redis-server not found; install it with: apt-get install redis-server"),
        ("kafka", "k3: error: kafka: java not found; install a JDK 17+"),
    ],
    ids=["redis", "kafka"],
)
def test_infra_up_names_the_missing_prerequisite_in_one_line(bare_path, tmp_path, component, message):
    env = dict(os.environ, PATH=bare_path, K3_CACHE=str(tmp_path / "cache"))
    done = k3("infra", "up", component, env=env)
    assert done.returncode == 2
    assert done.stderr.startswith(message)
    assert len(done.stderr.strip().splitlines()) == 1


def test_infra_up_checks_everything_before_starting_anything(bare_path, tmp_path):
    env = dict(os.environ, PATH=bare_path, K3_CACHE=str(tmp_path / "cache"))
    done = k3("infra", "up", env=env)
    assert done.returncode == 2
    assert "redis-server not found" in done.stderr
    assert not (tmp_path / "cache" / "run").exists()  # nothing was started or prepared


def test_infra_status_reports_components_and_the_variables_to_export(tmp_path):
    redis_port, kafka_port = free_port_pair(), free_port_pair()
    env = dict(os.environ, K3_CACHE=str(tmp_path / "cache"))
    done = k3("infra", "status", "--redis-port", str(redis_port), "--kafka-port", str(kafka_port), env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"redis  stopped  127.0.0.1:{redis_port}" in lines
    assert f"kafka  stopped  127.0.0.1:{kafka_port}" in lines
    assert f"export K3_REDIS_URL=redis://127.0.0.1:{redis_port}/0" in lines
    assert f"export K3_KAFKA_BOOTSTRAP=127.0.0.1:{kafka_port}" in lines


def test_infra_rejects_unknown_components_and_ports():
    done = k3("infra", "status", "zookeeper")
    assert done.returncode == 2
    assert done.stderr.strip() == "k3: error: unknown component 'zookeeper'; expected one of: redis, kafka"
    done = k3("infra", "status", "--kafka-port", "65535")
    assert done.returncode == 2
    assert done.stderr.strip() == "k3: error: --kafka-port must be in 1..65534, got 65535"


def test_ops_dir_override_must_hold_the_scripts(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_OPS_DIR", str(tmp_path))
    with pytest.raises(InfraError, match=f"ops scripts not found in {tmp_path}; run from a source checkout"):
        ops_dir()


def test_kafka_status_of_a_broker_that_never_ran(tmp_path):
    broker = LocalKafka(port=free_port_pair(), run_dir=tmp_path / "kafka")
    assert not broker.is_running()
    with pytest.raises(InfraError, match=r"^ops/kafka/status\.sh failed \(exit 3\)"):
        run_ops_script("kafka/status.sh", [], broker.env(), timeout_s=30)


def test_kafka_check_without_cached_jars_refuses_to_download_when_asked(tmp_path):
    env = dict(os.environ, K3_CACHE=str(tmp_path / "empty-cache"))
    with pytest.raises(InfraError, match="the Kafka jars are not cached in .*; fetch them with ops/kafka/fetch.sh") as e:
        run_ops_script("kafka/check.sh", ["--cached"], env, timeout_s=60)
    assert e.value.missing_prerequisite


@pytest.mark.redis
def test_redis_scripts_start_serve_and_stop_a_server(tmp_path):
    if shutil.which("redis-server") is None:
        reason = "redis-server is not installed (apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    port = free_port_pair()
    env = dict(os.environ, K3_REDIS_PORT=str(port), K3_REDIS_RUN_DIR=str(tmp_path / "redis"))
    out = run_ops_script("redis/start.sh", [], env, timeout_s=60)
    try:
        assert f"redis: running on 127.0.0.1:{port}" in out
        assert "already running" in run_ops_script("redis/start.sh", [], env, timeout_s=60)
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        client.set("k3", b"ok")
        assert client.get("k3") == b"ok"
        assert client.config_get("save") == {"save": ""}  # a cache tier: nothing persisted
        client.close()
        assert run_ops_script("redis/status.sh", [], env, timeout_s=30).startswith("redis  running")
    finally:
        assert "redis: stopped" in run_ops_script("redis/stop.sh", [], env, timeout_s=60)
    with pytest.raises(InfraError, match=r"exit 3"):
        run_ops_script("redis/status.sh", [], env, timeout_s=30)
    assert "not running" in run_ops_script("redis/stop.sh", [], env, timeout_s=60)


def test_kafka_check_rejects_an_old_java(bare_path, tmp_path):
    java = tmp_path / "bin" / "java"
    java.write_text('#!/bin/bash\necho \'openjdk version "11.0.22" 2024-01-16\' >&2\n')
    java.chmod(0o755)
    env = dict(os.environ, PATH=bare_path, K3_CACHE=str(tmp_path / "cache"))
    with pytest.raises(InfraError, match=r"^kafka: java 11 found; Kafka 4\.x needs Java 17 or newer$"):
        run_ops_script("kafka/check.sh", [], env, timeout_s=30)


def test_kafka_check_needs_maven_only_while_the_jars_are_not_cached(bare_path, tmp_path):
    if shutil.which("java") is None:
        pytest.skip("java is not installed")
    (tmp_path / "bin" / "java").symlink_to(shutil.which("java"))
    env = dict(os.environ, PATH=bare_path, K3_CACHE=str(tmp_path / "cache"))
    with pytest.raises(InfraError, match="^kafka: mvn not found and the Kafka jars are not cached; install Maven"):
        run_ops_script("kafka/check.sh", [], env, timeout_s=60)
    marker = tmp_path / "cache" / "kafka-4.4.0" / ".complete"
    marker.parent.mkdir(parents=True)
    marker.write_text("4.4.0\n")
    run_ops_script("kafka/check.sh", [], env, timeout_s=60)  # cached: Maven is not needed any more
