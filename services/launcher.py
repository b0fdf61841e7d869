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
- **Expert pools.** With ``expert_pools = N`` (``k3 up --expert-pools N``), N ``k3 serve experts --shard i/N``
  processes start after the cache, and the launcher writes their addresses to the *pool set file*
  (``k3.services.experts.pool_set``; ``expert_pool_file`` or one in the launcher's temporary folder). Prefill
  and decode get ``model.expert_pools_file`` pointing at it, so their MoE layers call the pools through one
  ``ExpertPoolClient`` that follows the file. The pool set is changed at runtime by editing that file (``k3
  experts pools --file F --add ADDR --remove ADDR``): workers pick up the change within
  ``model.expert_pool_client.watch_interval_s``. A pool the launcher started that leaves the set keeps
  serving for ``pool_drain_s`` (in-flight calls finish, the workers stop sending) and is then stopped. A pool
  that dies is reported but stops nothing: the workers retry its work on the other pools (requests that no
  pool can serve fail alone, with UNAVAILABLE).
- **Vision.** ``k3 serve vision`` is started (after the cache store, with its address, before the router,
  which gets its address as ``upstream.vision``) when the served checkpoint holds a vision encoder (``vision/``,
  written by image-text training) or when the config file has a ``vision`` section (e.g. ``encoder: {preset:
  vit-tiny, lm_hidden_size: 128}`` to try images on random weights). Otherwise no vision service runs and
  requests with images are refused with FAILED_PRECONDITION.
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

SERVICES = ("cache", "prefill", "decode", "vision", "router")
EXPERTS = "experts"
"""The config section every expert pool starts from (``server``, ``load_window_s``, ...; not ``model``/``shard``)."""
SECTIONS = (*SERVICES, EXPERTS)
UP_KEYS = {"startup_timeout", "stop_grace", "host", "router_port", "expert_pools", "expert_pool_file", "pool_drain_s"}
ANNOUNCE = re.compile(r"^k3 serve: (\S+) listening on (\S+)\s*$")
MODEL_SERVICES = ("prefill", "decode")


class LaunchError(RuntimeError):
    """A service failed to start, or the launch was interrupted."""


@dataclass
class LaunchConfig:
    """What ``k3 up`` starts and how."""

    services: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-service config sections (``cache``, ``prefill``, ``decode``, ``router``, ``experts``) from the user's
    file."""
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
    expert_pools: int = 0
    """Expert pools to start (shards 0/N .. N-1/N); 0: prefill and decode compute the experts themselves."""
    expert_pool_file: str | None = None
    """Where the pool set file is written (default: the launcher's temporary folder); the file to edit to add or
    remove pools while serving."""
    pool_drain_s: float = 3.0
    """Seconds a started pool that left the pool set keeps serving before it is stopped."""

    def __post_init__(self) -> None:
        from k3.services.common.config import ConfigError

        pools = self.expert_pools
        if isinstance(pools, bool) or not isinstance(pools, int) or pools < 0:
            raise ConfigError(f"must be an integer >= 0, got {pools!r}", field="up.expert_pools")
        for name in ("startup_timeout", "stop_grace", "pool_drain_s"):
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
        unknown = sorted(set(data) - {*SECTIONS, "up"})
        if unknown:
            raise ConfigError(f"unknown section(s) {', '.join(unknown)} (known: up, {', '.join(SECTIONS)})",
                              source=str(path))
        for name, section in data.items():
            if not isinstance(section, dict):
                raise ConfigError(f"must be a mapping, got {type(section).__name__}", field=name, source=str(path))
        up = dict(data.get("up", {}))
        known_up = UP_KEYS
        if set(up) - known_up:
            raise ConfigError(f"unknown key(s) {', '.join(sorted(set(up) - known_up))} (known: "
                              f"{', '.join(sorted(known_up))})", field="up", source=str(path))
        fields = {**up, **{k: v for k, v in overrides.items() if v is not None}}
        services = {name: data.get(name, {}) for name in SECTIONS}
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


def vision_encoder(config: LaunchConfig) -> dict[str, Any] | None:
    """The ``encoder`` section of the vision service to start, or None when none should run (see Vision)."""
    section = config.services.get("vision", {})
    if config.checkpoint is not None:
        from k3.model.checkpoint import CheckpointError
        from k3.model.vision_sft import vision_checkpoint_folder

        try:
            return {"checkpoint": str(vision_checkpoint_folder(Path(config.checkpoint).resolve()))}
        except CheckpointError:
            pass
    if section:
        return dict(section.get("encoder", {}))
    return None


def service_config(name: str, config: LaunchConfig, addresses: dict[str, str]) -> dict[str, Any]:
    """The config file contents of service ``name``: the user's section with the wiring written over it."""
    section = copy.deepcopy(config.services.get(name, {}))
    if name in MODEL_SERVICES:
        section.pop("model", None)
        model = worker_model(name, config)
        if "expert_pools_file" in addresses:  # the launcher's pools replace any the file names
            model.pop("expert_pools", None)
            model["expert_pools_file"] = addresses["expert_pools_file"]
        return deep_merge(section, {"cache_address": addresses["cache"], "model": model})
    if name == "router":
        model = worker_model("prefill", config)
        router_model = {k: model[k] for k in ("checkpoint", "preset", "tokenizer") if k in model}
        router_model.update({k: v for k, v in section.pop("model", {}).items() if k == "max_context"})
        wiring = {
            "upstream": {"prefill": [addresses["prefill"]], "decode": [addresses["decode"]],
                         "cache": [addresses["cache"]]},
            "model": router_model,
        }
        if "vision" in addresses:
            wiring["upstream"]["vision"] = addresses["vision"]
        return deep_merge(section, wiring)
    if name == "vision":
        encoder = vision_encoder(config) or {}
        section.pop("encoder", None)
        return deep_merge(section, {"cache_address": addresses["cache"], "encoder": encoder})
    return section


def pool_config(config: LaunchConfig, index: int, count: int) -> dict[str, Any]:
    """The config file contents of expert pool ``index`` of ``count``: the ``experts`` section with the model
    of the workers (weights only: no tokenizer, no pools) and the shard. A fixed ``server.metrics_port`` P
    becomes P + index, so that every pool has its own scrape endpoint."""
    section = copy.deepcopy(config.services.get(EXPERTS, {}))
    section.pop("shard", None)
    section.pop("model", None)
    model = {k: v for k, v in worker_model("prefill", config).items()
             if k not in ("tokenizer", "expert_pools", "expert_pools_file", "expert_pool_client")}
    server = section.get("server")
    if isinstance(server, dict) and server.get("metrics_port"):
        server["metrics_port"] = int(server["metrics_port"]) + index
    return deep_merge(section, {"model": model, "shard": f"{index}/{count}"})


class Child:
    """One ``k3 serve`` process and the thread copying its output."""

    def __init__(self, name: str, args: list[str], emit: Callable[[str], None], label: str | None = None):
        self.name = name
        self.label = label or name
        """How its log lines are prefixed (several expert pools share the name ``experts``)."""
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
            self._emit(f"{self.label:<8}| {line}")
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
        self.pools: list[Child] = []
        """Expert pools started by the launcher (also in ``children``) that have not exited."""
        self._workdir = Path(tempfile.mkdtemp(prefix="k3-up-"))
        self.pool_file: Path | None = None
        self._retiring: dict[Child, float] = {}  # pool -> when to stop it (left the pool set)
        self._stopping: dict[Child, float] = {}  # pool -> when to kill it (SIGTERM sent)
        self._pool_file_error = ""

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

    def spawn_pool(self, index: int, count: int) -> Child:
        """Start ``k3 serve experts`` for shard ``index``/``count`` (model as the workers')."""
        label = f"{EXPERTS}{index}"
        path = self._workdir / f"{label}-{len(self.children)}.json"
        path.write_text(json.dumps(pool_config(self.config, index, count), indent=2))
        args = [sys.executable, "-m", "k3", "serve", EXPERTS, "--config", str(path), "--host", self.config.host,
                "--port", "0"]
        child = Child(EXPERTS, args, self.emit, label=label)
        self.children.append(child)
        self.pools.append(child)
        self.emit(f"k3 up: started {label} (pid {child.proc.pid}) for shard {index}/{count}")
        return child

    def start_pools(self) -> None:
        """Start the configured expert pools, wait until all are healthy, write the pool set file."""
        from k3.services.experts.pool_set import write_pool_set

        count = self.config.expert_pools
        pools = [self.spawn_pool(i, count) for i in range(count)]
        for child in pools:
            self.await_ready(child)
        self.pool_file = Path(self.config.expert_pool_file or self._workdir / "expert-pools.json").resolve()
        write_pool_set(self.pool_file, [child.address for child in pools])
        self.addresses["expert_pools_file"] = str(self.pool_file)
        self.emit(f"k3 up: expert pool set in {self.pool_file} (change it with: k3 experts pools --file "
                  f"{self.pool_file} --add HOST:PORT --remove HOST:PORT)")

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
        if child.name != EXPERTS:
            self.addresses[child.name] = child.address
        self.emit(f"k3 up: {child.label} ready on {child.address}")

    def start(self) -> str:
        """Start every service in dependency order; returns the router address. Stops all on failure."""
        try:
            self.await_ready(self.spawn("cache"))
            if self.config.expert_pools:
                self.start_pools()
            workers = [self.spawn("prefill"), self.spawn("decode")]
            if vision_encoder(self.config) is not None:
                workers.append(self.spawn("vision"))
            for child in workers:
                self.await_ready(child)
            self.await_ready(self.spawn("router"))
        except BaseException:
            self.stop()
            raise
        return self.addresses["router"]

    def run(self) -> int:
        """Watch the children until a stop is requested (0) or one of them dies (1); then stop all."""
        next_read = 0.0
        try:
            while not self.stop_requested.wait(0.2):
                for child in list(self.children):
                    status = child.proc.poll()
                    if status is None:
                        continue
                    child.join_output(2.0)
                    if child not in self.pools:
                        self.emit(f"k3 up: {child.name} exited with status {status}; stopping the other services")
                        return 1
                    self._pool_exited(child, status)
                if self.pool_file is not None and time.monotonic() >= next_read:
                    next_read = time.monotonic() + 1.0
                    self._follow_pool_set()
                self._stop_retired_pools()
            self.emit("k3 up: stopping")
            return 0
        finally:
            self.stop()

    def _pool_exited(self, child: Child, status: int) -> None:
        self.children.remove(child)
        self.pools.remove(child)
        if self._retiring.pop(child, None) is not None or self._stopping.pop(child, None) is not None:
            self.emit(f"k3 up: {child.label} ({child.address}) stopped after leaving the pool set")
        else:
            self.emit(f"k3 up: {child.label} ({child.address}) exited with status {status}; the workers retry its "
                      "work on the other pools")

    def _follow_pool_set(self) -> None:
        """Schedule the stop of every started pool no longer in the pool set file (after ``pool_drain_s``)."""
        from k3.services.experts.pool_set import PoolSetError, read_pool_set

        try:
            wanted = set(read_pool_set(self.pool_file))
        except PoolSetError as exc:
            if str(exc) != self._pool_file_error:
                self.emit(f"k3 up: {exc}; the pool set is unchanged")
            self._pool_file_error = str(exc)
            return
        self._pool_file_error = ""
        for child in self.pools:
            if child.address not in wanted and child not in self._retiring and child not in self._stopping:
                self.emit(f"k3 up: {child.label} ({child.address}) left the pool set; stopping it in "
                          f"{self.config.pool_drain_s:g}s")
                self._retiring[child] = time.monotonic() + self.config.pool_drain_s
            elif child.address in wanted and child in self._retiring:  # put back before its stop
                del self._retiring[child]
                self.emit(f"k3 up: {child.label} ({child.address}) is back in the pool set")

    def _stop_retired_pools(self) -> None:
        now = time.monotonic()
        for child, when in list(self._retiring.items()):
            if now >= when:
                del self._retiring[child]
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
                self._stopping[child] = now + self.config.stop_grace
        for child, when in list(self._stopping.items()):
            if now >= when and child.proc.poll() is None:
                self.emit(f"k3 up: {child.label} did not stop within {self.config.stop_grace:g}s; killing it")
                child.proc.kill()

    def stop(self) -> None:
        """Stop the router, then the other children (SIGTERM, kill after ``stop_grace``); idempotent."""
        router = [c for c in self.children if c.name == "router"]
        others = [c for c in self.children if c.name != "router"]
        for group in (router, others):
            self._terminate(group)
        self.children.clear()
        self.pools.clear()
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
                self.emit(f"k3 up: {child.label} did not stop within {self.config.stop_grace:g}s; killing it")
                child.proc.kill()
                child.proc.wait()
            child.join_output(2.0)
