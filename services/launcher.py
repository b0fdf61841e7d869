"""Process manager behind ``k3 up``: the serving services as separate processes on one machine.

``Launcher`` starts ``k3 serve cache``, then ``prefill`` and ``decode`` (which need the cache address),
then ``router`` (which needs all of them), each as its own ``python -m k3 serve <name>`` child process, and
gives each a config file of its own. Design decisions:

- **Ports.** Workers listen on port 0 and announce the bound address on stdout (``k3 serve: <name>
  listening on <host>:<port>``); the launcher reads it and wires the next services to it, so nothing
  races for a port. Only the router gets a fixed port (the address clients use).
- **Ready means healthy.** A service counts as started once it announced its address *and* answers
  ``grpc.health.v1`` with SERVING; a child that exits or misses ``startup_timeout`` fails the start.
- **Wiring wins.** The user's config file may set anything in each service's section, except the
  addresses that connect the services, which the launcher writes; the model (checkpoint or preset) given
  on the command line overrides the file's and is passed to every service that loads a model, and the
  router gets the same model so its tokenizer and context match the workers'.
- **One log.** Each child's stdout and stderr are merged and copied line by line into one stream, every
  line prefixed with the service name.
- **Clean stop.** ``stop`` sends SIGTERM to the router first and waits for it (it stops taking requests
  and drains its streams while the workers still serve them), then to the other children; whoever is still
  running ``stop_grace`` seconds after its SIGTERM is killed. Children run in their own session, so a terminal's Ctrl-C reaches only the launcher, which
  then stops them in that order. If a child dies on its own, ``run`` reports it and stops the rest.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICES = ("cache", "prefill", "decode", "router")
ANNOUNCE = re.compile(r"^k3 serve: (\S+) listening on (\S+)\s*$")
MODEL_SERVICES = ("prefill", "decode")


class LaunchError(RuntimeError):
    """A service failed to start, or the launch was interrupted."""


@dataclass
class LaunchConfig:
    """What ``k3 up`` starts and how."""

    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-service config sections (``cache``, ``prefill``, ``decode``, ``router``) from the user's file."""
    checkpoint: str | None = None
    """Trained checkpoint or run folder served by every model service (overrides the file)."""
    preset: str | None = None
    """Preset served with random weights (overrides the file)."""
    host: str = "127.0.0.1"
    """Interface every service binds."""
    router_port: int = 50051
    """The router's port (0: any free port); the workers always take free ports."""
    startup_timeout: float = 300.0
    """Seconds one service may take to become healthy (loading a model included)."""
    stop_grace: float = 20.0
    """Seconds the children get after SIGTERM before they are killed."""

    def __post_init__(self) -> None:
        from k3.services.common.config import ConfigError

        for name in ("startup_timeout", "stop_grace"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"must be a number > 0, got {value!r}", field=f"up.{name}")
        port = self.router_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"must be a port in 0..65535, got {port!r}", field="up.router_port")
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"must be a non-empty string, got {self.host!r}", field="up.host")

    @classmethod
    def from_file(cls, path: str | os.PathLike | None, **overrides: Any) -> LaunchConfig:
        """Read a YAML/JSON file with one section per service and an optional ``up`` section."""
        from k3.services.common.config import ConfigError, read_config_file

        data = read_config_file(path) if path is not None else {}
        unknown = sorted(set(data) - {*SERVICES, "up"})
        if unknown:
            raise ConfigError(f"unknown section(s) {', '.join(unknown)} (known: up, {', '.join(SERVICES)})",
                              source=str(path))
        for name, section in data.items():
            if not isinstance(section, dict):
                raise ConfigError(f"must be a mapping, got {type(section).__name__}", field=name, source=str(path))
        up = dict(data.get("up", {}))
        known_up = {"startup_timeout", "stop_grace", "host", "router_port"}
        if set(up) - known_up:
            raise ConfigError(f"unknown key(s) {', '.join(sorted(set(up) - known_up))} (known: "
                              f"{', '.join(sorted(known_up))})", field="up", source=str(path))
        fields = {**up, **{k: v for k, v in overrides.items() if v is not None}}
        services = {name: data.get(name, {}) for name in SERVICES}
        return cls(services=services, **fields)


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, recursively for nested mappings."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def model_section(config: LaunchConfig) -> dict[str, Any] | None:
    """The ``model`` settings given on the command line (None: keep each file section's own)."""
    if config.checkpoint is not None and config.preset is not None:
        raise LaunchError("give --checkpoint or --preset, not both")
    if config.checkpoint is not None:
        return {"checkpoint": str(Path(config.checkpoint).resolve()), "preset": None}
    if config.preset is not None:
        return {"preset": config.preset, "checkpoint": None}
    return None


def worker_model(name: str, config: LaunchConfig) -> dict[str, Any]:
    """The ``model`` section a prefill or decode worker gets.

    A preset has no tokenizer of its own; the byte-level one is given (unless the file names one) so that
    the workers produce text and honour stop strings with the same tokenizer the router uses.
    """
    section = dict(config.services.get(name, {}).get("model", {}))
    chosen = model_section(config)
    if chosen is not None:
        section.update(chosen)
    if section.get("preset") is not None and section.get("checkpoint") is None:
        section.setdefault("tokenizer", "byte")
    return {k: v for k, v in section.items() if v is not None}


def service_config(name: str, config: LaunchConfig, addresses: dict[str, str]) -> dict[str, Any]:
    """The config file contents of service ``name``: the user's section with the wiring written over it."""
    section = copy.deepcopy(config.services.get(name, {}))
    if name in MODEL_SERVICES:
        section.pop("model", None)
        return deep_merge(section, {"cache_address": addresses["cache"], "model": worker_model(name, config)})
    if name == "router":
        model = worker_model("prefill", config)
        router_model = {k: model[k] for k in ("checkpoint", "preset", "tokenizer") if k in model}
        router_model.update({k: v for k, v in section.pop("model", {}).items() if k == "max_context"})
        wiring = {
            "upstream": {"prefill": [addresses["prefill"]], "decode": [addresses["decode"]],
                         "cache": [addresses["cache"]]},
            "model": router_model,
        }
        return deep_merge(section, wiring)
    return section


class Child:
    """One ``k3 serve`` process and the thread copying its output."""

    def __init__(self, name: str, args: list[str], emit: Callable[[str], None]):
        self.name = name
        self.address: str | None = None
        self.announced = threading.Event()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            errors="replace", env=env, start_new_session=True,
        )
        self._emit = emit
        self._reader = threading.Thread(target=self._copy, name=f"k3-up-{name}", daemon=True)
        self._reader.start()

    def _copy(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            match = ANNOUNCE.match(line)
            if match and match.group(1) == self.name:
                self.address = match.group(2)
                self.announced.set()
            self._emit(f"{self.name:<8}| {line}")
        self.announced.set()  # end of output: wake a waiter (it then sees the exit)

    def join_output(self, timeout: float) -> None:
        self._reader.join(timeout)


def wait_healthy(address: str, deadline: float, alive: Callable[[], bool]) -> None:
    """Poll ``grpc.health.v1.Health/Check`` until SERVING; ``LaunchError`` on timeout or death."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if not alive():
                raise LaunchError(f"exited before {address} became healthy")
            try:
                response = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise LaunchError(f"{address} did not become healthy in time")
            time.sleep(0.1)


class Launcher:
    """Starts, watches and stops the services (module docstring)."""

    def __init__(self, config: LaunchConfig, emit: Callable[[str], None] | None = None,
                 stop_requested: threading.Event | None = None):
        self.config = config
        self._lock = threading.Lock()
        self._emit_raw = emit or (lambda line: print(line, flush=True))
        self.stop_requested = stop_requested or threading.Event()
        self.children: list[Child] = []
        self.addresses: dict[str, str] = {}
        self._workdir = Path(tempfile.mkdtemp(prefix="k3-up-"))

    def emit(self, line: str) -> None:
        with self._lock:
            self._emit_raw(line)

    def spawn(self, name: str) -> Child:
        """Start ``k3 serve name`` with its config file (wired to the services already started)."""
        path = self._workdir / f"{name}.json"
        path.write_text(json.dumps(service_config(name, self.config, self.addresses), indent=2))
        port = self.config.router_port if name == "router" else 0
        args = [sys.executable, "-m", "k3", "serve", name, "--config", str(path), "--host", self.config.host,
                "--port", str(port)]
        child = Child(name, args, self.emit)
        self.children.append(child)
        self.emit(f"k3 up: started {name} (pid {child.proc.pid})")
        return child

    def await_ready(self, child: Child) -> None:
        """Wait until ``child`` announced its address and is healthy; ``LaunchError`` otherwise."""
        deadline = time.monotonic() + self.config.startup_timeout
        while not child.announced.wait(0.2):
            if self.stop_requested.is_set():
                raise LaunchError("interrupted during start-up")
            if time.monotonic() > deadline:
                raise LaunchError(f"{child.name} did not start within {self.config.startup_timeout:g}s")
        if child.address is None:
            child.proc.wait(timeout=10)
            raise LaunchError(f"{child.name} exited with status {child.proc.returncode} during start-up")
        try:
            wait_healthy(child.address, deadline, lambda: child.proc.poll() is None and not self.stop_requested.is_set())
        except LaunchError as exc:
            if self.stop_requested.is_set():
                raise LaunchError("interrupted during start-up") from None
            raise LaunchError(f"{child.name} {exc}") from None
        self.addresses[child.name] = child.address
        self.emit(f"k3 up: {child.name} ready on {child.address}")

    def start(self) -> str:
        """Start every service in dependency order; returns the router address. Stops all on failure."""
        try:
            self.await_ready(self.spawn("cache"))
            workers = [self.spawn("prefill"), self.spawn("decode")]
            for child in workers:
                self.await_ready(child)
            self.await_ready(self.spawn("router"))
        except BaseException:
            self.stop()
            raise
        return self.addresses["router"]

    def run(self) -> int:
        """Watch the children until a stop is requested (0) or one of them dies (1); then stop all."""
        try:
            while not self.stop_requested.wait(0.2):
                for child in self.children:
                    status = child.proc.poll()
                    if status is not None:
                        child.join_output(2.0)
                        self.emit(f"k3 up: {child.name} exited with status {status}; stopping the other services")
                        return 1
            self.emit("k3 up: stopping")
            return 0
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop the router, then the other children (SIGTERM, kill after ``stop_grace``); idempotent."""
        router = [c for c in self.children if c.name == "router"]
        others = [c for c in self.children if c.name != "router"]
        for group in (router, others):
            self._terminate(group)
        self.children.clear()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def _terminate(self, children: list[Child]) -> None:
        for child in children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_grace
        for child in children:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.emit(f"k3 up: {child.name} did not stop within {self.config.stop_grace:g}s; killing it")
                child.proc.kill()
                child.proc.wait()
            child.join_output(2.0)
