"""``k3.services.engine``: the inference engine shared by the prefill and decode workers and RL rollout workers.

``engine`` is the continuous-batching scheduler over ``slots`` (fixed-size KDA + conv states) and ``pages``
(the paged MLA latent cache); ``sampling`` and ``detokenize`` turn logits into tokens and text; ``stream``
carries the results back. ``blocks`` is the cache-store format of checkpoints (shared by prefill and decode),
``handoff`` the chunked state transfer between them and ``model_source`` the ``model`` config section that
loads the model a worker serves.
"""

from k3.services.engine.config import EngineConfig
from k3.services.engine.engine import Engine
from k3.services.engine.errors import (
    AlreadyExists,
    EngineClosed,
    PagesExhausted,
    QueueFull,
    RequestCancelled,
    SlotsExhausted,
    UnknownRequest,
)
from k3.services.engine.metrics import EngineStats
from k3.services.engine.sampling import SamplingOptions
from k3.services.engine.stream import Completion, RequestStream, TokenEvent, Usage

__all__ = [
    "AlreadyExists",
    "Completion",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineStats",
    "PagesExhausted",
    "QueueFull",
    "RequestCancelled",
    "RequestStream",
    "SamplingOptions",
    "SlotsExhausted",
    "TokenEvent",
    "UnknownRequest",
    "Usage",
]
