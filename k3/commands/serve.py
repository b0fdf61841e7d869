"""``k3 serve <service>``: run one k3 gRPC service in the foreground until SIGTERM/SIGINT.

The service's config comes from ``--config`` (YAML/JSON), ``K3_<SECTION>_<FIELD>`` environment variables
and ``--host``/``--port`` (highest precedence). Once serving, one line ``k3 serve: <service> listening on
<host>:<port>`` goes to stdout, so scripts starting it with ``--port 0`` learn the bound port.
"""

from __future__ import annotations

import argparse
import logging


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run one gRPC service (cache, ...) until SIGTERM")
    parser.add_argument("service", help="service to run (see k3.services.registry)")
    parser.add_argument("--config", metavar="FILE", help="YAML or JSON config file")
    parser.add_argument("--host", help="interface to bind (overrides server.host)")
    parser.add_argument("--port", type=int, help="port to bind, 0 = any free port (overrides server.port)")
    parser.add_argument("--shard", metavar="I/N", help="experts only: host shard I of N (overrides shard)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from k3.cli import CLIError
    from k3.services import registry
    from k3.services.common.config import ConfigError, load_config
    from k3.services.common.server import BindError, run_server

    try:
        spec = registry.get_spec(args.service)
    except registry.UnknownServiceError as exc:
        raise CLIError(str(exc)) from None
    try:
        config = load_config(spec.config_type, args.config, overrides={
            "server.host": args.host, "server.port": args.port, "shard": args.shard})
    except ConfigError as exc:
        raise CLIError(f"config: {exc}") from None
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        service = spec.build(config)
    except (ValueError, OSError) as exc:
        raise CLIError(f"cannot start {args.service}: {exc}") from None

    def announce(handle) -> None:
        print(f"k3 serve: {args.service} listening on {handle.address}", flush=True)

    try:
        return run_server(service, config.server, on_started=announce)
    except BindError as exc:
        raise CLIError(str(exc)) from None
