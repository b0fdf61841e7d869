"""A local Prometheus scraping every service of ``k3 up --observe``.

``assign_metrics_ports`` gives each service a ``server.metrics_port`` in the launch config (before the
services start; the expert pools get consecutive ones, ``assign_pool_metrics_ports``), ``prometheus_config`` writes the scrape configuration for them, and ``LocalPrometheus``
runs the ``prometheus`` binary (Debian package ``prometheus``) on loopback until stopped.

Design decisions:

- The real Prometheus server, not a home-made collector: the same PromQL, HTTP API and alert rules as in a
  cluster, so ``ops/prometheus/alerts.yml`` and the planner's queries work unchanged against it.
- One scrape job per service, named ``k3-<service>`` (the job label tells the services apart, as the
  per-Deployment jobs of a cluster do).
- Metrics ports are picked free by binding port 0 and releasing it just before the services start; the
  short window in which another process could take one is accepted for a developer's machine (the
  service then fails to start with a clear bind error, nothing is silently unscraped).
- Throw-away storage: a temporary data directory, removed on stop, unless the caller names one.
- ``stop`` sends SIGTERM and kills after a grace period; Prometheus runs in its own session so a
  terminal's Ctrl-C reaches only ``k3 up``, which then stops it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from k3.services.common.config import format_address

#: the repository's alert rules, loaded when present (a source checkout)
DEFAULT_RULES = Path(__file__).resolve().parents[1] / "ops" / "prometheus" / "alerts.yml"


class ObserveError(RuntimeError):
    """Prometheus is missing, could not start, or did not become ready."""


@dataclass
class ObserveConfig:
    """How ``k3 up --observe`` runs Prometheus."""

    host: str = "127.0.0.1"
    """Interface Prometheus listens on (and where the services' metrics are scraped)."""
    port: int = 9090
    """Prometheus' port; 0 picks a free one."""
    scrape_interval_s: float = 5.0
    """Seconds between scrapes of each service."""
    binary: str = "prometheus"
    """The Prometheus executable (a name looked up on PATH, or a path)."""
    data_dir: str | None = None
    """TSDB directory; None = a temporary one, removed on stop."""
    rule_files: list[str] = field(default_factory=list)
    """Alert/recording rule files to load."""
    startup_timeout_s: float = 60.0
    """Seconds Prometheus may take to answer /-/ready."""
    stop_grace_s: float = 10.0
    """Seconds after SIGTERM before Prometheus is killed."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"observe.port must be in 0..65535, got {self.port}")
        if not self.scrape_interval_s >= 1:
            raise ValueError(f"observe.scrape_interval_s must be >= 1 (Prometheus' resolution), got "
                             f"{self.scrape_interval_s}")
        for name in ("startup_timeout_s", "stop_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"observe.{name} must be > 0, got {getattr(self, name)}")
        for path in self.rule_files:
            if not Path(path).is_file():
                raise ValueError(f"observe.rule_files: {path} is not a file")


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def assign_metrics_ports(services: dict[str, dict[str, Any]], names: Sequence[str], host: str) -> dict[str, str]:
    """Give each service in ``names`` a free ``server.metrics_port`` (in place); returns name -> host:port.

    A port the user's config already sets is kept.
    """
    targets = {}
    for name in names:
        section = services.setdefault(name, {})
        server = section.setdefault("server", {})
        if not isinstance(server, dict):
            raise ValueError(f"{name}.server must be a mapping, got {type(server).__name__}")
        if server.get("metrics") is False:
            raise ValueError(f"{name}.server.metrics is false; --observe needs metrics on")
        if not server.get("metrics_port"):
            server["metrics_port"] = free_port(host)
        targets[name] = format_address(host, int(server["metrics_port"]))
    return targets


def free_port_range(host: str, count: int, attempts: int = 50) -> int:
    """A port P such that P .. P + count - 1 were all free just now (for the expert pools, which take a fixed
    ``server.metrics_port`` plus their index)."""
    for _ in range(attempts):
        base = free_port(host)
        if base + count - 1 > 65535:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket(family, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise ObserveError(f"found no {count} consecutive free ports on {host}")


def assign_pool_metrics_ports(services: dict[str, dict[str, Any]], pools: int, host: str) -> list[str]:
    """Metrics ports of ``pools`` expert pools: the ``experts`` section's ``server.metrics_port`` P (picked
    when unset) is pool i's P + i (the launcher's rule); returns their host:port in shard order."""
    if pools <= 0:
        return []
    section = services.setdefault("experts", {})
    server = section.setdefault("server", {})
    if not isinstance(server, dict):
        raise ValueError(f"experts.server must be a mapping, got {type(server).__name__}")
    if server.get("metrics") is False:
        raise ValueError("experts.server.metrics is false; --observe needs metrics on")
    if not server.get("metrics_port"):
        server["metrics_port"] = free_port_range(host, pools)
    base = int(server["metrics_port"])
    return [format_address(host, base + i) for i in range(pools)]


def _duration(seconds: float) -> str:
    return f"{int(seconds * 1000)}ms"


def prometheus_config(targets: Mapping[str, str | Sequence[str]], scrape_interval_s: float,
                      rule_files: Sequence[str] = ()) -> dict[str, Any]:
    """A ``prometheus.yml`` (as a mapping) with one job ``k3-<service>`` per entry of ``targets``."""
    jobs = []
    for name, addresses in targets.items():
        addresses = [addresses] if isinstance(addresses, str) else list(addresses)
        jobs.append({"job_name": f"k3-{name}", "static_configs": [{"targets": addresses,
                                                                   "labels": {"service": name}}]})
    config: dict[str, Any] = {
        "global": {"scrape_interval": _duration(scrape_interval_s),
                   "evaluation_interval": _duration(scrape_interval_s)},
        "scrape_configs": jobs,
    }
    if rule_files:
        config["rule_files"] = [str(Path(p).resolve()) for p in rule_files]
    return config


class LocalPrometheus:
    """A ``prometheus`` process on ``config.host`` with a generated configuration."""

    def __init__(self, config: ObserveConfig, targets: Mapping[str, str | Sequence[str]]):
        binary = shutil.which(config.binary)
        if binary is None:
            raise ObserveError(f"{config.binary!r} not found; install it (Debian/Ubuntu: apt-get install "
                               f"prometheus) or give its path")
        self.config = config
        self.binary = binary
        self.targets = dict(targets)
        self.port = config.port or free_port(config.host)
        self.url = f"http://{format_address(config.host, self.port)}"
        self._owns_dir = config.data_dir is None
        self.workdir = Path(config.data_dir or tempfile.mkdtemp(prefix="k3-prometheus-"))
        self.config_path = self.workdir / "prometheus.yml"
        self.log_path = self.workdir / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        """Start Prometheus and wait until it is ready; returns its URL."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        body = prometheus_config(self.targets, self.config.scrape_interval_s, self.config.rule_files)
        self.config_path.write_text(yaml.safe_dump(body, sort_keys=False))
        args = [self.binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address={format_address(self.config.host, self.port)}",
                "--storage.tsdb.retention.time=1d", "--log.level=warn"]
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.url

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ObserveError(f"prometheus exited with status {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.2)
        raise ObserveError(f"prometheus not ready after {self.config.startup_timeout_s:g}s ({last}):\n"
                           f"{self.log_tail()}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The result vector of an instant query (for scripts and tests)."""
        address = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(address, timeout=5) as answer:
            body = json.loads(answer.read())
        if body.get("status") != "success":
            raise ObserveError(f"query {expr!r} failed: {body.get('error', body)}")
        return body["data"]["result"]

    def where_to_look(self) -> list[str]:
        """Lines telling a user what to open."""
        jobs = ", ".join(f"k3-{name}" for name in self.targets)
        return [
            f"prometheus on {self.url} (jobs {jobs}; config {self.config_path})",
            f"  targets: {self.url}/targets   alerts: {self.url}/alerts",
            f"  try: {self.url}/graph?g0.expr=sum%20by%20(job)%20(rate(rpc_server_requests_total%5B1m%5D))",
            "  dashboards: import ops/dashboards/*.json into Grafana with this Prometheus as data source",
        ]

    def stop(self) -> None:
        """SIGTERM, kill after ``stop_grace_s``; remove a temporary data directory. Idempotent."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.config.stop_grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._owns_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def launched_services(launch_config) -> list[str]:
    """The single services ``k3 up`` will start for ``launch_config`` (the expert pools aside). The vision
    encoder runs only when the launcher finds one to serve, and a config section of its own would make it
    start, so it gets a metrics port only when it runs anyway."""
    from k3.services import launcher

    names = list(launcher.SERVICES)
    wants_vision = getattr(launcher, "vision_encoder", None)
    if "vision" in names and (wants_vision is None or wants_vision(launch_config) is None):
        names.remove("vision")
    return names


def observe_launch(launch_config, observe: ObserveConfig | None = None) -> LocalPrometheus:
    """For ``k3 up --observe``: metrics ports for every launched service and a (not yet started) Prometheus.

    ``launch_config`` is a ``k3.services.launcher.LaunchConfig``; its per-service sections get their
    ``server.metrics_port``. Rule files default to the repository's alert rules when they exist.
    """

    observe = observe or ObserveConfig(host=launch_config.host)
    if not observe.rule_files and DEFAULT_RULES.is_file():
        observe = dataclasses.replace(observe, rule_files=[str(DEFAULT_RULES)])
    targets: dict[str, str | list[str]] = dict(
        assign_metrics_ports(launch_config.services, launched_services(launch_config), launch_config.host))
    pools = assign_pool_metrics_ports(launch_config.services, getattr(launch_config, "expert_pools", 0),
                                      launch_config.host)
    if pools:
        targets["experts"] = pools  # one job, one target per pool
    return LocalPrometheus(observe, targets)
