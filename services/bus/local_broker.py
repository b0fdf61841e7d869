"""Drives the local single-node Kafka broker of ``ops/kafka`` from Python (tests, ``k3 infra``).

The shell scripts stay the single implementation of how the broker is fetched, configured, started and
stopped; this module only runs them with the right environment (port, run directory) and turns their exit
status into exceptions. Exit status 2 from any ops script means a prerequisite is missing.
"""

from __future__ import annotations

import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

import k3

MISSING_PREREQUISITE = 2


class InfraError(RuntimeError):
    """An ops script failed; ``missing_prerequisite`` tells a missing tool apart from a failure."""

    def __init__(self, message: str, missing_prerequisite: bool = False):
        super().__init__(message)
        self.missing_prerequisite = missing_prerequisite


def ops_dir() -> Path:
    """The repository's ``ops/`` folder (``K3_OPS_DIR`` overrides; needed for a non-source install)."""
    configured = os.environ.get("K3_OPS_DIR")
    path = Path(configured) if configured else Path(k3.__file__).resolve().parent.parent / "ops"
    if not (path / "infra.sh").is_file():
        raise InfraError(
            f"ops scripts not found in {path}; run from a source checkout of k3 or set K3_OPS_DIR",
            missing_prerequisite=True,
        )
    return path


def run_ops_script(script: str, args: list[str], env: dict[str, str], timeout_s: float) -> str:
    """Runs ``ops/<script>``; returns its stdout, raises InfraError (with its stderr) when it fails."""
    path = ops_dir() / script
    command = " ".join([f"ops/{script}", *args])
    try:
        done = subprocess.run(
            ["bash", str(path), *args], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise InfraError(f"{command} did not finish within {timeout_s:.0f} s") from exc
    if done.returncode == MISSING_PREREQUISITE:
        lines = done.stderr.strip().splitlines()
        raise InfraError(lines[-1] if lines else f"{command}: a prerequisite is missing", True)
    if done.returncode != 0:
        raise InfraError(f"{command} failed (exit {done.returncode}):\n{done.stderr.strip()}")
    return done.stdout


def free_port_pair() -> int:
    """A port P on 127.0.0.1 such that P and P+1 are free (client and controller listener of a broker)."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise InfraError("found no two adjacent free ports on 127.0.0.1")


@dataclass(frozen=True)
class LocalKafka:
    """One local broker, identified by its client port and its run directory (config, data, pid, log).

    Fields:
        port: PLAINTEXT client port on 127.0.0.1; the KRaft controller listens on port + 1.
        run_dir: where the broker keeps everything; None uses the ops scripts' default under K3_CACHE.
            The data in it survives ``stop``/``start``.
        start_timeout_s: how long ``start`` may take (includes a first-time storage format).
    """

    port: int = 19092
    run_dir: Path | None = None
    start_timeout_s: float = 180.0

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ, K3_KAFKA_PORT=str(self.port), K3_KAFKA_START_TIMEOUT=str(int(self.start_timeout_s)))
        if self.run_dir is not None:
            env["K3_KAFKA_RUN_DIR"] = str(self.run_dir)
        return env

    def problem(self, allow_download: bool = False) -> str | None:
        """Why the broker cannot start here (missing Java, jars not cached...), or None when it can."""
        args = [] if allow_download else ["--cached"]
        try:
            run_ops_script("kafka/check.sh", args, self.env(), timeout_s=60)
        except InfraError as exc:
            return str(exc)
        return None

    def start(self) -> None:
        run_ops_script("kafka/start.sh", [], self.env(), timeout_s=self.start_timeout_s + 60)

    def stop(self) -> None:
        run_ops_script("kafka/stop.sh", [], self.env(), timeout_s=120)

    def is_running(self) -> bool:
        try:
            run_ops_script("kafka/status.sh", [], self.env(), timeout_s=30)
        except InfraError:
            return False
        return True
