"""Bad values are refused before anything is rendered, with a message naming the field: by
values.schema.json (types, ranges, formats, unknown keys) or by the templates' own checks (what JSON
Schema cannot express)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(120)

CHART = Path(__file__).resolve().parents[2] / "charts" / "k3"
POOL = {"name": "shard-0", "shard": "0/2"}


def refusal(chart, tmp_path, values: dict) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    with pytest.raises(chart.RenderError) as caught:
        chart.render([path])
    return caught.value.stderr


# Each case: values, then fragments that must all appear in Helm's message.
SCHEMA_CASES = {
    "negative replicas": ({"decode": {"replicas": -1}}, ["/decode/replicas", "minimum"]),
    "negative pool replicas": ({"expertPools": [{**POOL, "replicas": -2}]}, ["/expertPools/0/replicas", "minimum"]),
    "shard not i/n": ({"expertPools": [{"name": "a", "shard": "half"}]}, ["/expertPools/0/shard", "pattern"]),
    "shard count zero": ({"expertPools": [{"name": "a", "shard": "0/0"}]}, ["/expertPools/0/shard", "pattern"]),
    "pool without shard": ({"expertPools": [{"name": "a"}]}, ["/expertPools/0", "shard"]),
    "pool name not a DNS label": ({"expertPools": [{"name": "Shard_0", "shard": "0/1"}]},
                                  ["/expertPools/0/name", "pattern"]),
    "port as a string": ({"router": {"port": "fifty"}}, ["/router/port", "string"]),
    "port out of range": ({"cache": {"port": 70000}}, ["/cache/port", "maximum"]),
    "enabled as a string": ({"vision": {"enabled": "yes"}}, ["/vision/enabled", "boolean"]),
    "resources as a list": ({"prefill": {"resources": ["1 GPU"]}}, ["/prefill/resources", "object"]),
    "bad gpu quantity": ({"decode": {"resources": {"limits": {"nvidia.com/gpu": "lots"}}}},
                         ["/decode/resources/limits/nvidia.com~1gpu"]),
    "unknown top-level key": ({"routr": {"replicas": 2}}, ["additional properties 'routr' not allowed"]),
    "unknown component key": ({"router": {"replica": 2}}, ["/router", "additional properties 'replica' not allowed"]),
    "hpa target not a quantity": ({"decode": {"autoscaling": {"targetAverageValue": "four"}}},
                                  ["/decode/autoscaling/targetAverageValue", "pattern"]),
    "kafka address without port": ({"kafka": {"bootstrap": "kafka"}}, ["/kafka/bootstrap", "pattern"]),
    "redis url without scheme": ({"redis": {"url": "redis-master:6379"}}, ["/redis/url", "pattern"]),
}


@pytest.mark.parametrize("case", SCHEMA_CASES)
def test_schema_refuses_bad_values_naming_the_field(chart, helm, tmp_path, case):
    values, fragments = SCHEMA_CASES[case]
    message = refusal(chart, tmp_path, values)
    assert "values don't meet the specifications of the schema" in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


TEMPLATE_CASES = {
    "shard index not below count": (
        {"expertPools": [{"name": "a", "shard": "2/2"}]},
        "expertPools[0].shard: index must be below the shard count, got \"2/2\""),
    "pool name used twice": (
        {"expertPools": [{"name": "a", "shard": "0/2"}, {"name": "a", "shard": "1/2"}]},
        "expertPools[1].name: pool name \"a\" is used twice"),
    "decode min above max": (
        {"decode": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
        "decode.autoscaling: minReplicas (5) must not exceed maxReplicas (2)"),
    "pool min above max": (
        {"expertPools": [{**POOL, "autoscaling": {"enabled": True, "minReplicas": 9}}]},
        "expertPools[0].autoscaling: minReplicas (9) must not exceed maxReplicas (8)"),
    "ray job without entrypoint": (
        {"ray": {"job": {"enabled": True}}},
        "ray.job.entrypoint: must name the command the RayJob runs"),
}


@pytest.mark.parametrize("case", TEMPLATE_CASES)
def test_templates_refuse_what_the_schema_cannot_express(chart, helm, tmp_path, case):
    values, expected = TEMPLATE_CASES[case]
    assert expected in refusal(chart, tmp_path, values)


def test_good_values_of_the_same_shapes_render(chart, helm, tmp_path):
    """The refusals above are about the values, not the shapes: close neighbours render."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({
        "decode": {"replicas": 0, "resources": {"limits": {"nvidia.com/gpu": 2}},
                   "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 2, "targetAverageValue": "1500m"}},
        "expertPools": [{"name": "a", "shard": "0/2"}, {"name": "b", "shard": "1/2", "replicas": 0}],
        "kafka": {"bootstrap": "kafka-0:9092,kafka-1:9092"},
        "redis": {"url": "rediss://redis:6380/1"},
        "ray": {"job": {"enabled": True, "entrypoint": "k3 train"}},
    }))
    assert "name: k3-expert-b" in chart.render([path])


def test_values_schema_is_generated_from_schema_py():
    result = subprocess.run([sys.executable, str(CHART / "schema.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_value_is_documented():
    """helm-docs style: every leaf of values.yaml, or a key above it, has a `# --` comment."""
    undocumented = []
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the keys enclosing the current line
    comment: list[str] = []
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped)
            continue
        if not stripped or stripped.startswith("- ") or ":" not in stripped:
            comment = [] if not stripped else comment
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        documented = any(c.startswith("# --") for c in comment) or any(d for _, d in stack)
        is_leaf = not stripped.endswith(":")
        if is_leaf and not documented:
            undocumented.append(stripped)
        stack.append((indent, documented))
        comment = []
    assert undocumented == []
