"""Strict, offline validation of Kubernetes manifests against the API's own schemas.

    python ops/tools/kube_validate.py rendered.yaml [...]   # '-' reads stdin; exit 1 on any invalid object

Design decisions:

- Built-in kinds are checked against the JSON schemas that the PyPI package ``kubernetes-validate`` ships,
  generated from the Kubernetes OpenAPI document of each release. The "-strict" variant is used: every
  object schema forbids unknown properties, so a misspelt field (``readinesProbe``) or a field at the wrong
  level is an error, as with ``kubectl --validate=strict``. The version is ``KUBERNETES_VERSION`` from
  versions.env, the release the API-server test runs.
- Custom resources are never waved through: ``ray.io/v1`` kinds are checked against the
  ``openAPIV3Schema`` of KubeRay's own CRDs (fetched by kuberay-crds.sh), made strict the same way (objects
  reject unknown fields unless the CRD marks them ``x-kubernetes-preserve-unknown-fields``) and with
  ``metadata`` checked as a real ObjectMeta. A kind with no schema at all is an error, not a warning.
- HorizontalPodAutoscalers on Pods metrics are plain autoscaling/v2 objects; the custom-metrics API that
  serves those metrics is an aggregated API (an adapter's APIService), not a CRD, so nothing more is needed
  here to validate them.
- Validators are built once per kind and reused: the shared definitions file is large, and a chart renders
  dozens of objects.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

TOOLS_DIR = Path(__file__).resolve().parent
# libyaml when PyYAML has it: the KubeRay CRDs are megabytes of YAML.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
DEFINITIONS_ID = "https://kubernetes.io/api/_definitions.json"
OBJECT_META = f"{DEFINITIONS_ID}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


def tool_versions() -> dict[str, str]:
    """The KEY=value pairs of versions.env (the versions every script in ops/tools builds or fetches)."""
    versions = {}
    for line in (TOOLS_DIR / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip()
    return versions


def k3_cache() -> Path:
    return Path(os.environ.get("K3_CACHE") or Path.home() / ".cache" / "k3")


def kuberay_crd_dir() -> Path:
    return k3_cache() / f"kuberay-crds-{tool_versions()['KUBERAY_VERSION']}"


class ManifestError(ValueError):
    """An object that does not validate; ``where`` names it (kind/name) and ``path`` the offending field."""

    def __init__(self, where: str, message: str, path: str = ""):
        self.where = where
        self.path = path
        self.reason = message
        super().__init__(f"{where}: {path}: {message}" if path else f"{where}: {message}")


@dataclass(frozen=True)
class CustomKind:
    group: str
    version: str
    kind: str
    schema: dict[str, Any]


def _strict(schema: Any) -> Any:
    """A CRD's structural schema as strict JSON Schema: closed objects, ``nullable`` as a null type."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _strict(value) for key, value in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def load_crds(paths: Iterable[Path]) -> dict[tuple[str, str], CustomKind]:
    """``(apiVersion, kind) -> CustomKind`` for every served version of the CRDs in ``paths``."""
    kinds = {}
    for path in paths:
        for crd in yaml.load_all(Path(path).read_text(), Loader=_LOADER):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                if not version.get("served", True):
                    continue
                schema = _strict(version["schema"]["openAPIV3Schema"])
                schema.setdefault("properties", {})["metadata"] = {"$ref": OBJECT_META}
                api_version = f"{spec['group']}/{version['name']}"
                kinds[(api_version, spec["names"]["kind"])] = CustomKind(
                    spec["group"], version["name"], spec["names"]["kind"], schema
                )
    return kinds


class Validator:
    """Validates manifests of one Kubernetes release strictly; custom kinds come from CRD files."""

    def __init__(self, kubernetes_version: str | None = None, crd_paths: Iterable[Path] = ()):
        version = (kubernetes_version or tool_versions()["KUBERNETES_VERSION"]).lstrip("v")
        major, minor = version.split(".")[:2]
        self.kubernetes_version = f"{major}.{minor}"
        root = resources.files("kubernetes_validate") / "kubernetes-json-schema"
        self._schemas = root / f"v{major}.{minor}.0-local-strict"
        if not self._schemas.is_dir():
            raise ValueError(f"kubernetes-validate ships no schemas for Kubernetes {self.kubernetes_version}")
        definitions = json.loads((self._schemas / "_definitions.json").read_text())
        self._registry = Registry().with_resource(DEFINITIONS_ID, Resource.from_contents(definitions))
        self._crd_paths = list(crd_paths)
        self._custom: dict[tuple[str, str], CustomKind] | None = None
        self._validators: dict[tuple[str, str], jsonschema.protocols.Validator] = {}

    def _validator(self, api_version: str, kind: str) -> jsonschema.protocols.Validator:
        key = (api_version, kind)
        if key not in self._validators:
            self._validators[key] = self._build_validator(api_version, kind)
        return self._validators[key]

    def _build_validator(self, api_version: str, kind: str) -> jsonschema.protocols.Validator:
        group, _, version = api_version.rpartition("/")
        # kubernetes-validate names files <kind>-<first label of the group>-<version>.json ("core" has none).
        group_part = f"{group.split('.')[0]}-" if group else ""
        path = self._schemas / f"{kind.lower()}-{group_part}{version}.json"
        builtin = "." not in group or group.endswith(".k8s.io")
        if not builtin or not path.is_file():
            custom = self.custom_kinds().get((api_version, kind))
            if custom is None:
                known = ", ".join(sorted(f"{a} {k}" for a, k in self.custom_kinds())) or "none"
                raise LookupError(f"no schema for {kind} in {api_version} (Kubernetes {self.kubernetes_version};"
                                  f" custom kinds: {known})")
            return jsonschema.Draft202012Validator(custom.schema, registry=self._registry)
        schema = json.loads(path.read_text())
        return jsonschema.Draft202012Validator(schema, registry=self._registry)

    def custom_kinds(self) -> dict[tuple[str, str], CustomKind]:
        """The kinds the CRD files define, parsed on first use (the files are large)."""
        if self._custom is None:
            self._custom = load_crds(self._crd_paths)
        return self._custom

    def validate(self, obj: Any) -> None:
        """Raises ``ManifestError`` naming the object and the first offending field."""
        if not isinstance(obj, dict):
            raise ManifestError("document", f"expected a mapping, got {type(obj).__name__}")
        api_version, kind = obj.get("apiVersion"), obj.get("kind")
        name = (obj.get("metadata") or {}).get("name", "?")
        where = f"{kind}/{name}"
        if not isinstance(api_version, str) or not isinstance(kind, str):
            raise ManifestError(where, "apiVersion and kind must be strings")
        try:
            validator = self._validator(api_version, kind)
        except LookupError as exc:
            raise ManifestError(where, str(exc)) from None
        error = jsonschema.exceptions.best_match(validator.iter_errors(obj))
        if error is not None:
            path = ".".join(str(part) for part in error.absolute_path)
            raise ManifestError(where, error.message, path)

    def errors(self, objects: Iterable[Any]) -> list[ManifestError]:
        """Every invalid object's error (empty when all are valid)."""
        found = []
        for obj in objects:
            try:
                self.validate(obj)
            except ManifestError as exc:
                found.append(exc)
        return found


def documents(text: str) -> Iterator[Any]:
    """The non-empty YAML documents of a multi-document stream."""
    for doc in yaml.safe_load_all(text):
        if doc is not None:
            yield doc


def default_crd_paths() -> list[Path]:
    """KubeRay's CRDs from the cache; a missing cache is an error (run ops/tools/kuberay-crds.sh)."""
    directory = kuberay_crd_dir()
    if not (directory / ".complete").exists():
        raise FileNotFoundError(f"KubeRay CRDs not found in {directory}; run bash ops/tools/kuberay-crds.sh")
    return sorted(directory.glob("*.yaml"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Validate Kubernetes manifests strictly and offline.")
    parser.add_argument("files", nargs="+", help="YAML files ('-' for stdin)")
    parser.add_argument("--kubernetes-version", help="default: KUBERNETES_VERSION of versions.env")
    parser.add_argument("--crd", action="append", type=Path, help="CRD file (default: the cached KubeRay CRDs)")
    args = parser.parse_args(argv)
    try:
        validator = Validator(args.kubernetes_version, args.crd if args.crd else default_crd_paths())
    except (FileNotFoundError, ValueError) as exc:
        print(f"kube_validate: {exc}", file=sys.stderr)
        return 2
    failed = 0
    for name in args.files:
        text = sys.stdin.read() if name == "-" else Path(name).read_text()
        objects = list(documents(text))
        errors = validator.errors(objects)
        for error in errors:
            print(f"{name}: {error}")
        failed += len(errors)
        print(f"{name}: {len(objects) - len(errors)} of {len(objects)} objects valid "
              f"(Kubernetes {validator.kubernetes_version}, strict)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
