"""The ``k3`` command line.

Each capability lives in its own module under ``k3.commands`` and registers its subcommand through
``register(subparsers)``; modules are imported lazily only when their command runs would cost startup time,
so ``k3 --help`` stays fast and never imports torch. Errors meant for users are raised as ``CLIError`` and
printed as one line with exit status 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Order is the order of ``k3 --help``. Each entry is a module exposing ``register(subparsers)``.
COMMAND_MODULES = [
    "k3.commands.version",
    "k3.commands.model",
    "k3.commands.infra",
    "k3.commands.serve",
    "k3.commands.experts",
    "k3.commands.up",
    "k3.commands.chat",
    "k3.commands.bench",
    "k3.commands.tokenizer",
    "k3.commands.train",
    "k3.commands.sft",
    "k3.commands.jobs",
]


class CLIError(Exception):
    """An error to show the user as one line (exit status 2)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k3",
        description="Train, RL-post-train and serve Kimi K3 architecture models as gRPC services.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        result = args.func(args)
    except CLIError as exc:
        print(f"k3: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
