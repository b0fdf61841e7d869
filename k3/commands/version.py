"""``k3 version``: the installed k3 version and the versions of the engines it stands on."""

from __future__ import annotations

import argparse
import json
from importlib.metadata import PackageNotFoundError, version

COMPONENTS = ["grpcio", "protobuf", "torch", "triton", "ray", "redis", "kafka-python", "opentelemetry-sdk"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("version", help="print the k3 version (and components with --all)")
    parser.add_argument("--all", action="store_true", help="also list the versions of key dependencies")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def _installed(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def run(args: argparse.Namespace) -> int:
    from k3 import __version__

    info = {"k3": __version__}
    if args.all:
        info.update({name: _installed(name) for name in COMPONENTS})
    if args.json:
        print(json.dumps(info))
    elif args.all:
        for name, value in info.items():
            print(f"{name:<16} {value or 'not installed'}")
    else:
        print(f"k3 {__version__}")
    return 0
