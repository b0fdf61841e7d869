"""``run_rl_job`` on a local Ray: a rollout worker and the learner are killed mid-job; the job recovers from its
last checkpoint and no trajectory is lost or learned twice (counted by trajectory id)."""

import json

import pytest

from k3.model import checkpoint as ckpt
from k3.services.bus import open_bus
from k3.services.rollout.codec import TRAJECTORIES_TOPIC, decode_trajectory
from k3.services.trainer.rl_job import RLJobConfig, run_rl_job

ray = pytest.importorskip("ray")


def test_rl_job_survives_killed_worker_and_learner(tmp_path):
    job_dir = tmp_path / "job"
    config = RLJobConfig.from_dict({
        "preset": "tiny", "job_dir": str(job_dir), "job_id": "killtest", "steps": 4, "prompts_per_step": 2,
        "group_size": 2, "eval_size": 2, "eval_interval": 0, "max_staleness": 1, "step_timeout_s": 300,
        "effort_budgets": {"low": 6, "high": 6, "max": 6, "allowed_multiple": 1.0},
    })
    events, killed = [], []

    def report(event):
        events.append(event)
        if event["kind"] == "train" and event["step"] == 1 and not killed:
            ray.kill(ray.get_actor("k3-rl-killtest-w0"), no_restart=True)
            killed.append("worker")
        elif event["kind"] == "train" and event["step"] == 2 and killed == ["worker"]:
            ray.kill(ray.get_actor("k3-rl-killtest-learner"), no_restart=True)
            killed.append("learner")

    result = run_rl_job(config, report=report, cancelled=lambda: False)
    kinds = [e["kind"] for e in events]
    assert result["step"] == 4 and result["stopped"] is None and killed == ["worker", "learner"]
    assert "learner_restarted" in kinds
    assert [e["step"] for e in events if e["kind"] == "train"] == [1, 2, 3, 4]
    assert [e[0] for e in result["eval_rewards"]] == [0, 4]
    state = ckpt.read_trainer_state(ckpt.latest_checkpoint(job_dir))
    learned = [i for entry in state["ledger"] for i in entry["ids"]]
    assert state["version"] == 4 and len(learned) == len(set(learned)) == 4 * 2 * 2  # each once
    assert all(s <= 1 for entry in state["ledger"] for s in entry["staleness"])
    bus = open_bus(f"embedded://{job_dir / 'bus'}")
    consumer = bus.subscribe([TRAJECTORIES_TOPIC], group="audit")
    consumer.seek_to_beginning()
    published = {decode_trajectory(r.value).id for r in consumer.poll(timeout_s=1.0, max_records=10000)}
    consumer.close()
    bus.close()
    assert set(learned) <= published
    lines = [json.loads(line) for line in (job_dir / "rl_metrics.jsonl").read_text().splitlines()]
    assert lines[0]["kind"] == "start" and any(e["kind"] == "checkpoint" for e in lines)


def test_cancelled_job_stops_cleanly_and_resumes(tmp_path):
    job_dir = tmp_path / "job"
    spec = {"preset": "tiny", "job_dir": str(job_dir), "job_id": "canceltest", "steps": 3, "prompts_per_step": 1,
            "group_size": 2, "eval_size": 0, "effort_budgets": {"low": 4, "high": 4, "max": 4,
                                                                  "allowed_multiple": 1.0}}
    steps = []
    result = run_rl_job(RLJobConfig.from_dict(spec), report=lambda e: steps.append(e),
                        cancelled=lambda: any(e["kind"] == "train" for e in steps))
    assert result["stopped"] == "cancelled" and result["step"] == 1
    resumed = run_rl_job(RLJobConfig.from_dict(spec), report=lambda e: None, cancelled=lambda: False)
    assert resumed["step"] == 3 and resumed["stopped"] is None
    state = ckpt.read_trainer_state(ckpt.latest_checkpoint(job_dir))
    learned = [i for entry in state["ledger"] for i in entry["ids"]]
    assert len(learned) == len(set(learned)) == 3 * 2
