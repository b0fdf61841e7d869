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
    params.add_argument("--preset", required=True, help="preset name (kimi-k3, bench-1b, small, tiny)")
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
