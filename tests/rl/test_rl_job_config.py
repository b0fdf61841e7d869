"""``RLJobConfig.from_dict``: good specs round-trip, bad ones raise ValueError naming the field."""

import pytest

from k3.services.trainer.rl_job import RLJobConfig


def test_defaults_round_trip():
    cfg = RLJobConfig.from_dict({"preset": "tiny", "job_dir": "/tmp/x"})
    again = RLJobConfig.from_dict(cfg.to_dict())
    assert again == cfg and cfg.resolved_job_id() == "x"
    assert cfg.resolved_bus_url() == "embedded:///tmp/x/bus"


@pytest.mark.parametrize("spec, field", [
    ({}, "preset"),
    ({"preset": "tiny", "checkpoint": "/nowhere"}, "preset"),
    ({"preset": "kimi-k3"}, "preset"),
    ({"checkpoint": "/definitely/not/here"}, "checkpoint"),
    ({"preset": "tiny", "environments": ["reasoning_gym/nope"]}, "environments"),
    ({"preset": "tiny", "environments": []}, "environments"),
    ({"preset": "tiny", "steps": 0}, "steps"),
    ({"preset": "tiny", "steps": "10"}, "steps"),
    ({"preset": "tiny", "group_size": 1}, "group_size"),
    ({"preset": "tiny", "efforts": ["medium"]}, "efforts"),
    ({"preset": "tiny", "effort_budgets": {"low": 0}}, "effort_budgets"),
    ({"preset": "tiny", "max_staleness": -1}, "max_staleness"),
    ({"preset": "tiny", "lr": 0}, "lr"),
    ({"preset": "tiny", "optimizer": "sgd"}, "optimizer"),
    ({"preset": "tiny", "partial_rollout_threshold": 0}, "partial_rollout_threshold"),
    ({"preset": "tiny", "prompts_per_step": 3, "num_workers": 2}, "num_workers"),
    ({"preset": "tiny", "bus_url": "redis://x"}, "bus_url"),
    ({"preset": "tiny", "distill_coef": 0.5}, "distill_coef"),
    ({"preset": "tiny", "teachers": {"math": "/x"}}, "teachers"),
    ({"preset": "tiny", "job_id": "bad id!"}, "job_id"),
    ({"preset": "tiny", "bogus": 1}, "bogus"),
])
def test_bad_specs_name_their_field(spec, field):
    with pytest.raises(ValueError) as info:
        RLJobConfig.from_dict(spec)
    assert str(info.value).startswith(f"{field}:"), str(info.value)


def test_unknown_environment_lists_the_known_ones():
    with pytest.raises(ValueError, match="known: reasoning_gym/chain_sum"):
        RLJobConfig.from_dict({"preset": "tiny", "environments": ["gsm8k"]})


def test_distillation_teachers_must_cover_every_domain_and_effort_sampled():
    spec = {"preset": "tiny", "environments": ["reasoning_gym/chain_sum", "tool_use"], "efforts": ["low", "high"],
            "distill_coef": 0.5}
    with pytest.raises(ValueError, match="teachers: no teacher for domain 'tools' at effort 'low'"):
        RLJobConfig.from_dict({**spec, "teachers": {"math/*": "/t/math"}})
    with pytest.raises(ValueError, match="no teacher for domain 'math' at effort 'high'"):
        RLJobConfig.from_dict({**spec, "teachers": {"math/low": "/t/m", "tools/*": "/t/tools"}})
    cfg = RLJobConfig.from_dict({**spec, "teachers": {"math/low": "/t/m", "math/high": "/t/mh", "tools/*": "/t/t"}})
    assert cfg.teachers["tools/*"] == "/t/t"
