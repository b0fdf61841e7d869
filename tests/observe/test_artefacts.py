"""The checked-in telemetry artefacts: Grafana dashboards, collector config, Prometheus rules and config.

promtool (Debian package ``prometheus``) checks and unit-tests the alert rules; without it these tests fail
when CI is set and are skipped otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from k3.services.common import metric_names as mn

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
DASHBOARDS = REPO / "ops" / "dashboards"
PROMETHEUS = REPO / "ops" / "prometheus"
METRIC_TOKEN = re.compile(r"\b(?:k3|rpc)_[a-zA-Z0-9_]+\b")
# Label names that look like metric names (attributes named rpc.* or k3.*), as Prometheus spells them.
LABELS = {label.replace(".", "_") for metric in mn.catalogue() for label in metric.labels}


def load_generator():
    spec = importlib.util.spec_from_file_location("k3_dashboards_generate", DASHBOARDS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def metrics_in(expr: str) -> set[str]:
    return set(METRIC_TOKEN.findall(expr)) - LABELS


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        reason = "promtool not found (apt-get install -y prometheus)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; CI must check the alert rules")
        pytest.skip(reason)
    return path


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def test_checked_in_dashboards_are_what_the_generator_writes():
    generator = load_generator()
    generated = generator.generate()
    assert sorted(generated) == [p.name for p in dashboard_files()]
    result = subprocess.run([sys.executable, str(DASHBOARDS / "generate.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_check_mode_reports_a_stale_dashboard(tmp_path):
    generator = load_generator()
    for name, text in generator.generate().items():
        (tmp_path / name).write_text(text)
    (tmp_path / "k3-rl.json").write_text("{}")
    assert generator.main(["--check", "--out", str(tmp_path)]) == 1
    assert generator.main(["--out", str(tmp_path)]) == 0
    assert generator.main(["--check", "--out", str(tmp_path)]) == 0


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.stem)
def test_dashboard_json_model_basics(path):
    board = json.loads(path.read_text())
    assert board["uid"] == path.stem and board["title"].startswith("k3 / ")
    assert isinstance(board["schemaVersion"], int)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = board["panels"]
    assert panels, "a dashboard without panels"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids {ids}"
    cells = set()
    for panel in panels:
        assert panel["type"] == "timeseries" and panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["w"] > 0 and grid["h"] > 0
        assert (grid["x"], grid["y"]) not in cells, f"panels overlap at {grid}"
        cells.add((grid["x"], grid["y"]))
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        targets = panel["targets"]
        assert targets, f"panel {panel['title']!r} has no queries"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids))
        for target in targets:
            known = mn.by_prometheus_name()
            used = metrics_in(target["expr"])
            assert used, f"{panel['title']}: query names no k3 metric: {target['expr']}"
            assert used <= set(known), f"{panel['title']}: unknown metric(s) {used - set(known)}"
            assert target["expr"].count("(") == target["expr"].count(")")
            assert 'job=~"$job"' in target["expr"]


def test_dashboards_cover_the_catalogue():
    shown = set()
    for path in dashboard_files():
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                shown |= {mn.by_prometheus_name()[m].name for m in metrics_in(target["expr"])}
    expected = {m.name for m in mn.catalogue()}
    assert shown == expected, f"not on any dashboard: {sorted(expected - shown)}"


def test_generator_rejects_a_query_of_the_wrong_kind():
    generator = load_generator()
    with pytest.raises(ValueError, match=r"k3\.engine\.queued is a gauge, rates need a counter"):
        generator.rate(mn.ENGINE_QUEUED)
    with pytest.raises(ValueError, match=r"k3\.engine\.tokens is a counter, quantiles need a histogram"):
        generator.quantiles(mn.ENGINE_TOKENS)


def test_collector_config_wires_otlp_through_batch_to_prometheus_and_debug():
    config = yaml.safe_load((REPO / "ops" / "otel" / "collector.yaml").read_text())
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    pipelines = config["service"]["pipelines"]
    assert pipelines["metrics"] == {"receivers": ["otlp"], "processors": ["memory_limiter", "batch"],
                                    "exporters": ["prometheus", "debug"]}
    assert pipelines["traces"]["receivers"] == ["otlp"] and "batch" in pipelines["traces"]["processors"]
    for pipeline in pipelines.values():
        for section in ("receivers", "processors", "exporters"):
            for name in pipeline[section]:
                assert name in config[section], f"pipeline uses undefined {section[:-1]} {name!r}"
    for name in config["service"]["extensions"]:
        assert name in config["extensions"]
    assert config["exporters"]["prometheus"]["add_metric_suffixes"] is True  # names as in metric_names


def test_alert_rules_pass_promtool_check_and_unit_tests():
    tool = promtool()
    check = subprocess.run([tool, "check", "rules", str(PROMETHEUS / "alerts.yml")], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 8 rules found" in check.stdout
    tests = subprocess.run([tool, "test", "rules", "alerts_test.yml"], cwd=PROMETHEUS, capture_output=True,
                           text=True, timeout=60)
    assert tests.returncode == 0, tests.stdout + tests.stderr


def test_promtool_rejects_a_broken_rule(tmp_path):
    tool = promtool()
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    rules["groups"][0]["rules"][0]["expr"] = "sum(rate(up[5m]) >"
    broken = tmp_path / "alerts.yml"
    broken.write_text(yaml.safe_dump(rules))
    check = subprocess.run([tool, "check", "rules", str(broken)], capture_output=True, text=True, timeout=60)
    assert check.returncode != 0 and "K3TargetDown" in check.stdout + check.stderr


def test_alert_rules_use_known_metrics_only():
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    known = set(mn.by_prometheus_name())
    for group in rules["groups"]:
        for rule in group["rules"]:
            used = metrics_in(rule["expr"])
            assert used <= known, f"{rule['alert']}: unknown metric(s) {used - known}"
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}


def test_prometheus_template_loads_the_rules_and_names_jobs_like_k3_up():
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    (job,) = config["scrape_configs"]
    relabels = {r.get("target_label"): r for r in job["relabel_configs"]}
    assert relabels["job"]["replacement"] == "k3-$1"
    assert relabels["job"]["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
