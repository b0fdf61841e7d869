"""``k3 bench``: measure the serving path.

- ``k3 bench trace --trace FILE [--capacity-blocks N]`` replays a Mooncake-format JSONL trace against a
  prefix-cache index (``k3.services.router.trace``) and prints one JSON object: block hit ratio, tokens,
  input cost with and without the cache at the launch prices (configurable). No server is needed.
- ``k3 bench serve --router HOST:PORT --concurrency N --requests M`` sends streaming Generate requests
  (``k3.services.router.loadtest``) and prints one JSON object: TTFT/TPOT percentiles, throughput, errors.

Both print only the JSON on stdout, so the output can be piped into other tools.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="replay cache traces, load-test a router")
    commands = parser.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)

    trace = commands.add_parser("trace", help="replay a Mooncake-format trace against a prefix cache index")
    trace.add_argument("--trace", required=True, metavar="FILE", help="JSONL trace (timestamp, input_length, "
                       "output_length, hash_ids)")
    trace.add_argument("--capacity-blocks", type=int, metavar="N", help="LRU capacity in blocks (default: unbounded)")
    trace.add_argument("--price-hit", type=float, default=0.30, help="USD per million cache-hit input tokens")
    trace.add_argument("--price-miss", type=float, default=3.00, help="USD per million cache-miss input tokens")
    trace.add_argument("--price-output", type=float, default=15.00, help="USD per million output tokens")
    trace.set_defaults(func=run_trace)

    serve = commands.add_parser("serve", help="concurrent streaming requests against a router")
    serve.add_argument("--router", default="127.0.0.1:50051", metavar="HOST:PORT")
    serve.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    serve.add_argument("--requests", type=int, default=32, help="requests in total")
    serve.add_argument("--prompt-chars", type=int, default=2000, help="prompt length in characters")
    serve.add_argument("--shared-prefix-chars", type=int, default=1000, help="prefix shared by every prompt")
    serve.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    serve.add_argument("--temperature", type=float, default=0.0)
    serve.add_argument("--seed", type=int, default=0, help="seed of the prompt generator")
    serve.add_argument("--timeout", type=float, default=300.0, help="deadline of each request, seconds")
    serve.set_defaults(func=run_serve)


def run_trace(args: argparse.Namespace) -> int:
    from k3.cli import CLIError
    from k3.services.common.config import ConfigError
    from k3.services.router.config import PricesConfig
    from k3.services.router.trace import TraceError, read_trace, replay

    if args.capacity_blocks is not None and args.capacity_blocks < 1:
        raise CLIError(f"--capacity-blocks must be >= 1, got {args.capacity_blocks}")
    try:
        prices = PricesConfig(cache_hit_input=args.price_hit, cache_miss_input=args.price_miss,
                              output=args.price_output)
    except ConfigError as exc:
        flag = {"cache_hit_input": "--price-hit", "cache_miss_input": "--price-miss"}.get(exc.field, "--price-output")
        raise CLIError(f"{flag}: {exc.reason}") from None
    try:
        with open(args.trace, encoding="utf-8") as f:
            result = replay(read_trace(f), args.capacity_blocks)
    except OSError as exc:
        raise CLIError(f"cannot read trace {args.trace}: {exc.strerror}") from None
    except TraceError as exc:
        raise CLIError(f"{args.trace}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise CLIError(f"{args.trace}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    print(json.dumps(result.report(prices), indent=2))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from k3.cli import CLIError
    from k3.services.router.loadtest import LoadConfig, run_load

    try:
        config = LoadConfig(
            router=args.router, concurrency=args.concurrency, requests=args.requests, prompt_chars=args.prompt_chars,
            shared_prefix_chars=args.shared_prefix_chars, max_tokens=args.max_tokens, temperature=args.temperature,
            seed=args.seed, timeout_seconds=args.timeout,
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    print(json.dumps(run_load(config), indent=2))
    return 0
