"""Fixtures of the deployment tests: the Helm chart rendered by the cached Helm CLI, strict offline
validation against the Kubernetes schemas, and a local etcd + kube-apiserver.

The tools are built by ops/tools/*.sh (helm.sh, kuberay-crds.sh, etcd.sh, kube-apiserver.sh) and only looked
up here, never built. A missing tool fails the test when CI is set (a CI run must never silently drop the
chart checks) and skips it with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "ops" / "tools"


def _load(name: str) -> ModuleType:
    """An ops/tools module (they are scripts, not a package); they import each other by plain name."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_kube_validate = _load("kube_validate")
_chart = _load("chart")
_local_apiserver = _load("local_apiserver")


def tool_missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run the deployment tests")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def chart() -> ModuleType:
    """ops/tools/chart.py: rendering, golden files, the cached helm."""
    return _chart


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        return _chart.helm_binary()
    except _chart.ToolMissing as exc:
        tool_missing(str(exc))


@pytest.fixture(scope="session")
def crd_paths() -> list[Path]:
    """KubeRay's CRD files (ops/tools/kuberay-crds.sh)."""
    try:
        return _kube_validate.default_crd_paths()
    except FileNotFoundError as exc:
        tool_missing(str(exc))


@pytest.fixture(scope="session")
def validator(crd_paths) -> Any:
    return _kube_validate.Validator(crd_paths=crd_paths)


class Rendered:
    """One render: the text and its objects, with lookups by kind and name."""

    def __init__(self, text: str):
        self.text = text
        self.objects = list(_kube_validate.documents(text))

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def names(self, kind: str) -> set[str]:
        return {o["metadata"]["name"] for o in self.of_kind(kind)}

    def config(self, component: str) -> dict:
        return yaml.safe_load(self.get("ConfigMap", f"k3-{component}")["data"]["config.yaml"])


@pytest.fixture(scope="session")
def render(helm) -> Callable[..., Rendered]:
    """``render(example=None, *set_values)``: a (cached) render of the chart with an example's values."""
    cache: dict[tuple, Rendered] = {}

    def do_render(example: str | None = None, *set_values: str) -> Rendered:
        key = (example, *set_values)
        if key not in cache:
            files = [_chart.EXAMPLES_DIR / f"{example}.yaml"] if example else []
            cache[key] = Rendered(_chart.render(files, set_values))
        return cache[key]

    return do_render


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory) -> Iterator[Any]:
    """etcd + kube-apiserver on 127.0.0.1 for the whole session."""
    try:
        plane = _local_apiserver.LocalControlPlane(tmp_path_factory.mktemp("apiserver"))
    except FileNotFoundError as exc:
        tool_missing(str(exc))
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()
