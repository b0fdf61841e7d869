"""Load statistics of expert pools: imbalance, and the cluster view built from several ``PoolStats`` answers.

Imbalance is max/mean (1.0 = perfectly even; 0.0 when nothing was computed yet): the slowest pool (or the
busiest expert) sets the pace of every MoE step, so max/mean is the factor by which a step is slower than
a perfectly balanced one.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from k3.protos.v1 import experts_pb2


def imbalance(values: Iterable[float]) -> float:
    """max/mean of ``values``; 0.0 when they are empty or all zero."""
    values = list(values)
    total = sum(values)
    if not values or total <= 0:
        return 0.0
    return max(values) / (total / len(values))


class BusyMeter:
    """How many calls were in progress on average over the last ``window_s`` seconds (thread-safe).

    This is a pool's load as its autoscaler sees it (``k3_expert_pool_load``): 0 when idle, 1 when one Compute
    was always running, above 1 when calls overlapped. It is the time integral of the in-flight count over
    the window (over the process's age while that is shorter), kept as the change points of that count, so
    it is exact rather than sampled; change points older than the window are dropped.
    """

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._start = clock()
        self._level = 0
        self._changes: deque[tuple[float, int]] = deque([(self._start, 0)])
        """(time, in-flight count from then on); the first entry is at or before the window's start."""

    def enter(self) -> None:
        self._change(+1)

    def exit(self) -> None:
        self._change(-1)

    def _change(self, delta: int) -> None:
        with self._lock:
            self._level += delta
            now = self._clock()
            self._changes.append((now, self._level))
            self._prune(now)

    def _prune(self, now: float) -> None:
        cutoff = now - self.window_s
        while len(self._changes) > 1 and self._changes[1][0] <= cutoff:
            self._changes.popleft()

    def load(self) -> float:
        """Average in-flight calls over the last ``window_s`` (or since creation, if that is shorter)."""
        with self._lock:
            now = self._clock()
            self._prune(now)
            begin = max(now - self.window_s, self._start)
            if now <= begin:
                return float(self._level)
            area = 0.0
            points = list(self._changes)
            for (t, level), (t_next, _) in zip(points, [*points[1:], (now, 0)], strict=True):
                area += level * max(0.0, min(t_next, now) - max(t, begin))
            return area / (now - begin)


def cluster_report(pools: Sequence[tuple[str, experts_pb2.PoolStatsResponse]]) -> dict[str, Any]:
    """A JSON-ready summary of pools: per pool (shard, rows, requests, replicas, own imbalance), imbalance
    across pools, per-expert load summed over pools and layers, and the imbalance across experts."""
    per_expert: dict[int, int] = {}
    rows = []
    for address, stats in pools:
        for load in stats.loads:
            per_expert[load.expert] = per_expert.get(load.expert, 0) + load.rows
        rows.append({
            "address": address,
            "shard": stats.shard,
            "rows": stats.rows,
            "requests": stats.requests,
            "replicas": stats.replicas,
            "replica_experts": sorted({f"{load.layer}:{load.expert}" for load in stats.loads if load.replica}),
            "imbalance": round(stats.imbalance, 4),
        })
    num_experts = max((stats.num_experts for _, stats in pools), default=0)
    expert_rows = [per_expert.get(e, 0) for e in range(num_experts)]
    return {
        "pools": rows,
        "pool_imbalance": round(imbalance(r["rows"] for r in rows), 4),
        "expert_rows": expert_rows,
        "expert_imbalance": round(imbalance(expert_rows), 4),
        "replicas": sum(r["replicas"] for r in rows),
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as an aligned text table plus summary lines."""
    lines = [f"{'pool':<24} {'shard':>6} {'rows':>10} {'requests':>9} {'replicas':>9} {'imbalance':>10}"]
    for row in report["pools"]:
        lines.append(f"{row['address']:<24} {row['shard']:>6} {row['rows']:>10} {row['requests']:>9} "
                     f"{row['replicas']:>9} {row['imbalance']:>10.3f}")
    lines.append(f"pool imbalance (max/mean rows): {report['pool_imbalance']:.3f}")
    lines.append(f"expert imbalance (max/mean rows): {report['expert_imbalance']:.3f}")
    lines.append("rows per expert: " + " ".join(f"{e}:{n}" for e, n in enumerate(report["expert_rows"])))
    lines.append(f"replicas: {report['replicas']}")
    return "\n".join(lines)
