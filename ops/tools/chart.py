"""Rendering the k3 Helm chart with the cached Helm CLI, and its golden outputs.

    python ops/tools/chart.py golden            # re-render charts/k3/golden/<example>.yaml from examples/
    python ops/tools/chart.py golden --check    # exit 1 (with a diff) if a golden file is out of date
    python ops/tools/chart.py validate          # render every example and validate it strictly, offline

Design decisions:

- Helm is the binary ops/tools/helm.sh builds (``$K3_CACHE/bin/helm-<HELM_VERSION>``; ``K3_HELM`` overrides).
  This module never builds anything: a missing binary is a ``ToolMissing`` naming the script to run.
- Rendering pins ``--kube-version`` to ``KUBERNETES_VERSION`` and a fixed release name and namespace, so the
  output depends on nothing but the chart and the values.
- The only non-deterministic value in a render is a generated bearer token (``randAlphaNum``). Goldens
  store it replaced by a fixed placeholder (valid base64, so a golden is still a valid manifest); the same
  normalisation is applied before comparing.
"""

from __future__ import annotations

import argparse
import base64
import difflib
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

TOOLS_DIR = Path(__file__).resolve().parent
REPO = TOOLS_DIR.parent.parent
CHART_DIR = REPO / "charts" / "k3"
EXAMPLES_DIR = CHART_DIR / "examples"
GOLDEN_DIR = CHART_DIR / "golden"
RELEASE = "k3"
NAMESPACE = "k3"
GENERATED_TOKEN = base64.b64encode(b"generated-at-install").decode()

sys.path.insert(0, str(TOOLS_DIR))
from kube_validate import Validator, default_crd_paths, documents, k3_cache, tool_versions  # noqa: E402


class ToolMissing(RuntimeError):
    """A tool ops/tools builds is not in the cache."""


class RenderError(RuntimeError):
    """Helm refused the chart or the values; ``stderr`` holds its message."""

    def __init__(self, stderr: str):
        self.stderr = stderr
        super().__init__(stderr.strip())


def helm_binary() -> Path:
    configured = os.environ.get("K3_HELM")
    path = Path(configured) if configured else k3_cache() / "bin" / f"helm-{tool_versions()['HELM_VERSION']}"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ToolMissing(f"helm not found at {path}; build it with: bash ops/tools/helm.sh")
    return path


def examples() -> list[Path]:
    return sorted(EXAMPLES_DIR.glob("*.yaml"))


def helm(args: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Runs the cached helm with a private, empty configuration (no user repositories or plugins)."""
    home = k3_cache() / "helm-home"
    env = dict(os.environ, HELM_CONFIG_HOME=str(home / "config"), HELM_CACHE_HOME=str(home / "cache"),
               HELM_DATA_HOME=str(home / "data"))
    return subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=timeout, env=env)


def render(values_files: Sequence[Path] = (), set_values: Sequence[str] = (), extra: Sequence[str] = ()) -> str:
    """``helm template`` of the chart; ``RenderError`` with Helm's message if it refuses."""
    args = ["template", RELEASE, str(CHART_DIR), "--namespace", NAMESPACE,
            "--kube-version", tool_versions()["KUBERNETES_VERSION"]]
    for path in values_files:
        args += ["-f", str(path)]
    for item in set_values:
        args += ["--set", item]
    result = helm([*args, *extra])
    if result.returncode != 0:
        raise RenderError(result.stderr)
    return result.stdout


_SECRET_VALUE = re.compile(r'^(  \S+: )"[A-Za-z0-9+/=]*"$', re.MULTILINE)


def normalise(rendered: str) -> str:
    """The render with the auth Secret's token replaced by a fixed placeholder (see the module docstring).

    Applied to the chart's own Secret only, whose token is generated unless ``auth.token`` is given.
    """
    parts = rendered.split("\n---\n")
    for i, part in enumerate(parts):
        if "# Source: k3/templates/auth-secret.yaml" in part:
            parts[i] = _SECRET_VALUE.sub(rf'\g<1>"{GENERATED_TOKEN}"', part)
    return "\n---\n".join(parts)


def golden_path(example: Path) -> Path:
    return GOLDEN_DIR / example.name


def render_example(example: Path) -> str:
    return normalise(render([example]))


def golden(check: bool) -> int:
    stale = 0
    for example in examples():
        text = render_example(example)
        path = golden_path(example)
        current = path.read_text() if path.exists() else ""
        if current == text:
            continue
        if check:
            stale += 1
            sys.stdout.writelines(difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True), str(path), "rendered"))
        else:
            GOLDEN_DIR.mkdir(exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(REPO)}")
    expected = {golden_path(e).name for e in examples()}
    for extra in sorted(p for p in GOLDEN_DIR.glob("*.yaml") if p.name not in expected):
        print(f"{extra.relative_to(REPO)} has no example", file=sys.stderr)
        stale += 1
    if stale:
        print(f"{stale} golden file(s) out of date; run python ops/tools/chart.py golden", file=sys.stderr)
    return 1 if stale else 0


def validate() -> int:
    validator = Validator(crd_paths=default_crd_paths())
    failed = 0
    for example in examples():
        objects = list(documents(render([example])))
        errors = validator.errors(objects)
        for error in errors:
            print(f"{example.name}: {error}")
        failed += len(errors)
        print(f"{example.name}: {len(objects) - len(errors)} of {len(objects)} objects valid")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render the k3 chart: golden outputs and strict validation.")
    sub = parser.add_subparsers(dest="command", required=True)
    golden_parser = sub.add_parser("golden", help="re-render (or --check) charts/k3/golden/")
    golden_parser.add_argument("--check", action="store_true")
    sub.add_parser("validate", help="render every example and validate it against the Kubernetes schemas")
    args = parser.parse_args(argv)
    try:
        return golden(args.check) if args.command == "golden" else validate()
    except (ToolMissing, RenderError, FileNotFoundError) as exc:
        print(f"chart: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
