"""RL jobs through the Jobs API: a tiny RL job end to end over gRPC (embedded bus, and real Kafka), and a trainer
killed mid-job whose restarted successor resumes the job from its last checkpoint, learning every trajectory
exactly once (counted by trajectory id in the learner's ledger).

The trainer under test in the recovery case is a real ``k3 serve trainer`` process attached to this file's Ray
instance, so that SIGKILL takes its Ray job actor (and the RL actors under it) down as a crash would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from k3.protos.v1 import jobs_pb2, jobs_pb2_grpc
from k3.services.common.client import error_detail, make_channel
from k3.services.common.config import ServerConfig, load_config
from k3.services.common.server import start_server
from k3.services.trainer.service import Trainer, TrainerService, TrainerServiceConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "observe"))
from otlp_receiver import OTLPReceiver  # noqa: E402

ray = pytest.importorskip("ray")
pytest.importorskip("k3.services.trainer.rl_job")

pytestmark = pytest.mark.slow

# Two problems x two samples per update and 16-token answers: an update takes seconds on a CPU.
RL_BODY = {"prompts_per_step": 2, "group_size": 2, "eval_size": 2, "eval_interval": 0,
           "effort_budgets": {"low": 16, "high": 16, "max": 16}}


@pytest.fixture(scope="module")
def ray_runtime():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def in_process_trainer(tmp_path, **overrides):
    config = load_config(TrainerServiceConfig, env={}, overrides={"trainer.jobs_dir": str(tmp_path / "jobs"),
                                                                  **overrides})
    handle = start_server(TrainerService(Trainer(config)),
                          ServerConfig(port=0, grace_seconds=1.0, metrics=False, tracing=False))
    return handle, jobs_pb2_grpc.JobsStub(make_channel(handle.address))


def run_rl_job(stub, steps: int) -> tuple[str, list]:
    job = stub.Submit(jobs_pb2.JobSpec(kind="rl", preset="tiny", name="rl-tiny",
                                       spec_json=json.dumps({**RL_BODY, "steps": steps})))
    return job.id, list(stub.Watch(jobs_pb2.WatchRequest(id=job.id), timeout=400))


def check_finished_rl_job(events, steps: int) -> None:
    assert events[-1].state == "SUCCEEDED", events[-1].message
    updates = [e for e in events if "reward" in e.metrics]
    assert [e.step for e in updates] == list(range(1, steps + 1))
    assert all(e.metrics["staleness_max"] <= 1 for e in updates)  # the default bound, max_staleness 1
    assert [e.step for e in events if "eval_reward" in e.metrics] == [0, steps]
    assert events[-1].checkpoint.endswith(f"checkpoint-{steps}")


def test_rl_job_over_grpc_end_to_end_and_bad_rl_specs(ray_runtime, tmp_path):
    receiver = OTLPReceiver().start()  # the trainer's collector: its RL actors push their metrics there
    handle, stub = in_process_trainer(tmp_path, **{"server.otlp_endpoint": receiver.endpoint})
    try:
        for body, field, reason in [({"environments": ["chess"]}, "spec_json.environments", "UNKNOWN_ENVIRONMENT"),
                                    ({"max_staleness": -1}, "spec_json.max_staleness", "BAD_VALUE"),
                                    ({"efforts": ["extreme"]}, "spec_json.efforts", "BAD_VALUE"),
                                    ({"job_dir": "/etc"}, "spec_json.job_dir", "UNEXPECTED_FIELD"),
                                    ({"otlp_endpoint": "h:1"}, "spec_json.otlp_endpoint", "UNEXPECTED_FIELD")]:
            with pytest.raises(grpc.RpcError) as info:
                stub.Submit(jobs_pb2.JobSpec(kind="rl", preset="tiny", spec_json=json.dumps(body)))
            detail = error_detail(info.value)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and (detail.field, detail.reason) == \
                (field, reason), info.value.details()
        job_id, events = run_rl_job(stub, steps=2)
        check_finished_rl_job(events, 2)
    finally:
        handle.stop()
        receiver.stop()
    # The actors flushed their metrics when the job closed them.
    assert "k3.rl.reward" in receiver.metric_names.get("k3-rl-rollout", set()), receiver.metric_names
    assert "k3.rl.staleness" in receiver.metric_names.get("k3-rl-learner", set()), receiver.metric_names


@pytest.mark.kafka
def test_rl_job_with_real_kafka(ray_runtime, tmp_path, kafka_bootstrap):
    handle, stub = in_process_trainer(tmp_path, kafka_bootstrap=kafka_bootstrap)
    try:
        job_id, events = run_rl_job(stub, steps=2)
        check_finished_rl_job(events, 2)
    finally:
        handle.stop()
    # The job's events went to Kafka's k3.jobs topic (and trajectories through k3.trajectories, which the
    # learner consumed: the updates above learned from them).
    from k3.services.bus import open_bus

    with open_bus(f"kafka://{kafka_bootstrap}") as bus:
        consumer = bus.subscribe(["k3.jobs"], f"test-{job_id}")
        seen = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(e.get("state") == "SUCCEEDED" for e in seen):
            seen += [json.loads(r.value) for r in consumer.poll(1.0) if r.key == job_id.encode()]
        consumer.close()
    assert [e["step"] for e in seen] == [e.step for e in events]


def serve_trainer(tmp_path, gcs_address):
    config = tmp_path / "trainer.yaml"
    config.write_text(json.dumps({"trainer": {"jobs_dir": str(tmp_path / "jobs")},
                                  "ray": {"address": gcs_address, "cancel_grace_s": 5.0},
                                  "server": {"metrics": False, "tracing": False}}))
    # The Ray settings this process got from ray.init (auth mode) go along; the address comes from the config.
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_") and k != "RAY_ADDRESS"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "k3", "serve", "trainer", "--config", str(config), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, jobs_pb2_grpc.JobsStub(make_channel(line.rsplit(" ", 1)[1].strip()))


def test_killed_trainer_resumes_the_rl_job_learning_each_trajectory_once(ray_runtime, tmp_path):
    steps = 4
    proc, stub = serve_trainer(tmp_path, ray_runtime)
    try:
        job = stub.Submit(jobs_pb2.JobSpec(kind="rl", preset="tiny", spec_json=json.dumps({**RL_BODY, "steps": steps})))
        for event in stub.Watch(jobs_pb2.WatchRequest(id=job.id), timeout=400):
            if event.checkpoint.endswith("checkpoint-2"):
                break
    finally:
        proc.send_signal(signal.SIGKILL)  # a crash: no checkpoint on the way out, Ray ends the job's actors
        proc.wait(30)
    run = tmp_path / "jobs" / job.id / "run"
    before = json.loads((run / "checkpoint-2" / "trainer.json").read_text())["ledger"]
    assert json.loads((tmp_path / "jobs" / job.id / "job.json").read_text())["state"] == "RUNNING"

    proc, stub = serve_trainer(tmp_path, ray_runtime)
    try:
        assert [j.id for j in stub.List(jobs_pb2.ListRequest()).jobs] == [job.id]
        events = list(stub.Watch(jobs_pb2.WatchRequest(id=job.id), timeout=400))
        assert events[-1].state == "SUCCEEDED", events[-1].message
        assert any("resuming (attempt 2)" in e.message for e in events)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    final = json.loads((run / f"checkpoint-{steps}" / "trainer.json").read_text())["ledger"]
    # The restarted job continued the same lineage: what was learned before the crash is kept as it was ...
    assert final[:len(before)] == before
    # ... and every update learned a full batch of distinct trajectories, none of them twice.
    assert [entry["version"] for entry in final] == list(range(steps))
    ids = [i for entry in final for i in entry["ids"]]
    assert all(len(entry["ids"]) == RL_BODY["prompts_per_step"] * RL_BODY["group_size"] for entry in final)
    assert len(ids) == len(set(ids)) == steps * RL_BODY["prompts_per_step"] * RL_BODY["group_size"]
