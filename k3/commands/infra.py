"""``k3 infra up|down|status``: local Redis and single-node Kafka for development and CI.

A thin front end over ``ops/infra.sh``: the shell scripts in ``ops/`` are the one implementation (CI runs
them without Python), this command finds them, passes ports through the environment and turns a missing
prerequisite (exit status 2 of a script) into one line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

COMPONENTS = ("redis", "kafka")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("infra", help="start, stop or inspect local Redis and Kafka")
    parser.add_argument("action", choices=["up", "down", "status"], help="what to do")
    # Checked in run(): argparse rejects an empty list when nargs="*" is combined with choices.
    parser.add_argument("components", nargs="*", metavar="COMPONENT", help="redis and/or kafka (default: both)")
    parser.add_argument("--redis-port", type=int, help="Redis port on 127.0.0.1 (default 16379, env K3_REDIS_PORT)")
    parser.add_argument("--kafka-port", type=int, help="Kafka port on 127.0.0.1 (default 19092, env K3_KAFKA_PORT)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from k3.cli import CLIError
    from k3.services.bus.local_broker import MISSING_PREREQUISITE, InfraError, ops_dir

    unknown = [c for c in args.components if c not in COMPONENTS]
    if unknown:
        raise CLIError(f"unknown component {unknown[0]!r}; expected one of: {', '.join(COMPONENTS)}")
    try:
        script = ops_dir() / "infra.sh"
    except InfraError as exc:
        raise CLIError(str(exc)) from None
    env = dict(os.environ)
    for name, value in (("K3_REDIS_PORT", args.redis_port), ("K3_KAFKA_PORT", args.kafka_port)):
        if value is not None:
            if not 1 <= value <= 65534:
                raise CLIError(f"--{name[3:].lower().replace('_', '-')} must be in 1..65534, got {value}")
            env[name] = str(value)
    components = list(dict.fromkeys(args.components))  # de-duplicated, order kept
    # stdout streams through (progress of a first-time download); stderr is kept for the error line.
    done = subprocess.run(
        ["bash", str(script), args.action, *components], env=env, stderr=subprocess.PIPE, text=True, check=False
    )
    if done.returncode == MISSING_PREREQUISITE:
        lines = done.stderr.strip().splitlines()
        raise CLIError(lines[-1] if lines else "a prerequisite of the local infrastructure is missing")
    if done.stderr:
        sys.stderr.write(done.stderr)
    if done.returncode != 0:
        raise CLIError(f"ops/infra.sh {args.action} failed (exit {done.returncode})")
    return 0
