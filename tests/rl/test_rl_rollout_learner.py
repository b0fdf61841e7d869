"""Rollout worker + learner over the event bus: partial rollout, staleness, verifier errors, worker death,
learner restart (idempotency), dead-lettering. Embedded bus by default, the same over Kafka."""

from __future__ import annotations

import time
import uuid

import pytest
import torch
from rl_fixtures import EXACT, SMALL_ENGINE, LengthEnvironment, tiny_policy
from safetensors.torch import save_model

from k3.model.rl.effort import EffortBudgets
from k3.protos.v1 import rollout_pb2
from k3.services.bus import open_bus
from k3.services.rollout.codec import (
    DEAD_LETTER_TOPIC,
    TRAJECTORIES_TOPIC,
    WEIGHTS_TOPIC,
    MalformedTrajectory,
    decode_trajectory,
    encode_weights,
    parse_trajectory,
)
from k3.services.rollout.worker import RolloutWorker, WorkerConfig
from k3.services.trainer.learner import Learner, LearnerConfig

torch.set_num_threads(1)


@pytest.fixture(params=["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
def bus_url(request, tmp_path):
    if request.param == "embedded":
        return f"embedded://{tmp_path / 'bus'}"
    return f"kafka://{request.getfixturevalue('kafka_bootstrap')}"


def _worker(bus, tmp_path, job, *, env=None, threshold=0.5, staleness=1, worker_id="w0", groups=2):
    model, _, tok = tiny_policy()
    env = env or LengthEnvironment(tok, EXACT)
    cfg = WorkerConfig(job_id=job, worker_id=worker_id, environments=("length",), group_size=2,
                       groups_per_step=groups, max_staleness=staleness, partial_threshold=threshold,
                       budgets=EXACT, engine=SMALL_ENGINE, weights_wait_s=0.2)
    return RolloutWorker(cfg, model, tok, bus, str(tmp_path / "rollout"), environments={"length": env})


def _unique_job(prefix):
    """A job id no earlier run used: a Kafka broker keeps its topics across runs, and the topics are shared."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def _job_records(bus, job):
    """This job's records on the shared trajectories topic (others' records, readable or not, are skipped)."""
    def whose(value):
        try:
            return parse_trajectory(value).job_id
        except MalformedTrajectory:
            return None

    return [r for r in _read_all(bus, TRAJECTORIES_TOPIC, f"audit-{uuid.uuid4().hex[:8]}") if whose(r.value) == job]


def _read_all(bus, topic, group):
    consumer = bus.subscribe([topic], group=group)
    consumer.seek_to_beginning()
    out = []
    while True:
        records = consumer.poll(timeout_s=1.0)
        if not records:
            break
        out += records
    consumer.close()
    return out


def test_partial_rollout_pauses_long_trajectories_and_resumes_them_under_new_weights(tmp_path):
    bus = open_bus(f"embedded://{tmp_path / 'bus'}")
    worker = _worker(bus, tmp_path, "pr")
    try:
        first = worker.step()  # 4 groups admitted (capacity 2 x batch 4); the short half finishes
        assert len(first) == 4 and all(t.problem_id.split("/")[2] in ("0", "2") for t in first)
        assert len(worker.paused) == 4
        # a trajectory that already generated keeps its sequence state (one not started yet has none to keep)
        assert all(t.state is not None for t in worker.paused if t.progress.output_ids)
        assert any(t.progress.output_ids for t in worker.paused)
        assert {v for t in first for v in t.versions} == {0}
        # the learner publishes version 1: other weights, loaded by the worker between rounds
        model, _, _ = tiny_policy(seed=1)
        save_model(model, str(tmp_path / "v1.safetensors"))
        bus.publish(WEIGHTS_TOPIC, encode_weights("pr", 1, str(tmp_path / "v1.safetensors"), 4))
        resumed = []
        for _ in range(6):
            resumed += [t for t in worker.step() if t.pauses]
            if len(resumed) == 4:
                break
        assert worker.version == 1 and len(resumed) == 4
        for t in resumed:
            assert len(t.output_ids) == 24 and t.finish_reason == "length"
            versions = list(t.versions)
            assert versions[-1] == 1 and versions == sorted(versions)  # tagged per token, old then new
        assert any(t.versions[0] == 0 for t in resumed)  # begun under version 0, finished under version 1
    finally:
        worker.close()
        bus.close()


def test_verifier_that_throws_gives_zero_reward_with_the_reason(tmp_path):
    bus = open_bus(f"embedded://{tmp_path / 'bus'}")
    _, _, tok = tiny_policy()
    worker = _worker(bus, tmp_path, "ve", env=LengthEnvironment(tok, EXACT, raise_on=[0]), threshold=1.0)
    try:
        published = worker.step()
        broken = [t for t in published if t.problem_id.split("/")[2] == "0"]
        assert len(broken) == 2 and all(t.reward == 0.0 and t.verifier_score == 0.0 for t in broken)
        assert all("verifier raised ZeroDivisionError: the checker broke" in t.reward_reason for t in broken)
        assert worker.stats["verifier_errors"] == 2
        assert any(t.verifier_score > 0 for t in published if t not in broken)  # the others are scored
    finally:
        worker.close()
        bus.close()


def test_a_dead_workers_paused_trajectories_are_adopted_by_its_replacement(tmp_path):
    bus = open_bus(f"embedded://{tmp_path / 'bus'}")
    worker = _worker(bus, tmp_path, "wd")
    first = worker.step()
    paused_ids = {t.ticket.trajectory_id for t in worker.paused}
    admitted = worker.next_group * 2
    worker.engine.close()  # dies: whatever it held in memory is gone; only the spool remains
    replacement = _worker(bus, tmp_path, "wd")
    try:
        assert {t.ticket.trajectory_id for t in replacement.paused} == paused_ids
        assert replacement.stats["adopted"] == 4
        assert all(t.state is not None for t in replacement.paused if t.progress.output_ids)
        later = []
        for _ in range(8):
            later += replacement.step()
            if not replacement.paused:
                break
        published = [decode_trajectory(r.value).id for r in _read_all(bus, TRAJECTORIES_TOPIC, "count")]
        assert len(published) == len(set(published))  # nothing twice
        expected = {f"wd/w0/g{g}/{m}" for g in range(replacement.next_group) for m in range(2)}
        assert set(published) == expected and len(expected) >= admitted  # nothing lost
        assert paused_ids <= {t.id for t in later}
        assert len(first) == 4
    finally:
        replacement.close()
        bus.close()


def _learner(bus, tmp_path, job, staleness=1, read_from_ms=None):
    model, cfg, tok = tiny_policy()
    return Learner(LearnerConfig(job_id=job, job_dir=str(tmp_path / "job"), group_size=2, groups_per_step=2,
                                 max_staleness=staleness, lr=0.002, read_from_ms=read_from_ms), bus, model, cfg, tok)


def test_a_new_jobs_learner_skips_what_older_jobs_published(tmp_path, bus_url):
    job = _unique_job("fresh")
    bus = open_bus(bus_url)
    older_job = _unique_job("older")
    for i in range(6):
        bus.publish(TRAJECTORIES_TOPIC, rollout_pb2.Trajectory(id=f"{older_job}/{i}", job_id=older_job).SerializeToString())
    time.sleep(0.05)
    start_ms = int(time.time() * 1000)
    time.sleep(0.05)
    worker = _worker(bus, tmp_path, job)
    learner = _learner(bus, tmp_path, job, read_from_ms=start_ms)
    learner.close()  # dies right after its version-0 checkpoint: the restart must start at the same place
    learner = _learner(bus, tmp_path, job, read_from_ms=start_ms)
    control = _learner(bus, tmp_path / "control", _unique_job("control"))  # reads the topic from its beginning
    try:
        for _ in range(3):
            worker.step()
        assert learner.step(timeout_s=20) is not None
        assert learner.counters["foreign"] == 0 and learner.counters["dead_lettered"] == 0
        deadline = time.monotonic() + 30
        while control.counters["foreign"] < 6 + 4 and time.monotonic() < deadline:
            control.poll(0.5)
        assert control.counters["foreign"] >= 6 + 4  # the older job's records and this job's first round
    finally:
        worker.close()
        learner.close()
        control.close()
        bus.close()


def test_learner_is_idempotent_across_a_restart_and_keeps_staleness_bounded(tmp_path, bus_url):
    job = _unique_job("idem")
    bus = open_bus(bus_url)
    worker = _worker(bus, tmp_path, job)
    learner = _learner(bus, tmp_path, job)
    try:
        for _ in range(3):
            worker.step()
        assert learner.step(timeout_s=20) is not None
        worker.sync_weights(wait_s=5)
        for _ in range(2):
            worker.step()
        learner.poll(1.0)  # reads more records (some into incomplete groups), then dies without a checkpoint
        learner.close()
        learner = _learner(bus, tmp_path, job)
        assert learner.version == 1
        for _ in range(4):
            if worker.sync_weights():
                pass
            worker.step()
            while learner.step(timeout_s=3) is not None:
                pass
        ledger_ids = [i for entry in learner.ledger for i in entry["ids"]]
        assert len(ledger_ids) == len(set(ledger_ids)) and learner.version >= 3  # nothing learned twice
        published = {decode_trajectory(r.value).id for r in _job_records(bus, job)}
        assert set(ledger_ids) <= published
        waiting = {i for g in learner._buffer.values() for i in g}
        dropped = [i for entry in learner.ledger for i in entry["dropped_ids"]]
        assert not set(dropped) & set(ledger_ids) and learner.learned == set(ledger_ids) | set(dropped)
        assert published == set(ledger_ids) | set(dropped) | waiting  # and nothing lost
        # staleness of every learned token, recomputed from the recorded versions, is within the bound
        by_id = {t.id: t for t in (decode_trajectory(r.value) for r in _job_records(bus, job))}
        for entry in learner.ledger:
            for i in entry["ids"]:
                assert entry["version"] - min(by_id[i].versions) <= 1
            assert all(s <= 1 for s in entry["staleness"])
    finally:
        worker.close()
        learner.close()
        bus.close()


def test_malformed_trajectories_are_dead_lettered_and_learning_goes_on(tmp_path, bus_url):
    job = _unique_job("dlq")
    bus = open_bus(bus_url)
    learner = _learner(bus, tmp_path, job)
    worker = _worker(bus, tmp_path, job, threshold=1.0)
    try:
        garbage = b"\xff\x00 not protobuf " + job.encode()
        bus.publish(TRAJECTORIES_TOPIC, garbage)
        bad = rollout_pb2.Trajectory(id="x", job_id=job, group_id="g", group_size=2, prompt_ids=[1],
                                     output_ids=[1, 2], behaviour_logprobs=[-1.0], versions=[0, 0], loss_mask=[1, 1])
        bus.publish(TRAJECTORIES_TOPIC, bad.SerializeToString())
        future = rollout_pb2.Trajectory(id="y", job_id=job, group_id="g2", group_size=2, prompt_ids=[1],
                                        output_ids=[3], behaviour_logprobs=[-1.0], versions=[7], loss_mask=[1])
        bus.publish(TRAJECTORIES_TOPIC, future.SerializeToString())
        worker.step()
        result = learner.step(timeout_s=20)
        assert result is not None and result["trajectories"] == 4 and learner.version == 1
        ours = {garbage, bad.SerializeToString(), future.SerializeToString()}  # the topic may be shared
        # The update may come before the learner has read all three (Kafka orders records only within a
        # partition): it keeps reading until they are dead-lettered.
        reasons, deadline = [], time.monotonic() + 30
        while len(reasons) < 3 and time.monotonic() < deadline:
            learner.poll(0.5)
            letters = [rollout_pb2.DeadLetter.FromString(r.value)
                       for r in _read_all(bus, DEAD_LETTER_TOPIC, f"dlq-{uuid.uuid4().hex[:8]}")]
            reasons = [d.reason for d in letters if d.value in ours]
        assert len(reasons) == 3, reasons
        assert any("not a k3.v1.Trajectory" in r for r in reasons)
        assert any("behaviour_logprobs has 1 entries for 2 output tokens" in r for r in reasons)
        assert any("claims version 7" in r for r in reasons)
    finally:
        worker.close()
        learner.close()
        bus.close()


def test_effort_budget_penalty_is_applied_to_overlong_trajectories(tmp_path):
    bus = open_bus(f"embedded://{tmp_path / 'bus'}")
    _, _, tok = tiny_policy()
    budgets = EffortBudgets(low=1, high=1, max=1, allowed_multiple=2.0, penalty=0.5)
    env = LengthEnvironment(tok, budgets, short=3, long=6)
    worker = _worker(bus, tmp_path, "ol", env=env, threshold=1.0)
    worker.config.budgets = budgets
    try:
        for t in worker.step():
            assert t.finish_reason == "length" and len(t.output_ids) == 2 * t.token_budget
            assert t.penalty == 0.5 and t.reward == pytest.approx(t.verifier_score - 0.5)
    finally:
        worker.close()
        bus.close()
