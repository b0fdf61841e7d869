"""``k3.services.engine``: the inference engine shared by the prefill and decode workers and RL rollout workers.

``engine`` is the continuous-batching scheduler over ``slots`` (fixed-size KDA + conv states) and ``pages``
(the paged MLA latent cache); ``sampling`` and ``detokenize`` turn logits into tokens and text; ``stream``
carries the results back. ``blocks`` is the cache-store format of checkpoints (shared by prefill and decode),
``handoff`` the chunked state transfer between them and ``model_source`` the ``model`` config section that
loads the model a worker serves.

The public names below are loaded on first use (PEP 562), not when the package is imported: ``engine`` and
``metrics`` pull in OpenTelemetry, and the GPU benchmarks that only need ``pages`` and ``slots`` must run on
machines that have torch and Triton but not the serving stack.
"""

from __future__ import annotations

import importlib

# Public name -> submodule that defines it.
_EXPORTS = {
    "AlreadyExists": "errors",
    "Completion": "stream",
    "Engine": "engine",
    "EngineClosed": "errors",
    "EngineConfig": "config",
    "EngineStats": "metrics",
    "PagesExhausted": "errors",
    "QueueFull": "errors",
    "RequestCancelled": "errors",
    "RequestStream": "stream",
    "SamplingOptions": "sampling",
    "SlotsExhausted": "errors",
    "TokenEvent": "stream",
    "UnknownRequest": "errors",
    "Usage": "stream",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
