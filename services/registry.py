"""The services ``k3 serve <name>`` can run: name -> where its ``ServiceSpec`` lives.

Entries are import paths, not imports, so that listing or choosing a service never loads the heavy
dependencies of the others. Adding a service is one line here plus a ``SPEC`` in its module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from k3.services.common.server import Service

SERVICES: dict[str, str] = {
    "cache": "k3.services.cache.service:SPEC",
    "prefill": "k3.services.prefill.service:SPEC",
    "decode": "k3.services.decode.service:SPEC",
    "router": "k3.services.router.service:SPEC",
    "vision": "k3.services.vision.service:SPEC",
    "experts": "k3.services.experts.service:SPEC",
    "planner": "k3.services.planner.service:SPEC",
    "rollout": "k3.services.rollout.service:SPEC",
    "trainer": "k3.services.trainer.service:SPEC",
}


@dataclass(frozen=True)
class ServiceSpec:
    """How to configure and build one service.

    ``config_type`` is a config dataclass with a ``server: ServerConfig`` section (see
    ``k3.services.common.config``); ``build`` turns a loaded config into a ``Service``.
    """

    config_type: type
    build: Callable[[Any], Service]


class UnknownServiceError(LookupError):
    def __init__(self, name: str):
        super().__init__(f"unknown service {name!r} (known: {', '.join(sorted(SERVICES))})")


def get_spec(name: str) -> ServiceSpec:
    """The spec registered as ``name``; ``UnknownServiceError`` lists the known names otherwise."""
    try:
        target = SERVICES[name]
    except KeyError:
        raise UnknownServiceError(name) from None
    module, _, attribute = target.partition(":")
    spec = getattr(importlib.import_module(module), attribute)
    if not isinstance(spec, ServiceSpec):
        raise TypeError(f"{target} is not a ServiceSpec")
    return spec
