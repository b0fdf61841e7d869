"""``k3 experts stats`` (load of expert pools) and ``k3 experts pools`` (the pool set workers follow).

``k3 experts stats --pool ADDR [--pool ...] [--json]``: the ``PoolStats`` of each pool.

Prints, per pool, its shard, rows computed, Compute calls, replicas and the imbalance over its home experts,
then the imbalance across pools, the rows of every expert (all layers and pools together) and the imbalance
across experts. ``--json`` prints the same report as one JSON document. A pool that does not answer within
``--timeout`` is an error naming it (the report would be misleading without it).

``k3 experts pools --file FILE [--add ADDR]... [--remove ADDR]... [--set ADDR...]``: prints the pool set
file's pools after applying the changes (``--set`` replaces the whole list; then removals, then additions).
The file is replaced atomically; workers that follow it (``model.expert_pools_file``, as under ``k3 up
--expert-pools N``) apply the change within their watch interval. Removing the last pool is refused: the
workers would have nowhere to compute their experts.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("experts", help="inspect expert pools (k3 serve experts)")
    actions = parser.add_subparsers(dest="experts_command", metavar="ACTION", required=True)
    stats = actions.add_parser("stats", help="per-expert and per-pool load, imbalance and replicas")
    stats.add_argument("--pool", action="append", required=True, metavar="ADDR",
                       help="host:port of an expert pool (repeat for several)")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for each pool (default 5)")
    stats.set_defaults(func=run_stats)
    pools = actions.add_parser("pools", help="show or change the pool set file that prefill/decode workers follow")
    pools.add_argument("--file", required=True, metavar="FILE", help="the pool set file (k3 up prints its path)")
    pools.add_argument("--add", action="append", default=[], metavar="ADDR", help="add host:port (repeatable)")
    pools.add_argument("--remove", action="append", default=[], metavar="ADDR",
                       help="remove host:port (repeatable)")
    pools.add_argument("--set", nargs="+", metavar="ADDR", help="replace the whole list")
    pools.set_defaults(func=run_pools)


def run_pools(args: argparse.Namespace) -> int:
    from k3.cli import CLIError
    from k3.services.experts.pool_set import PoolSetError, check_addresses, read_pool_set, write_pool_set

    try:
        current = read_pool_set(args.file)
        pools = check_addresses(args.set, "--set") if args.set is not None else list(current)
        for address in args.remove:
            if address not in pools:
                raise CLIError(f"--remove {address}: not in the pool set ({', '.join(pools) or 'empty'})")
            pools.remove(address)
        pools += [a for a in check_addresses(args.add, "--add") if a not in pools]
        if not pools:
            raise CLIError("the pool set would be empty; keep at least one pool")
        if pools != current:
            write_pool_set(args.file, pools)
    except PoolSetError as exc:
        raise CLIError(str(exc)) from None
    print(json.dumps({"pools": pools}))
    return 0


def run_stats(args: argparse.Namespace) -> int:
    import grpc

    from k3.cli import CLIError
    from k3.protos.v1 import experts_pb2, experts_pb2_grpc
    from k3.services.common.client import make_channel
    from k3.services.experts.stats import cluster_report, format_report

    if not args.timeout > 0:
        raise CLIError(f"--timeout must be > 0, got {args.timeout}")
    answers = []
    for address in dict.fromkeys(args.pool):
        with make_channel(address) as channel:
            try:
                stats = experts_pb2_grpc.ExpertPoolStub(channel).PoolStats(
                    experts_pb2.PoolStatsRequest(), timeout=args.timeout)
            except grpc.RpcError as exc:
                raise CLIError(f"expert pool {address}: {exc.code().name}: {exc.details()}") from None
        answers.append((address, stats))
    report = cluster_report(answers)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
