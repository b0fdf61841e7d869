"""The ``model`` section of a serving worker's config: which model to serve and how to load it (once, at start).

Either a trained ``checkpoint`` (a checkpoint folder or a run folder; its tokenizer comes with it) or a
``preset`` with random weights drawn from ``seed`` -- for tests, benchmarks and trying the platform without
a trained model. Seeded weights are drawn from a private RNG state (``torch.random.fork_rng``), so loading a
model never disturbs the process's global random state and two workers with the same preset and seed hold
bit-identical weights, which is what lets a prefill and a decode worker share states.

With ``expert_pools`` set, every MoE layer computes its routed experts on those expert pools
(``k3 serve experts``) through one ``ExpertPoolClient`` (``model.expert_pool_client``) instead of locally;
the pools must serve the same model (checkpoint, or preset and seed). With ``expert_pools_file`` instead, the
pool set is read from that file and followed while serving (``k3.services.experts.pool_set``: an edit adds or
removes pools at runtime, no restart). ``expert_pool_client`` holds the client's deadlines and retries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from k3.services.common.config import ConfigError, documented
from k3.services.experts.client import PoolClientConfig

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelSourceConfig:
    """Which model a worker serves."""

    checkpoint: str | None = documented(
        None, doc="Trained checkpoint folder (or run folder: its latest checkpoint); exclusive with preset."
    )
    preset: str | None = documented(
        None, doc="Model preset (k3.model.presets) with random weights from seed; exclusive with checkpoint."
    )
    seed: int = documented(0, doc="Seed of a preset model's random weights.")
    dtype: str = documented("float32", doc=f"Parameter dtype: one of {', '.join(DTYPES)}.")
    device: str = documented("cpu", doc="torch device to run on, e.g. cpu or cuda:0.")
    tokenizer: str | None = documented(
        None,
        doc="Tokenizer for text output and stop strings: 'byte', or a saved tokenizer folder. "
        "Default: the checkpoint's own; none for a preset (token ids only).",
    )
    expert_pools: list[str] = documented(
        default_factory=list,
        doc="host:port of expert pools (k3 serve experts) computing the routed experts; empty = local experts.",
    )
    expert_pools_file: str | None = documented(
        None, doc="JSON file {\"pools\": [host:port, ...]} naming the expert pools, watched for changes while "
        "serving (k3 up writes it; k3 experts pools edits it); exclusive with expert_pools.",
    )
    expert_pool_client: PoolClientConfig = documented(
        default_factory=PoolClientConfig,
        doc="Deadlines, retries, replanning and file-watch interval of the expert pool client.",
    )

    def __post_init__(self) -> None:
        if self.checkpoint is not None and self.preset is not None:
            raise ConfigError("set either checkpoint or preset, not both", field="preset")
        if self.preset is not None:
            from k3.model.presets import PRESETS

            if self.preset not in PRESETS:
                raise ConfigError(f"unknown preset {self.preset!r} (known: {', '.join(PRESETS)})", field="preset")
        if self.dtype not in DTYPES:
            raise ConfigError(f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}", field="dtype")
        if self.seed < 0:
            raise ConfigError(f"must be >= 0, got {self.seed}", field="seed")
        for i, address in enumerate(self.expert_pools):
            if not address.strip():
                raise ConfigError("must not be blank", field=f"expert_pools[{i}]")
        if self.expert_pools and self.expert_pools_file is not None:
            raise ConfigError("set either expert_pools or expert_pools_file, not both", field="expert_pools_file")

    def load(self, *, server_config=None, telemetry=None) -> tuple[Any, Any]:
        """``(model in eval mode, tokenizer or None)``; ``ValueError`` if no model is configured.

        ``server_config`` and ``telemetry`` are the serving process's: the expert pool client's channels carry
        its bearer token and message limits, and its calls join the trace of the request being computed."""
        from k3.model.presets import get_preset
        from k3.model.transformer import K3Model

        dtype = getattr(torch, self.dtype)
        tokenizer = None
        if self.checkpoint is not None:
            from k3.model.checkpoint import load_model

            model, _, tokenizer = load_model(self.checkpoint, device=self.device)
        elif self.preset is not None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                model = K3Model(get_preset(self.preset))
            model = model.to(self.device)
        else:
            raise ValueError("model: set model.checkpoint (a trained checkpoint) or model.preset (random weights "
                             "from model.seed)")
        if self.tokenizer is not None:
            tokenizer = load_tokenizer(self.tokenizer)
        model = model.to(dtype).eval()
        if self.expert_pools or self.expert_pools_file is not None:
            from k3.services.experts.client import attach_pools

            attach_pools(model, self.expert_pools, self.expert_pool_client, pool_file=self.expert_pools_file,
                         server_config=server_config, telemetry=telemetry)
        return model, tokenizer


def load_tokenizer(spec: str):
    """``'byte'`` -> ``ByteTokenizer``; anything else is a saved tokenizer folder."""
    from k3.model.tokenizer import ByteTokenizer
    from k3.model.tokenizer import load_tokenizer as load_saved

    return ByteTokenizer() if spec == "byte" else load_saved(spec)
