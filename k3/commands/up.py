"""``k3 up``: run the serving platform on this machine — cache, prefill, decode and router processes.

    k3 up --checkpoint runs/demo          # a trained model
    k3 up --preset tiny                   # a preset with random weights (tests, smoke runs)
    k3 up --config k3-up.yaml             # sections cache/prefill/decode/router/experts (+ up) with any settings
    k3 up --preset tiny --expert-pools 2  # routed experts on 2 expert pools (k3 serve experts --shard i/2)

The logs of all services appear in one stream, each line prefixed with the service's name. Once every
service is healthy, one line ``k3 up: router listening on HOST:PORT`` says where clients connect (``k3 chat
--router HOST:PORT``). Ctrl-C or SIGTERM stops everything cleanly (exit status 0); if a service dies,
the others are stopped and the exit status is 1. See ``k3.services.launcher`` for the details.

``--expert-pools N`` starts N expert pools and points prefill and decode at them through a pool set file
(printed at start); ``k3 experts pools --file FILE --add HOST:PORT --remove HOST:PORT`` changes the pool set
while the platform serves (see ``k3.services.launcher``).

``--observe`` also starts a local Prometheus (``k3.services.observe``) scraping every service's metrics
port and prints its URL and what to open there.
"""

from __future__ import annotations

import argparse
import signal
import threading


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="run cache, prefill, decode and router together until Ctrl-C")
    parser.add_argument("--checkpoint", metavar="DIR", help="trained checkpoint or run folder to serve")
    parser.add_argument("--preset", help="serve a preset with random weights instead (tiny, small, ...)")
    parser.add_argument("--config", metavar="FILE", help="YAML/JSON with sections cache, prefill, decode, router, up")
    parser.add_argument("--host", help="interface every service binds (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="router port (default 50051; 0 = any free port)")
    parser.add_argument("--startup-timeout", type=float, help="seconds each service may take to start")
    parser.add_argument("--stop-grace", type=float, help="seconds to wait after SIGTERM before killing")
    parser.add_argument("--expert-pools", type=int, metavar="N",
                        help="start N expert pools (shards 0/N..N-1/N) computing the routed experts (default 0)")
    parser.add_argument("--expert-pool-file", metavar="FILE",
                        help="where to write the pool set file that workers follow (default: a temporary folder)")
    parser.add_argument("--observe", action="store_true",
                        help="also run a local Prometheus scraping every service (Debian package prometheus)")
    parser.add_argument("--prometheus-port", type=int, default=9090,
                        help="with --observe: Prometheus' port (default 9090; 0 = any free port)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from k3.cli import CLIError
    from k3.services.common.config import ConfigError
    from k3.services.launcher import LaunchConfig, Launcher, LaunchError, model_section

    try:
        config = LaunchConfig.from_file(
            args.config, checkpoint=args.checkpoint, preset=args.preset, host=args.host, router_port=args.port,
            startup_timeout=args.startup_timeout, stop_grace=args.stop_grace, expert_pools=args.expert_pools,
            expert_pool_file=args.expert_pool_file,
        )
        has_model = model_section(config) is not None or "model" in config.services.get("prefill", {})
    except (ConfigError, LaunchError) as exc:
        raise CLIError(f"config: {exc}") from None
    if not has_model:
        raise CLIError("nothing to serve: give --checkpoint DIR, --preset NAME, or a model in the config's "
                       "prefill section")

    observer = start_observer(config, args) if args.observe else None  # --observe
    stop = threading.Event()

    def request_stop(signum, frame) -> None:  # main thread, between bytecodes: only set a flag
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        launcher = Launcher(config, stop_requested=stop)
        try:
            address = launcher.start()
        except LaunchError as exc:
            if stop.is_set():
                launcher.emit("k3 up: stopped during start-up")
                return 0
            raise CLIError(str(exc)) from None
        launcher.emit(f"k3 up: router listening on {address}")
        launcher.emit(f"k3 up: all services ready; try: k3 chat --router {address}   (Ctrl-C stops everything)")
        for line in observer.where_to_look() if observer is not None else ():
            launcher.emit(f"k3 up: {line}")
        return launcher.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if observer is not None:
            observer.stop()


def start_observer(config, args: argparse.Namespace):
    """``--observe``: metrics ports for every service and a running local Prometheus (k3.services.observe)."""
    from k3.cli import CLIError
    from k3.services.observe import ObserveConfig, ObserveError, observe_launch

    try:
        observer = observe_launch(config, ObserveConfig(host=config.host, port=args.prometheus_port))
        observer.start()
    except (ObserveError, ValueError) as exc:
        raise CLIError(f"--observe: {exc}") from None
    return observer
