"""``k3 up`` as a real subprocess: four services start, serve through the router, and all stop on SIGINT."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from k3.protos.v1 import inference_pb2, inference_pb2_grpc
from k3.services.common.config import ConfigError
from k3.services.launcher import LaunchConfig, Launcher, service_config

pytestmark = pytest.mark.timeout(300)

CONFIG = """\
up:
  stop_grace: 30
cache:
  server: {grace_seconds: 1}
prefill:
  server: {grace_seconds: 1}
decode:
  server: {grace_seconds: 1}
  engine: {max_context: 4096, max_slots: 8, max_batch: 8}
router:
  server: {grace_seconds: 1}
"""


def _k3_up(tmp_path, *args: str) -> subprocess.Popen:
    config = tmp_path / "up.yaml"
    config.write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    return subprocess.Popen(
        [sys.executable, "-m", "k3", "up", "--config", str(config), "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )


class Output:
    """The launcher's output lines, read by a thread (a pipe read by select+readline can hide buffered lines)."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def until(self, pattern: str, timeout: float = 240) -> re.Match | None:
        """Collect lines until one matches (None if the output ended first)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError("timed out; output so far:\n" + "\n".join(self.lines)) from None
            if line is None:
                return None
            self.lines.append(line)
            match = re.search(pattern, line)
            if match:
                return match

    def rest(self, timeout: float = 120) -> list[str]:
        self.until(r"(?!x)x", timeout)
        return self.lines


def _k3(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    return subprocess.run([sys.executable, "-m", "k3", *args], capture_output=True, text=True, env=env, timeout=120)


def _pids(lines: list[str]) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for line in lines if (m := re.search(r"k3 up: started (\w+) \(pid (\d+)\)", line))}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_up_serves_and_stops_everything_on_sigint(tmp_path):
    proc = _k3_up(tmp_path, "--preset", "tiny")
    output = Output(proc)
    try:
        match = output.until(r"k3 up: router listening on (\S+)")
        lines = output.lines
        assert match is not None, "\n".join(lines)
        address = match.group(1)
        pids = _pids(lines)
        assert set(pids) == {"cache", "prefill", "decode", "router"}
        assert any(line.startswith("prefill ") and "| " in line for line in lines)  # prefixed child logs
        with grpc.insecure_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            responses = list(stub.Generate(inference_pb2.GenerateRequest(
                prompt="hello k3", sampling=inference_pb2.SamplingParams(max_tokens=3)), timeout=120))
        assert responses[-1].finish_reason in ("stop", "length")
        assert responses[-1].usage.prompt_tokens == len("hello k3")
        # The terminal clients talk to the same router.
        generate = _k3("generate", "--router", address, "--prompt", "hello k3", "--max-tokens", "3")
        assert generate.returncode == 0, generate.stderr
        assert "usage: 8 prompt tokens" in generate.stderr
        chat = _k3("chat", "--router", address, "--message", "hi", "--max-tokens", "3")
        assert chat.returncode == 0, chat.stderr
        assert re.search(r"usage: \d+ prompt tokens \(\d+ from cache\), [1-3] generated", chat.stderr)
        bad = _k3("chat", "--router", address, "--message", "hi", "--temperature", "-1")
        assert bad.returncode == 2 and "INVALID_ARGUMENT [sampling.temperature]" in bad.stderr
        proc.send_signal(signal.SIGINT)
        lines = output.rest()
        assert proc.wait(timeout=60) == 0, "\n".join(lines)
        assert "k3 up: stopping" in lines
        assert all(_gone(pid) for pid in pids.values()), pids
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_up_reports_a_service_that_fails_to_start(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("cache:\n  store: {memory_bytes: -5}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_")}
    proc = subprocess.run([sys.executable, "-m", "k3", "up", "--preset", "tiny", "--config", str(config),
                           "--port", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cache exited with status 2 during start-up" in proc.stderr
    assert "store.memory_bytes" in proc.stdout  # the child's own error, in the multiplexed log
    pids = _pids(proc.stdout.splitlines())
    assert list(pids) == ["cache"] and _gone(pids["cache"])


def test_a_dying_child_stops_the_others():
    lines: list[str] = []
    launcher = Launcher(LaunchConfig(stop_grace=20), emit=lines.append)
    first = launcher.spawn("cache")
    launcher.await_ready(first)
    second = launcher.spawn("cache")  # a second store: something that must be stopped when the first dies
    launcher.await_ready(second)
    first.proc.kill()
    assert launcher.run() == 1
    assert f"k3 up: cache exited with status {-signal.SIGKILL}; stopping the other services" in lines
    assert second.proc.returncode is not None and _gone(second.proc.pid)
    assert any(line.startswith("cache   | k3 serve: cache listening on") for line in lines)


def test_launch_config_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("routr: {}\n")
    with pytest.raises(ConfigError, match="unknown section"):
        LaunchConfig.from_file(path)
    path.write_text("up: {stop_grace: -1}\n")
    with pytest.raises(ConfigError, match="up.stop_grace: must be a number > 0"):
        LaunchConfig.from_file(path)
    config = LaunchConfig.from_file(None, preset="tiny")
    wiring = {"cache": "127.0.0.1:1", "prefill": "127.0.0.1:2", "decode": "127.0.0.1:3"}
    assert service_config("decode", config, wiring)["model"] == {"preset": "tiny", "tokenizer": "byte"}
    router = service_config("router", config, wiring)
    assert router["upstream"] == {"prefill": ["127.0.0.1:2"], "decode": ["127.0.0.1:3"], "cache": ["127.0.0.1:1"]}
    assert router["model"] == {"preset": "tiny", "tokenizer": "byte"}
