"""A throw-away Kubernetes control plane on 127.0.0.1: etcd plus kube-apiserver, built by ops/tools.

    python ops/tools/local_apiserver.py [--dir DIR]   # runs until Ctrl-C; prints the kubeconfig to use

Design decisions:

- Only the API server and its store: no scheduler, controllers or kubelet, so objects are validated,
  defaulted, admitted and stored, and nothing runs. That is exactly what proves a chart is accepted by a
  real cluster (``helm install`` against it), in seconds and without containers.
- Binaries come from the cache that etcd.sh and kube-apiserver.sh fill (``$K3_CACHE/bin``); this module
  never builds. A missing one raises ``FileNotFoundError`` naming the script to run.
- Credentials are made per run with openssl: a CA, the serving certificate for 127.0.0.1 and a client
  certificate in group ``system:masters`` (the API server's built-in superusers, so no RBAC set-up is
  needed), both signed by that CA, and the service-account signing key. Clients verify the server against
  the CA like against any cluster.
- Everything listens on 127.0.0.1 on free ports; etcd runs without fsync (throw-away data).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

TOOLS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS_DIR))
from kube_validate import k3_cache, tool_versions  # noqa: E402


def cached_binary(name: str, version_key: str, script: str) -> Path:
    path = k3_cache() / "bin" / f"{name}-{tool_versions()[version_key]}"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"{name} not found at {path}; build it with: bash ops/tools/{script}")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def make_credentials(directory: Path) -> None:
    """CA, serving and admin client certificates, and the service-account key pair in ``directory``."""
    if shutil.which("openssl") is None:
        raise FileNotFoundError("openssl not found (apt-get install openssl)")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "2", "-subj", "/CN=k3-local-ca", cwd=directory)
    (directory / "serving.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "serving.key", "-out", "serving.csr",
            "-subj", "/CN=127.0.0.1", cwd=directory)
    openssl("x509", "-req", "-in", "serving.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "serving.crt", "-days", "2", "-extfile", "serving.ext", cwd=directory)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "admin.key", "-out", "admin.csr",
            "-subj", "/O=system:masters/CN=k3-admin", cwd=directory)
    openssl("x509", "-req", "-in", "admin.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "admin.crt", "-days", "2", cwd=directory)
    openssl("genrsa", "-out", "sa.key", "2048", cwd=directory)
    openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=directory)


class LocalControlPlane:
    """etcd + kube-apiserver in ``workdir``; ``start()`` returns once /readyz answers ok."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.etcd_binary = cached_binary("etcd", "ETCD_VERSION", "etcd.sh")
        self.apiserver_binary = cached_binary("kube-apiserver", "KUBERNETES_VERSION", "kube-apiserver.sh")
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.kubeconfig = self.workdir / "kubeconfig"
        self._processes: list[tuple[str, subprocess.Popen[bytes]]] = []

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # the child keeps its own descriptor
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self._processes.append((name, process))
        return process

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def start(self, timeout: float = 240) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        make_credentials(self.workdir)
        client_port, peer_port = free_port(), free_port()
        etcd_url = f"http://127.0.0.1:{client_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self._spawn("etcd", [
            str(self.etcd_binary), "--name", "k3", "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"k3={peer_url}", "--unsafe-no-fsync", "--log-level", "warn",
        ])
        w = self.workdir
        self._spawn("kube-apiserver", [
            str(self.apiserver_binary),
            f"--etcd-servers={etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            # The reconciler publishes the advertise address as the `kubernetes` Service's endpoint and
            # refuses loopback; a server that only answers on 127.0.0.1 has no endpoint to publish.
            "--endpoint-reconciler-type=none",
            f"--tls-cert-file={w / 'serving.crt'}", f"--tls-private-key-file={w / 'serving.key'}",
            f"--client-ca-file={w / 'ca.crt'}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer=https://127.0.0.1:{self.port}",
            f"--service-account-key-file={w / 'sa.pub'}", f"--service-account-signing-key-file={w / 'sa.key'}",
            # Only an allocation range for Service ClusterIPs; nothing routes to it.
            "--service-cluster-ip-range=10.96.0.0/16",
            "--enable-priority-and-fairness=false", "--profiling=false",
        ])
        self._write_kubeconfig()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _write_kubeconfig(self) -> None:
        w = self.workdir
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: local\n  cluster:\n    server: {self.url}\n    certificate-authority: {w / 'ca.crt'}\n"
            f"users:\n- name: admin\n  user:\n    client-certificate: {w / 'admin.crt'}\n"
            f"    client-key: {w / 'admin.key'}\n"
            "contexts:\n- name: local\n  context: {cluster: local, user: admin}\ncurrent-context: local\n"
        )
        self.kubeconfig.chmod(0o600)

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.workdir / "ca.crt"))
        context.load_cert_chain(self.workdir / "admin.crt", self.workdir / "admin.key")
        return context

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        context = self.ssl_context()
        last = "no answer"
        while time.monotonic() < deadline:
            for name, process in self._processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited with status {process.returncode}:\n{self.log_tail(name)}")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", context=context, timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.5)
        raise TimeoutError(f"kube-apiserver not ready after {timeout:.0f}s ({last}):\n"
                           f"{self.log_tail('kube-apiserver')}")

    def stop(self) -> None:
        for _, process in reversed(self._processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self._processes.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run etcd + kube-apiserver on 127.0.0.1 until Ctrl-C.")
    parser.add_argument("--dir", type=Path, help="working directory (default: a new temporary one)")
    args = parser.parse_args(argv)
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="k3-apiserver-"))
    try:
        plane = LocalControlPlane(workdir)
        plane.start()
    except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
        print(f"local_apiserver: {exc}", file=sys.stderr)
        return 2
    print(f"kube-apiserver ready at {plane.url}\nexport KUBECONFIG={plane.kubeconfig}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        plane.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
