"""Grafana dashboards for k3, generated from the metric catalogue (``k3.services.common.metric_names``).

    python ops/dashboards/generate.py           # (re)write ops/dashboards/*.json
    python ops/dashboards/generate.py --check   # exit 1 if a checked-in file differs from what is generated

Design decisions:

- Panels name the catalogue's ``MetricName`` objects, never metric strings, so a renamed metric changes the
  dashboards (and ``--check`` fails in CI until they are regenerated) instead of leaving an empty panel.
- Queries are shaped by the instrument kind: counters as per-second rates, gauges as their values, histograms
  as p50/p95 quantiles; a few derived panels (cache hit ratio, error ratio) divide two counters.
- A ``datasource`` template variable (type prometheus) and a ``job`` variable make the dashboards work
  against any Prometheus: a cluster's or the one ``k3 up --observe`` starts. ``$__rate_interval`` adapts
  rate windows to the scrape interval.
- Output is deterministic (sorted keys, fixed ids and layout) so regenerating never produces a diff by
  itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from k3.services.common import metric_names as mn
from k3.services.common.metric_names import Kind, MetricName

OUT_DIR = Path(__file__).resolve().parent
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
JOB = 'job=~"$job"'
WIDTH, HEIGHT, COLUMNS = 12, 8, 2


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[Query, ...]
    description: str = ""


def _sel(extra: str = "") -> str:
    return "{" + ",".join(p for p in (JOB, extra) if p) + "}"


def rate(metric: MetricName, by: str = "job", extra: str = "") -> Query:
    if metric.kind is not Kind.COUNTER:
        raise ValueError(f"{metric.name} is a {metric.kind.value}, rates need a counter")
    return Query(f"sum by ({by}) (rate({metric.prometheus}{_sel(extra)}[$__rate_interval]))",
                 "{{" + by.split(",")[0].strip() + "}}")


def value(metric: MetricName, agg: str = "sum", by: str = "job") -> Query:
    if metric.kind not in (Kind.GAUGE, Kind.UP_DOWN_COUNTER):
        raise ValueError(f"{metric.name} is a {metric.kind.value}, not a gauge")
    return Query(f"{agg} by ({by}) ({metric.prometheus}{_sel()})", "{{" + by.split(",")[0].strip() + "}}")


def quantiles(metric: MetricName, qs: tuple[float, ...] = (0.5, 0.95)) -> tuple[Query, ...]:
    if metric.kind is not Kind.HISTOGRAM:
        raise ValueError(f"{metric.name} is a {metric.kind.value}, quantiles need a histogram")
    return tuple(Query(f"histogram_quantile({q}, sum by (le, job) "
                       f"(rate({metric.prometheus}_bucket{_sel()}[$__rate_interval])))",
                       f"p{round(q * 100)} {{{{job}}}}") for q in qs)


def mean(metric: MetricName) -> Query:
    if metric.kind is not Kind.HISTOGRAM:
        raise ValueError(f"{metric.name} is a {metric.kind.value}, a mean needs a histogram")
    return Query(f"sum(rate({metric.prometheus}_sum{_sel()}[$__rate_interval])) / "
                 f"sum(rate({metric.prometheus}_count{_sel()}[$__rate_interval]))", "mean")


def ratio(numerator: MetricName, denominator: MetricName, legend: str, extra: str = "") -> Query:
    return Query(f"sum(rate({numerator.prometheus}{_sel(extra)}[$__rate_interval])) / "
                 f"sum(rate({denominator.prometheus}{_sel()}[$__rate_interval]))", legend)


def panel(title: str, unit: str, *queries: Query, description: str = "") -> Panel:
    return Panel(title, unit, tuple(queries), description)


def dashboards() -> dict[str, tuple[str, list[Panel]]]:
    """file stem -> (title, panels)."""
    return {
        "k3-serving": ("k3 / serving", [
            panel("Time to first token", "s", *quantiles(mn.TTFT), description=mn.TTFT.description),
            panel("Time per output token", "s", *quantiles(mn.TPOT), description=mn.TPOT.description),
            panel("Decode queue length", "short", value(mn.ENGINE_QUEUED), description=mn.ENGINE_QUEUED.description),
            panel("Tokens per second", "short", rate(mn.ENGINE_TOKENS, by="job, phase"),
                  description=mn.ENGINE_TOKENS.description),
            panel("Prompt cache hit ratio", "percentunit",
                  ratio(mn.CACHED_PROMPT_TOKENS, mn.PROMPT_TOKENS, "cached / prompt tokens"),
                  description=mn.CACHED_PROMPT_TOKENS.description),
            panel("Cache store block hit ratio", "percentunit",
                  ratio(mn.CACHE_HIT_BLOCKS, mn.CACHE_LOOKUP_BLOCKS, "hit / looked-up blocks"),
                  description=mn.CACHE_HIT_BLOCKS.description),
            panel("Finished requests per second", "reqps", rate(mn.ROUTER_REQUESTS, by="k3_request_kind")),
            panel("Running sequences", "short", value(mn.ENGINE_RUNNING)),
            panel("Output tokens per second (router)", "short", rate(mn.COMPLETION_TOKENS, by="k3_request_kind"),
                  description=mn.COMPLETION_TOKENS.description),
        ]),
        "k3-rpc": ("k3 / gRPC", [
            panel("RPCs per second", "reqps", rate(mn.RPC_REQUESTS, by="job, rpc_method")),
            panel("RPC error ratio", "percentunit",
                  ratio(mn.RPC_REQUESTS, mn.RPC_REQUESTS, "non-OK / all", extra='rpc_grpc_status_code!="0"')),
            panel("RPC latency", "s", *quantiles(mn.RPC_DURATION)),
            panel("RPCs in flight", "short", value(mn.RPC_ACTIVE, by="job, rpc_method")),
        ]),
        "k3-experts": ("k3 / expert pools", [
            panel("Expert pool load (rows/s)", "short", rate(mn.EXPERT_ROWS, by="instance"),
                  description=mn.EXPERT_ROWS.description),
            panel("Expert load by layer (rows/s)", "short", rate(mn.EXPERT_ROWS, by="layer")),
            panel("Per-expert load (rows/s)", "short", rate(mn.EXPERT_LOAD, by="expert"),
                  description=mn.EXPERT_LOAD.description),
            panel("Expert imbalance (max/mean of per-expert rows/s)", "short",
                  Query(f"max(sum by (expert) (rate({mn.EXPERT_LOAD.prometheus}{_sel()}[$__rate_interval]))) / "
                        f"avg(sum by (expert) (rate({mn.EXPERT_LOAD.prometheus}{_sel()}[$__rate_interval])))",
                        "max/mean")),
            panel("Pool busy (autoscaling signal)", "short", value(mn.EXPERT_POOL_LOAD, agg="max", by="instance"),
                  description=mn.EXPERT_POOL_LOAD.description),
            panel("Pool imbalance (max/mean)", "short", value(mn.EXPERT_IMBALANCE, agg="max", by="instance"),
                  description=mn.EXPERT_IMBALANCE.description),
            panel("Dispatch imbalance across shards", "short",
                  value(mn.EXPERT_CLIENT_IMBALANCE, agg="max", by="instance"),
                  description=mn.EXPERT_CLIENT_IMBALANCE.description),
            panel("Replicated experts", "short", value(mn.EXPERT_REPLICAS, by="instance")),
            panel("Planner: desired replicas", "short", value(mn.PLANNER_DESIRED, agg="max", by="deployment")),
            panel("Planner: replica changes per hour", "short",
                  Query(f"sum by (deployment, direction) (increase({mn.PLANNER_SCALINGS.prometheus}{_sel()}[1h]))",
                        "{{deployment}} {{direction}}")),
        ]),
        "k3-memory": ("k3 / state and cache memory", [
            panel("KDA state memory", "bytes", value(mn.KDA_STATE_MEMORY, by="instance"),
                  description=mn.KDA_STATE_MEMORY.description),
            panel("MLA latent cache memory", "bytes", value(mn.KV_LATENT_MEMORY, by="instance"),
                  description=mn.KV_LATENT_MEMORY.description),
            panel("Free KDA state slots", "short", value(mn.ENGINE_FREE_SLOTS, agg="min", by="instance")),
            panel("Free latent pages", "short", value(mn.ENGINE_FREE_PAGES, agg="min", by="instance")),
        ]),
        "k3-rl": ("k3 / reinforcement learning", [
            panel("Reward", "short", *quantiles(mn.RL_REWARD, (0.1, 0.5, 0.9)), description=mn.RL_REWARD.description),
            panel("Mean reward", "short", mean(mn.RL_REWARD)),
            panel("Trajectory staleness (weight versions)", "short", *quantiles(mn.RL_STALENESS, (0.5, 0.9)),
                  description=mn.RL_STALENESS.description),
        ]),
    }


def render(uid: str, title: str, panels: list[Panel]) -> dict:
    """One dashboard as Grafana's JSON model."""
    items = []
    for i, p in enumerate(panels):
        items.append({
            "id": i + 1,
            "type": "timeseries",
            "title": p.title,
            "description": p.description,
            "datasource": DATASOURCE,
            "gridPos": {"h": HEIGHT, "w": WIDTH, "x": (i % COLUMNS) * WIDTH, "y": (i // COLUMNS) * HEIGHT},
            "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": [{"datasource": DATASOURCE, "expr": q.expr, "legendFormat": q.legend,
                         "refId": chr(ord("A") + j)} for j, q in enumerate(p.queries)],
        })
    return {
        "uid": uid,
        "title": title,
        "tags": ["k3"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            {"name": "job", "label": "Job", "type": "query", "datasource": DATASOURCE,
             "query": {"query": 'label_values(up{job=~"k3-.*"}, job)', "refId": "jobs"},
             "definition": 'label_values(up{job=~"k3-.*"}, job)', "includeAll": True, "multi": True,
             "allValue": "k3-.*", "current": {"text": "All", "value": "$__all"}, "refresh": 2, "hide": 0},
        ]},
        "panels": items,
    }


def generate() -> dict[str, str]:
    """file name -> JSON text."""
    return {f"{uid}.json": json.dumps(render(uid, title, panels), indent=2, sort_keys=True) + "\n"
            for uid, (title, panels) in dashboards().items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the files in ops/dashboards")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output folder (default: ops/dashboards)")
    args = parser.parse_args(argv)
    stale = []
    for name, text in generate().items():
        path = args.out / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date: {', '.join(stale)} (run python ops/dashboards/generate.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
