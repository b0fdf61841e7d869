"""The Jobs API over real gRPC on loopback with jobs on a real local Ray: submit, watch, cancel, list, restart.

One Ray instance serves the whole file (starting Ray costs seconds); jobs train the tiny preset at toy widths
for a few steps, so each takes seconds.
"""

from __future__ import annotations

import json
import os
import time

import grpc
import pytest

from k3.cli import main
from k3.model import checkpoint as ckpt
from k3.protos.v1 import jobs_pb2, jobs_pb2_grpc
from k3.services.common.client import error_detail, make_channel
from k3.services.common.config import ServerConfig, load_config
from k3.services.common.server import start_server
from k3.services.trainer.service import Trainer, TrainerService, TrainerServiceConfig

ray = pytest.importorskip("ray")

MICRO = {"hidden_size": 32, "num_layers": 2, "dense_intermediate_size": 32, "kda_heads": 2, "kda_head_dim": 8,
         "kda_gate_rank": 8, "mla_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_dim": 8,
         "qk_extra_dim": 4, "v_head_dim": 8, "num_experts": 4, "top_k": 2, "latent_size": 16,
         "expert_intermediate_size": 16}


def pretrain_body(steps: int, **extra) -> dict:
    return {"steps": steps, "batch_tokens": 64, "stages": [[0.5, 16], [0.5, 32]], "model_overrides": MICRO,
            "eval_every": 3, "eval_batches": 1, "save_every": 3, "data": {"max_bytes": 300_000}, **extra}


@pytest.fixture(scope="module")
def ray_runtime():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus-cache")


def start_trainer(jobs_dir, cache, **ray_fields):
    config = load_config(TrainerServiceConfig, env={}, overrides={
        "trainer.jobs_dir": str(jobs_dir), "trainer.data_cache_dir": str(cache),
        **{f"ray.{k}": v for k, v in ray_fields.items()}})
    service = TrainerService(Trainer(config))
    handle = start_server(service, ServerConfig(port=0, grace_seconds=1.0, metrics=False, tracing=False))
    return handle, jobs_pb2_grpc.JobsStub(make_channel(handle.address))


def watch_all(stub, job_id, timeout=240):
    return list(stub.Watch(jobs_pb2.WatchRequest(id=job_id), timeout=timeout))


def wait_for(predicate, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def trainer(ray_runtime, shared_cache, tmp_path):
    handle, stub = start_trainer(tmp_path / "jobs", shared_cache)
    yield handle, stub, tmp_path / "jobs"
    handle.stop()


def test_pretrain_then_sft_job_stream_progress_and_checkpoints(trainer):
    handle, stub, jobs_dir = trainer
    job = stub.Submit(jobs_pb2.JobSpec(kind="pretrain", preset="tiny", name="micro",
                                       spec_json=json.dumps(pretrain_body(6))))
    assert job.state == "PENDING" and job.spec.name == "micro" and job.steps == 6
    events = watch_all(stub, job.id)
    states = [e.state for e in events]
    assert states[0] == "PENDING" and states[-1] == "SUCCEEDED" and "RUNNING" in states
    # Every step's loss, the evals and every checkpoint came through the stream, in order.
    steps = [e.step for e in events if "loss" in e.metrics]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events if "eval_loss" in e.metrics] == [0, 3, 6]
    checkpoints = [e.checkpoint for e in events if e.checkpoint]
    assert checkpoints[0].endswith("checkpoint-3") and checkpoints[-1].endswith("checkpoint-6")
    assert ckpt.read_trainer_state(checkpoints[-1])["step"] == 6
    assert all(e.steps == 6 for e in events[-3:])
    # Watching a finished job replays the same history and ends.
    again = watch_all(stub, job.id)
    assert [(e.state, e.step, dict(e.metrics), e.checkpoint) for e in again] == \
        [(e.state, e.step, dict(e.metrics), e.checkpoint) for e in events]

    # SFT from the pretrain job's output, named by job id.
    sft = stub.Submit(jobs_pb2.JobSpec(kind="sft", checkpoint=f"job:{job.id}", spec_json=json.dumps({
        "steps": 2, "batch_tokens": 500, "data": {"mix": "reasoning=1"}, "eval_conversations": 1})))
    sft_events = watch_all(stub, sft.id)
    assert sft_events[-1].state == "SUCCEEDED", sft_events[-1].message
    assert [e.step for e in sft_events if "loss" in e.metrics] == [1, 2]
    sft_checkpoint = [e.checkpoint for e in sft_events if e.checkpoint][-1]
    state = ckpt.read_trainer_state(sft_checkpoint)
    assert state["sft_config"]["steps"] == 2 and state["base_checkpoint"] == checkpoints[-1]

    listed = stub.List(jobs_pb2.ListRequest()).jobs
    assert [(j.id, j.state, j.step) for j in listed] == [(job.id, "SUCCEEDED", 6), (sft.id, "SUCCEEDED", 2)]
    with pytest.raises(grpc.RpcError) as info:
        stub.Cancel(jobs_pb2.CancelRequest(id=job.id))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "already SUCCEEDED" in info.value.details()
    # Every event was also published on the bus topic k3.jobs (embedded log in the jobs folder).
    from k3.services.bus import open_bus

    with open_bus(f"embedded://{jobs_dir / 'bus'}") as bus:
        consumer = bus.subscribe(["k3.jobs"], "test")
        published = []
        while batch := consumer.poll(1.0):
            published += [json.loads(r.value) for r in batch]
        consumer.close()
    assert [p["step"] for p in published if p["id"] == job.id] == [e.step for e in events]
    assert {r["id"] for r in published} == {job.id, sft.id}


def test_cli_lists_watches_and_reports_bad_specs(trainer, capsys, tmp_path):
    handle, stub, _ = trainer
    cli = ["jobs", "--trainer", handle.address]
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text("kind: pretrain\npreset: tiny\nsteps: 3\noptimizer:\n  lr: 0.01\n")
    assert main([*cli, "submit", "--spec", str(spec_file), "--set", "optimizer.lr=-1"]) == 2
    assert "INVALID_ARGUMENT" in (err := capsys.readouterr().err) and "spec_json.optimizer.lr" in err
    assert main([*cli, "submit", "--set", "steps=3"]) == 2
    assert "--kind is required" in capsys.readouterr().err
    assert main([*cli, "watch", "nope"]) == 2 and "NOT_FOUND" in capsys.readouterr().err
    body = json.dumps(pretrain_body(2))
    assert main([*cli, "submit", "--kind", "pretrain", "--preset", "tiny", "--spec", str(_write(tmp_path, body)),
                 "--set", "steps=2", "--name", "cli"]) == 0
    job_id = capsys.readouterr().out.split()[3]
    assert main([*cli, "watch", job_id, "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[-1]["state"] == "SUCCEEDED" and lines[-1]["step"] == 2 == lines[-1]["steps"]
    assert main([*cli, "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(j["id"], j["name"], j["state"]) for j in listed] == [(job_id, "cli", "SUCCEEDED")]
    assert main([*cli, "cancel", job_id]) == 2 and "FAILED_PRECONDITION" in capsys.readouterr().err


def _write(tmp_path, text):
    path = tmp_path / "body.json"
    path.write_text(text)
    return path


def test_bad_requests_get_precise_statuses(trainer):
    _, stub, _ = trainer

    def fails(call, request):
        with pytest.raises(grpc.RpcError) as info:
            result = call(request)
            if hasattr(result, "__iter__") and not hasattr(result, "id"):
                list(result)
        return info.value

    err = fails(stub.Submit, jobs_pb2.JobSpec(kind="pretrain", preset="tiny",
                                              spec_json=json.dumps({"optimizer": {"lr": -1}})))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = error_detail(err)
    assert detail.field == "spec_json.optimizer.lr" and "finite number >= 0" in detail.message
    err = fails(stub.Submit, jobs_pb2.JobSpec(kind="distill"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and error_detail(err).reason == "UNKNOWN_KIND"
    err = fails(stub.Submit, jobs_pb2.JobSpec(kind="sft", checkpoint="job:nope"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and error_detail(err).field == "checkpoint"
    for call, request in [(stub.Watch, jobs_pb2.WatchRequest(id="nope")),
                          (stub.Cancel, jobs_pb2.CancelRequest(id="nope"))]:
        err = fails(call, request)
        assert err.code() == grpc.StatusCode.NOT_FOUND and "no job with id 'nope'" in err.details()
    err = fails(stub.Cancel, jobs_pb2.CancelRequest(id=""))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.List(jobs_pb2.ListRequest()).jobs == []  # nothing bad was recorded


def test_cancel_stops_the_ray_work_with_a_checkpoint(trainer):
    _, stub, jobs_dir = trainer
    job = stub.Submit(jobs_pb2.JobSpec(kind="pretrain", preset="tiny",
                                       spec_json=json.dumps(pretrain_body(5000, save_every=0))))
    events = stub.Watch(jobs_pb2.WatchRequest(id=job.id), timeout=240)
    pid = None
    for event in events:
        if event.message.startswith("running on"):
            pid = int(event.message.rsplit("pid ", 1)[1].rstrip(")"))
        if event.step >= 2:
            break
    events.cancel()
    assert pid is not None and _alive(pid)
    cancelled = stub.Cancel(jobs_pb2.CancelRequest(id=job.id))
    assert (cancelled.state, cancelled.message) == ("RUNNING", "cancel requested")
    final = watch_all(stub, job.id)[-1]
    assert final.state == "CANCELLED" and "cancelled at step" in final.message
    # The loop stopped at a step boundary and saved it; the actor's process is gone.
    saved = ckpt.latest_checkpoint(jobs_dir / job.id / "run")
    assert final.checkpoint == str(saved) and ckpt.read_trainer_state(saved)["step"] == final.step
    assert 2 <= final.step < 5000
    wait_for(lambda: not _alive(pid), 30, "the job's Ray worker to exit")
    # Cancelling again is a no-op; cancelling a finished job is refused.
    assert stub.Cancel(jobs_pb2.CancelRequest(id=job.id)).state == "CANCELLED"


def test_cancel_kills_a_job_that_does_not_stop_in_time(ray_runtime, shared_cache, tmp_path):
    # A grace period of 0 s: the actor is killed at once instead of waiting for the next step boundary.
    handle, stub = start_trainer(tmp_path / "jobs", shared_cache, cancel_grace_s=0.0)
    try:
        job = stub.Submit(jobs_pb2.JobSpec(kind="pretrain", preset="tiny",
                                           spec_json=json.dumps(pretrain_body(5000, save_every=0))))
        wait_for(lambda: _job(stub, job.id).step >= 1, what="the job to train")
        stub.Cancel(jobs_pb2.CancelRequest(id=job.id))
        final = watch_all(stub, job.id)[-1]
        assert final.state == "CANCELLED" and final.step < 5000
    finally:
        handle.stop()


def test_restarted_trainer_lists_jobs_and_resumes_the_interrupted_one(ray_runtime, shared_cache, tmp_path):
    jobs_dir = tmp_path / "jobs"
    handle, stub = start_trainer(jobs_dir, shared_cache)
    refused = stub.Submit(jobs_pb2.JobSpec(kind="pretrain", preset="tiny", spec_json=json.dumps(pretrain_body(80))))
    stub.Cancel(jobs_pb2.CancelRequest(id=refused.id))  # cancelled before Ray placed it, or soon after
    assert watch_all(stub, refused.id)[-1].state == "CANCELLED"
    steps = 80
    job = stub.Submit(jobs_pb2.JobSpec(kind="pretrain", preset="tiny",
                                       spec_json=json.dumps(pretrain_body(steps, save_every=0))))
    wait_for(lambda: _job(stub, job.id).step >= 3, what="the job to train")
    handle.stop()  # the trainer stops: the job checkpoints and stays unfinished on disk
    record = json.loads((jobs_dir / job.id / "job.json").read_text())
    assert record["state"] == "RUNNING"
    stopped_at = ckpt.read_trainer_state(ckpt.latest_checkpoint(jobs_dir / job.id / "run"))["step"]
    assert 3 <= stopped_at < steps

    handle, stub = start_trainer(jobs_dir, shared_cache)
    try:
        listed = {j.id: j for j in stub.List(jobs_pb2.ListRequest()).jobs}
        assert list(listed) == [refused.id, job.id] and listed[refused.id].state == "CANCELLED"
        assert listed[job.id].steps == steps
        events = watch_all(stub, job.id)
        assert events[-1].state == "SUCCEEDED" and events[-1].step == steps
        assert any(e.message == f"resumed at step {stopped_at} of {steps}" for e in events)
        # Each step was trained exactly once across the two trainers.
        metrics = [json.loads(line) for line in (jobs_dir / job.id / "run" / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics if m["kind"] == "train"] == list(range(1, steps + 1))
        assert json.loads((jobs_dir / job.id / "job.json").read_text())["attempts"] == 2
    finally:
        handle.stop()


def _job(stub, job_id):
    return next(j for j in stub.List(jobs_pb2.ListRequest()).jobs if j.id == job_id)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; it only waits for its parent to collect it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
