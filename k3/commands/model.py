"""``k3 model``: inspect model configurations.

``k3 model params --preset NAME [--json]`` counts total and active parameters of a preset on the meta device
(no weights are allocated, so even the 2.8 T-parameter released configuration is counted in seconds). The
convention (what "active" excludes) is documented in ``k3.model.params``.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="inspect model configurations (parameter counts)")
    commands = parser.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)
    params = commands.add_parser("params", help="count total and active parameters of a preset")
    params.add_argument("--preset", required=True,
                        help="preset name (kimi-k3, bench-1b, small, tiny; vision: moonvit-v2, vit-tiny)")
    params.add_argument("--json", action="store_true", help='print {"total": int, "active": int}')
    params.set_defaults(func=run_params)


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return str(n)


def run_params(args: argparse.Namespace) -> int:
    from k3.cli import CLIError
    from k3.model.params import param_breakdown
    from k3.model.presets import PRESETS, get_preset
    from k3.model.vision.config import VISION_PRESETS

    if args.preset in VISION_PRESETS:
        return _vision_params(args)
    if args.preset not in PRESETS:
        raise CLIError(f"unknown preset {args.preset!r}; choose one of: {', '.join(PRESETS)}")
    cfg = get_preset(args.preset)
    breakdown = param_breakdown(cfg)
    summary = breakdown["summary"]
    if args.json:
        print(json.dumps({"total": summary["total"], "active": summary["active"]}))
        return 0
    print(f"preset {args.preset}: {cfg.num_layers} layers, d {cfg.hidden_size}, "
          f"{cfg.num_experts} experts top-{cfg.top_k}")
    print(f"{'component':<20} {'parameters':>18} {'':>10}")
    for name, count in breakdown["parts"].items():
        print(f"{name:<20} {count:>18,} {_human(count):>10}")
    print(f"{'total':<20} {summary['total']:>18,} {_human(summary['total']):>10}")
    print(f"{'active per token':<20} {summary['active']:>18,} {_human(summary['active']):>10}")
    print("active = total - input embedding - routed experts not selected (top_k of num_experts)")
    return 0


def _vision_params(args: argparse.Namespace) -> int:
    """Vision encoder presets: tower (the quoted encoder size) and projector, counted on the meta device."""
    from k3.model.vision.config import get_vision_preset
    from k3.model.vision.params import vision_param_breakdown

    cfg = get_vision_preset(args.preset)
    breakdown = vision_param_breakdown(cfg)
    summary = breakdown["summary"]
    if args.json:  # the encoder is dense: every parameter is active
        print(json.dumps({"total": summary["total"], "active": summary["total"], "tower": summary["tower"],
                          "projector": summary["projector"]}))
        return 0
    print(f"vision preset {args.preset}: {cfg.num_layers} layers, d {cfg.hidden_size}, MLP "
          f"{cfg.intermediate_size}, {cfg.num_heads} heads, patch {cfg.patch_size}, "
          f"{cfg.merge_size}x{cfg.merge_size} merge -> LM width {cfg.lm_hidden_size}")
    print(f"{'component':<20} {'parameters':>18} {'':>10}")
    for name, count in breakdown["parts"].items():
        print(f"{name:<20} {count:>18,} {_human(count):>10}")
    for name in ("tower", "total"):
        print(f"{name:<20} {summary[name]:>18,} {_human(summary[name]):>10}")
    print("tower = patch embedding + blocks + final norm (the encoder size); total adds the projector")
    return 0
