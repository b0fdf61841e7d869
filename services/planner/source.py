"""Where the planner's load signals come from: PromQL instant queries against a Prometheus server.

Design decisions:

- Prometheus, not the services themselves: a Deployment has many replicas behind one Service address, and
  only Prometheus sees all of them and can sum them, take rates over a window and compute quantiles. The
  same queries work against a cluster's Prometheus and the local one ``k3 up --observe`` starts.
- Queries are generated from ``k3.services.common.metric_names`` (``signal_queries``), so a renamed metric
  cannot silently leave the planner reading nothing; a target's ``selector`` (PromQL label matchers such as
  ``job="k3-experts-0"``) picks its Deployment's series. TTFT is measured at the router, so its query is
  not narrowed by the selector.
- An empty result is "no data" (``None``), not zero: the decision rules hold on missing data. A failed or
  refused query raises ``SourceError`` and the planner skips that target for the interval.
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request

from k3.services.common import metric_names as mn
from k3.services.planner.decisions import Signals

KINDS = ("experts", "decode")
_WINDOW = re.compile(r"^[0-9]+[smh]$")
_SELECTOR = re.compile(r'^\s*$|^[a-zA-Z_][a-zA-Z0-9_]*\s*(=|!=|=~|!~)\s*"[^"]*"'
                       r'(\s*,\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(=|!=|=~|!~)\s*"[^"]*")*\s*$')


class SourceError(RuntimeError):
    """Prometheus could not be queried, or answered with an error."""


def check_selector(selector: str) -> str:
    """``selector`` if it is a comma-separated list of PromQL label matchers (``name="value"``, ...)."""
    if not _SELECTOR.match(selector):
        raise ValueError(f'must be PromQL label matchers like job="k3-decode", got {selector!r}')
    return selector.strip()


def _matchers(*parts: str) -> str:
    inner = ",".join(p for p in parts if p)
    return "{" + inner + "}" if inner else ""


def signal_queries(kind: str, selector: str = "", window: str = "1m") -> dict[str, str]:
    """PromQL per ``Signals`` field for a Deployment of ``kind`` (``experts`` or ``decode``)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not _WINDOW.match(window):
        raise ValueError(f"window must be a PromQL duration like 30s, 1m or 1h, got {window!r}")
    sel = check_selector(selector)
    if kind == "experts":
        return {
            "tokens_per_s": f"sum(rate({mn.EXPERT_ROWS.prometheus}{_matchers(sel)}[{window}]))",
            "imbalance": f"max({mn.EXPERT_IMBALANCE.prometheus}{_matchers(sel)})",
        }
    decode_tokens = _matchers(sel, 'phase="decode"')
    return {
        "tokens_per_s": f"sum(rate({mn.ENGINE_TOKENS.prometheus}{decode_tokens}[{window}]))",
        "queue_length": f"sum({mn.ENGINE_QUEUED.prometheus}{_matchers(sel)})",
        "ttft_p95_s": f"histogram_quantile(0.95, sum by (le) (rate({mn.TTFT.prometheus}_bucket[{window}])))",
    }


class PrometheusSource:
    """Instant queries against ``url`` (``http://host:9090``) through its HTTP API."""

    def __init__(self, url: str, timeout_s: float = 5.0):
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"prometheus_url must be an http(s)://host:port URL, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def query(self, expr: str) -> float | None:
        """The single value ``expr`` evaluates to now; None when the result is empty or not a number."""
        address = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        try:
            with urllib.request.urlopen(address, timeout=self.timeout_s) as answer:
                body = json.loads(answer.read())
        except urllib.error.HTTPError as exc:  # Prometheus explains bad queries in a JSON body
            try:
                detail = json.loads(exc.read()).get("error", exc.reason)
            except (ValueError, OSError):
                detail = exc.reason
            raise SourceError(f"query {expr!r} failed: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise SourceError(f"cannot query {self.url}: {exc}") from None
        if body.get("status") != "success":
            raise SourceError(f"query {expr!r} failed: {body.get('error', body)}")
        data = body["data"]
        if data["resultType"] == "scalar":
            samples = [data["result"]]
        elif data["resultType"] == "vector":
            samples = [item["value"] for item in data["result"]]
        else:
            raise SourceError(f"query {expr!r} gave a {data['resultType']}, expected a vector or scalar")
        if not samples:
            return None
        if len(samples) > 1:
            raise SourceError(f"query {expr!r} gave {len(samples)} series, expected one (aggregate it)")
        value = float(samples[0][1])
        return value if math.isfinite(value) else None

    def signals(self, queries: dict[str, str]) -> Signals:
        """``Signals`` from the queries of ``signal_queries`` (a negative value is clamped to 0)."""
        values = {}
        for name, expr in queries.items():
            value = self.query(expr)
            values[name] = None if value is None else max(value, 0.0)
        return Signals(**values)
