"""Typed service configuration: dataclasses filled from a YAML/JSON file, the environment and overrides.

Design decisions:

- A config is a (nested) dataclass whose fields have defaults and a ``doc`` in their metadata. The generic
  :func:`load_config` works for any such dataclass; services declare sections (``server``, ``store``, ...)
  as dataclass-typed fields.
- Precedence, lowest first: field defaults, the file, the environment, explicit overrides (CLI flags).
- Environment variables are named ``K3_<SECTION>_<FIELD>`` after the field path (``server.port`` ->
  ``K3_SERVER_PORT``). A field may list extra names in ``metadata["env"]`` (``K3_AUTH_TOKEN`` is shared by
  every service); the path-derived name wins over an alias. Environment values are strings parsed by type:
  ``true/false/1/0/yes/no`` for bool, comma-separated for lists, empty or ``none`` for ``None``.
- Strict: unknown keys and wrong types are errors (a typo must not silently fall back to a default), and
  ``ConfigError`` names the field path and where the value came from (file, variable or override).
- Semantic checks live in each dataclass's ``__post_init__`` and raise ``ConfigError(..., field=name)``;
  the loader prefixes the section path and the source.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

ENV_PREFIX = "K3"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"", "none", "null"}


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range.

    ``field`` is the dotted path of the offending field and ``source`` where its value came from.
    """

    def __init__(self, message: str, *, field: str | None = None, source: str | None = None):
        self.reason = message
        self.field = field
        self.source = source
        where = ": ".join(part for part in (source, field) if part)
        super().__init__(f"{where}: {message}" if where else message)


def documented(default: Any = dataclasses.MISSING, *, doc: str, default_factory: Any = dataclasses.MISSING,
               env: tuple[str, ...] = ()) -> Any:
    """A dataclass field with its documentation (and optional extra environment variable names)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"doc": doc, "env": env})


@dataclasses.dataclass
class ServerConfig:
    """How a k3 gRPC server listens, limits messages, authenticates and reports telemetry."""

    host: str = documented("127.0.0.1", doc="Interface to bind; 0.0.0.0 to listen on all interfaces.")
    port: int = documented(50051, doc="TCP port; 0 picks a free port (the bound port is reported).")
    grace_seconds: float = documented(
        10.0, doc="On SIGTERM/SIGINT, how long in-flight RPCs and streams may run before being cancelled."
    )
    max_message_bytes: int = documented(
        64 * 1024 * 1024, doc="Largest message sent or received; larger ones fail with RESOURCE_EXHAUSTED."
    )
    max_workers: int = documented(16, doc="Threads serving RPCs; a stream holds one for its whole duration.")
    auth_token: str | None = documented(
        None,
        doc="Bearer token required in 'authorization' metadata (health and reflection stay open); None = off.",
        env=("K3_AUTH_TOKEN",),
    )
    otlp_endpoint: str | None = documented(
        None, doc="OTLP/gRPC collector address (host:port) for traces and metrics; None = export nothing."
    )
    metrics: bool = documented(True, doc="Record request count, latency and in-flight gauges per method.")
    metrics_port: int = documented(
        0, doc="Port of a Prometheus scrape endpoint (/metrics) on ``host`` for this process's metrics; 0 = off."
    )
    tracing: bool = documented(True, doc="Record server/client spans and propagate W3C trace context.")

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("must not be empty", field="host")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"must be in 0..65535, got {self.port}", field="port")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"must be in 0..65535, got {self.metrics_port}", field="metrics_port")
        if self.metrics_port and not self.metrics:
            raise ConfigError("needs metrics: true (nothing would be recorded to serve)", field="metrics_port")
        if self.grace_seconds < 0:
            raise ConfigError(f"must be >= 0, got {self.grace_seconds}", field="grace_seconds")
        if self.max_message_bytes < 1024:
            raise ConfigError(f"must be >= 1024, got {self.max_message_bytes}", field="max_message_bytes")
        if self.max_workers < 1:
            raise ConfigError(f"must be >= 1, got {self.max_workers}", field="max_workers")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ConfigError("must not be blank (use null to turn auth off)", field="auth_token")

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)


def format_address(host: str, port: int) -> str:
    """``host:port`` as gRPC expects it (IPv6 literals in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        raise TypeError(f"unsupported union type {tp}")
    return tp, False


def _type_name(tp: Any) -> str:
    tp, optional = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    name = f"list[{_type_name(typing.get_args(tp)[0])}]" if origin is list else getattr(tp, "__name__", str(tp))
    return f"{name} or null" if optional else name


def _convert(value: Any, tp: Any, path: str, source: str) -> Any:
    """Check a value decoded from a file (or an override) against a field type."""
    base, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"must be {_type_name(tp)}, got null", field=path, source=source)
    if _is_config(base):
        if not isinstance(value, Mapping):
            raise ConfigError(f"must be a mapping (section), got {type(value).__name__}", field=path, source=source)
        return value  # sections are built by _build
    if typing.get_origin(base) is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"must be {_type_name(tp)}, got {type(value).__name__}", field=path, source=source)
        (item,) = typing.get_args(base)
        return [_convert(v, item, f"{path}[{i}]", source) for i, v in enumerate(value)]
    ok = (
        (base is bool and isinstance(value, bool))
        or (base is int and isinstance(value, int) and not isinstance(value, bool))
        or (base is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (base is str and isinstance(value, str))
    )
    if not ok:
        if base not in (bool, int, float, str):
            raise TypeError(f"{path}: unsupported config field type {base}")
        raise ConfigError(f"must be {_type_name(tp)}, got {type(value).__name__} {value!r}", field=path, source=source)
    return float(value) if base is float else value


def _parse_env(text: str, tp: Any, path: str, source: str) -> Any:
    """Parse an environment variable's string by the field type."""
    base, optional = _unwrap_optional(tp)
    if optional and text.strip().lower() in _NONE:
        return None
    if typing.get_origin(base) is list:
        (item,) = typing.get_args(base)
        parts = [p.strip() for p in text.split(",") if p.strip()]
        return [_parse_env(p, item, f"{path}[{i}]", source) for i, p in enumerate(parts)]
    try:
        if base is bool:
            lowered = text.strip().lower()
            if lowered in _TRUE | _FALSE:
                return lowered in _TRUE
            raise ValueError
        if base in (int, float):
            return base(text.strip())
    except ValueError:
        raise ConfigError(f"must be {_type_name(tp)}, got {text!r}", field=path, source=source) from None
    if base is str:
        return text
    raise TypeError(f"{path}: field type {base} cannot be set from the environment")


def env_var_name(path: str) -> str:
    """``server.max_workers`` -> ``K3_SERVER_MAX_WORKERS``."""
    return "_".join([ENV_PREFIX, *path.upper().split(".")])


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML or JSON mapping; syntax errors become ``ConfigError`` naming the file and position."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", source=str(path)) from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", source=str(path)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"invalid YAML{where}: {problem}", source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"top level must be a mapping, got {type(data).__name__}", source=str(path))
    return data


def _default_layer(f: dataclasses.Field) -> dict[str, Any] | None:
    """A section field's own default instance as a mapping layer, so ``default_factory`` values count."""
    if f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    elif f.default is not dataclasses.MISSING:
        default = f.default
    else:
        return None
    return dataclasses.asdict(default) if default is not None else None


def _build(cls: type[T], prefix: str, layers: list[tuple[str, Mapping[str, Any]]], env: Mapping[str, str]) -> T:
    """Build ``cls`` from mapping layers (lowest precedence first) and the environment.

    Layers named ``override`` are applied after the environment; all others before it.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for source, layer in layers:
        for key in layer:
            if key not in fields:
                known = ", ".join(sorted(fields))
                raise ConfigError(f"unknown key (known: {known})", field=prefix + str(key), source=source)
    before_env = [(src, layer) for src, layer in layers if src != "override"]
    after_env = [(src, layer) for src, layer in layers if src == "override"]

    kwargs: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, f in fields.items():
        path, tp = prefix + name, hints[name]
        base, optional = _unwrap_optional(tp)
        if _is_config(base):
            given = [(src, _convert(layer[name], tp, path, src)) for src, layer in layers if name in layer]
            if given and given[-1][1] is None:
                kwargs[name] = None
            elif given or not optional:
                default = _default_layer(f)
                sub = ([("default", default)] if default is not None else []) + [
                    (src, value) for src, value in given if value is not None
                ]
                kwargs[name] = _build(base, path + ".", sub, env)
            continue  # an optional section nobody configured keeps its default (None)
        for source, layer in before_env:
            if name in layer:
                kwargs[name], sources[name] = _convert(layer[name], tp, path, source), source
        # The path-derived variable is read last so that it wins over an alias such as K3_AUTH_TOKEN.
        for var in (*f.metadata.get("env", ()), env_var_name(path)):
            if var in env:
                kwargs[name], sources[name] = _parse_env(env[var], tp, path, f"${var}"), f"${var}"
        for source, layer in after_env:
            if name in layer:
                kwargs[name], sources[name] = _convert(layer[name], tp, path, source), source
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError("required field is missing", field=path, source=layers[-1][0] if layers else None)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if exc.field is None or exc.source is not None:
            raise
        # Blame the source of the offending value, or, for a default that clashes with configured values
        # (max_value_bytes > a configured memory_bytes), wherever this section's values came from.
        source = sources.get(exc.field.split(".")[0].split("[")[0], "default")
        if source == "default":
            source = _where(sources)
        raise ConfigError(exc.reason, field=prefix + exc.field, source=source) from None
    except ValueError as exc:
        # A section validating itself with a plain ValueError: its message names the field, we add where.
        raise ConfigError(str(exc), field=prefix.rstrip(".") or None, source=_where(sources)) from None


def _where(sources: Mapping[str, str]) -> str:
    named = sorted({s for s in sources.values() if s != "default"})
    return ", ".join(named) or "default"


def _nest(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``{"server.port": 1}`` -> ``{"server": {"port": 1}}`` (nested mappings are accepted as they are)."""
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def load_config(
    cls: type[T],
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Load a config dataclass from defaults, an optional YAML/JSON file, the environment and overrides.

    ``env`` defaults to ``os.environ``; pass ``{}`` to ignore the environment. ``overrides`` maps dotted field
    paths (``"server.port"``) to typed values; ``None`` values are skipped so CLI flags that were not given
    do not override anything. Raises ``ConfigError`` naming the field and its source.
    """
    if not _is_config(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if path is not None:
        layers.append((str(path), read_config_file(path)))
    if overrides:
        layers.append(("override", _nest({k: v for k, v in overrides.items() if v is not None})))
    return _build(cls, "", layers, os.environ if env is None else env)


def describe(cls: type, defaults: Any = None) -> list[tuple[str, str, str, str]]:
    """``(path, type, default, doc)`` for every leaf field, for ``--help``-style listings and docs.

    Defaults are those of a default-constructed ``cls`` (so a section's ``default_factory`` counts).
    """
    if defaults is None:
        defaults = cls()
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        base, _ = _unwrap_optional(hints[f.name])
        value = getattr(defaults, f.name)
        if _is_config(base) and value is not None:
            rows += [(f"{f.name}.{p}", t, d, doc) for p, t, d, doc in describe(base, value)]
            continue
        rows.append((f.name, _type_name(hints[f.name]), repr(value), f.metadata.get("doc", "")))
    return rows
