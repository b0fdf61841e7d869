"""On-policy distillation through the learner: with a teacher and no task signal, RL updates move the student
towards the teacher (the exact KL of its next-token distribution halves), and a trajectory whose domain has no
teacher is dead-lettered with the reason."""

from __future__ import annotations

import torch
from rl_fixtures import EXACT, SMALL_ENGINE, LengthEnvironment, tiny_policy

from k3.model import checkpoint as ckpt
from k3.model.muon import PerHeadMuon
from k3.protos.v1 import rollout_pb2
from k3.services.bus import open_bus
from k3.services.engine.config import EngineConfig
from k3.services.rollout.codec import DEAD_LETTER_TOPIC
from k3.services.rollout.environment import Problem, Score, SingleTurn
from k3.services.rollout.worker import RolloutWorker, WorkerConfig
from k3.services.trainer.learner import Learner, LearnerConfig

torch.set_num_threads(1)
SHARPNESS = 4.0
GROUPS = 16  # x 8 samples: 128 draws of the first token per update (the estimator is one sample per token)
UPDATES = 8
WIDE_ENGINE = EngineConfig(max_batch=64, max_slots=128, num_pages=1024, max_queue=512, max_context=64)
PROMPT = (100, 101, 102)


class NoSignalEnvironment(LengthEnvironment):
    """One fixed prompt and two-token answers that all score the same: GRPO's advantages are 0, so only the
    teacher teaches, and every trajectory samples the same first-token distribution (many samples of one
    context per update, as the per-token reverse-KL estimator needs to be precise)."""

    def _problem(self, index: int, split: str, effort: str) -> Problem:
        return Problem(self.name, split, index, effort, self.domain, PROMPT, 2)

    def episode(self, problem):
        return SingleTurn(lambda output_ids: Score(0.5, "constant"))


def _teacher_checkpoint(tmp_path, sharpness: float = SHARPNESS):
    teacher, cfg, tok = tiny_policy(seed=1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(sharpness)  # a confident teacher: far from the near-uniform student
    optimizer = PerHeadMuon(teacher.optimizer_groups(), lr=0.0)
    return ckpt.save_checkpoint(tmp_path / "teacher", 0, model=teacher, optimizer=optimizer, model_config=cfg,
                                tokenizer=tok, trainer_state={}), teacher


def _first_token_kl(student, teacher, context) -> float:
    """KL(student || teacher) of the next-token distributions after ``context``: exact, no sampling."""
    with torch.no_grad():
        x = torch.tensor([context])
        ls = torch.log_softmax(student(x).float()[0, -1], -1)
        lt = torch.log_softmax(teacher(x).float()[0, -1], -1)
    return float((ls.exp() * (ls - lt)).sum())


def test_distillation_moves_the_student_towards_the_teacher(tmp_path):
    path, teacher = _teacher_checkpoint(tmp_path)
    bus = open_bus(f"embedded://{tmp_path / 'bus'}")
    student, cfg, tok = tiny_policy(seed=0)
    env = NoSignalEnvironment(tok, EXACT)
    worker = RolloutWorker(
        WorkerConfig(job_id="kd", worker_id="w0", environments=("length",), group_size=8, groups_per_step=GROUPS,
                     max_staleness=1, partial_threshold=1.0, budgets=EXACT, engine=WIDE_ENGINE,
                     weights_wait_s=0.2),
        tiny_policy(seed=0)[0], tok, bus, str(tmp_path / "rollout"), environments={"length": env})
    learner = Learner(LearnerConfig(job_id="kd", job_dir=str(tmp_path / "job"), group_size=8, groups_per_step=GROUPS,
                                    lr=0.02, adamw_lr=0.002, teachers={"test/*": str(path)}, distill_coef=1.0),
                      bus, student, cfg, tok)
    try:
        context = list(worker.step()[0].prompt_ids)
        before = _first_token_kl(student, teacher, context)
        results = [learner.step(timeout_s=60)]
        for _ in range(UPDATES - 1):
            worker.sync_weights(wait_s=5)
            worker.step()
            results.append(learner.step(timeout_s=60))
        assert all(r is not None for r in results)
        assert all(r["advantage_abs"] == 0.0 for r in results)  # no task signal: the teacher is the only one
        assert all(r["distill_advantage"] < 0 for r in results)  # the student's tokens, less likely to the teacher
        after = _first_token_kl(student, teacher, context)
        assert after < 0.8 * before, (before, after)
    finally:
        worker.close()
        learner.close()
        bus.close()


def test_a_trajectory_without_a_teacher_is_dead_lettered_with_the_reason(tmp_path):
    # The job's spec check refuses teachers that do not cover its environments; a record on the topic that
    # claims another domain is untrusted input, refused with the reason while the learner goes on.
    path, _ = _teacher_checkpoint(tmp_path)
    bus = open_bus(f"embedded://{tmp_path / 'bus'}")
    student, cfg, tok = tiny_policy(seed=0)
    worker = RolloutWorker(
        WorkerConfig(job_id="kd2", worker_id="w0", environments=("length",), group_size=2, groups_per_step=2,
                     max_staleness=1, partial_threshold=1.0, budgets=EXACT, engine=SMALL_ENGINE),
        tiny_policy(seed=0)[0], tok, bus, str(tmp_path / "rollout"),
        environments={"length": LengthEnvironment(tok, EXACT, short=3, long=3)})
    learner = Learner(LearnerConfig(job_id="kd2", job_dir=str(tmp_path / "job"), group_size=2, groups_per_step=2,
                                    teachers={"math/*": str(path)}, distill_coef=1.0), bus, student, cfg, tok)
    try:
        published = worker.step()
        assert published and learner.step(timeout_s=3) is None
        consumer = bus.subscribe([DEAD_LETTER_TOPIC], group="check")
        consumer.seek_to_beginning()
        reasons = {rollout_pb2.DeadLetter.FromString(r.value).reason for r in consumer.poll(timeout_s=1.0)}
        consumer.close()
        assert reasons == {"no distillation teacher for domain 'test' at effort 'low'"}
        assert learner.counters["dead_lettered"] >= len(published) and learner.version == 0
    finally:
        worker.close()
        learner.close()
        bus.close()
