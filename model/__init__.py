"""``k3.model``: the Kimi K3 architecture in PyTorch, shared by every service (training, prefill, decode).

A flat list of exports, one import line per module.
"""

from k3.model.attnres import AttnResMixer, aggregate  # noqa: F401
from k3.model.balancing import (  # noqa: F401
    RoutingStats,
    deepseek_sign_update,
    quantile_balance_bias,
    quantile_balance_bias_distributed,
    routing_stats,
    skewed_router_scores,
)
from k3.model.config import K3Config  # noqa: F401
from k3.model.generate import Generation, generate, sample_next  # noqa: F401
from k3.model.kda import KDAState, KimiDeltaAttention, ShortConv  # noqa: F401
from k3.model.mla import GatedMLA, MLACache  # noqa: F401
from k3.model.moe import LatentMoE  # noqa: F401
from k3.model.moonep import moonep_plan  # noqa: F401
from k3.model.muon import PerHeadMuon, newton_schulz  # noqa: F401
from k3.model.norm import RMSNorm, rms_norm  # noqa: F401
from k3.model.params import count_params  # noqa: F401
from k3.model.presets import PRESETS, get_preset  # noqa: F401
from k3.model.situ import SiTUGLU, situ_glu  # noqa: F401
from k3.model.state import SequenceState  # noqa: F401
from k3.model.transformer import K3Model, lm_loss, next_token_labels  # noqa: F401
from k3.model.vision import VisionConfig, VisionEncoder, get_vision_preset  # noqa: F401
