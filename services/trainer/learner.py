"""The RL learner: consumes ``k3.trajectories``, learns with decoupled PPO + GRPO, publishes weight versions.

One ``Learner.step()``:

1. **Consume.** Records are polled from ``k3.trajectories`` in the job's consumer group. Each is parsed, other
   jobs' trajectories (the topic is shared) are skipped and counted, and ours are validated
   (``codec.validate_trajectory``); a malformed one or one claiming a version the learner has not published
   goes to ``k3.trajectories.dlq`` as a ``DeadLetter`` with the reason, and the learner keeps going.
   Trajectories already learned from (their id is in the learned set) are skipped: the bus delivers at least
   once and a worker may publish a trajectory twice.
2. **Group.** Trajectories wait until their GRPO group is complete; a batch is the first ``groups_per_step``
   complete groups.
3. **Staleness.** A group is learned from only if every policy token of every member is at most
   ``max_staleness`` versions older than the learner; otherwise it is dropped (counted, never learned). The
   staleness of every token learned from is recorded in the step's ledger, so the bound can be checked after
   the fact.
4. **Learn.** Proximal log-probs are recomputed with the current weights (no gradient), GRPO advantages from
   the rewards (plus, with teachers, the per-token reverse-KL distillation advantage), then the decoupled-PPO
   loss over ``minibatches`` minibatches, each one Per-Head Muon step. The version advances by one.
5. **Checkpoint, then publish, then commit.** The checkpoint (weights, optimizer, version, the learned ids, the
   offset to resume reading from, the ledger) is written atomically; only then is the new version announced
   on ``k3.weights`` (its path is the checkpoint's ``model.safetensors``) and the consumer's offsets committed.

Where a new learner starts: ``LearnerConfig.read_from_ms`` (RL jobs set it to when their learner starts, less
a minute of clock skew; workers start after it) skips the records other jobs published to the shared topic
before this job existed.

Idempotency: a restarted learner loads its latest checkpoint, seeks every partition to the checkpoint's resume
offset (the first record not yet learned from; groups still incomplete at the checkpoint are read again) and skips every
id in the checkpoint's learned set. Updates made after the last checkpoint died with the process and their
trajectories are learned again, once, in the surviving lineage; since a version is published only after its
checkpoint, no worker ever holds weights of a lost lineage.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3.model import checkpoint as ckpt
from k3.model.rl.advantages import grpo_advantages
from k3.model.rl.distill import TeacherSet, reverse_kl_advantage, sequence_logprobs
from k3.model.rl.ppo import decoupled_ppo_loss
from k3.protos.v1 import rollout_pb2
from k3.services.rollout.codec import (
    DEAD_LETTER_TOPIC,
    TRAJECTORIES_TOPIC,
    WEIGHTS_TOPIC,
    MalformedTrajectory,
    encode_weights,
    parse_trajectory,
    validate_trajectory,
)

log = logging.getLogger(__name__)


@dataclass
class LearnerConfig:
    """How the learner learns (the RL job fills it from ``RLJobConfig``)."""

    job_id: str
    job_dir: str
    """Checkpoints go to ``job_dir`` itself (``checkpoint-V``, ``latest``)."""
    group_size: int = 4
    groups_per_step: int = 2
    """Complete GRPO groups per update."""
    max_staleness: int = 1
    lr: float = 0.002
    """Muon learning rate (matrices)."""
    adamw_lr: float = 0.0005
    """AdamW learning rate (embeddings, norms, vectors)."""
    weight_decay: float = 0.0
    clip_eps: float = 0.2
    weight_cap: float = 2.0
    """Cap of the behaviour importance weight π_prox/π_behav."""
    minibatches: int = 1
    """Optimizer steps per batch (ratios move off 1 after the first)."""
    scale_adv_by_std: bool = True
    grad_clip: float = 1.0
    keep_last: int = 3
    """Checkpoints kept (workers may still be loading an older version's weights)."""
    seed: int = 0
    teachers: dict[str, str] = field(default_factory=dict)
    """``"domain/effort"`` (effort may be ``*``) -> checkpoint of the teacher for on-policy distillation."""
    distill_coef: float = 0.0
    """Weight of the per-token reverse-KL advantage (0: no distillation)."""
    read_from_ms: int | None = None
    """Where a learner without a checkpoint starts reading ``k3.trajectories``: at the first record published
    at or after this time (ms since the Unix epoch), found per partition with ``offsets_for_time``. The topic is
    shared by every job, so a new job's learner would otherwise read (and skip) the whole history of the jobs
    before it. None: from the beginning of the topic. A learner with a checkpoint resumes at the checkpoint's
    offsets either way."""


class Learner:
    """See the module docstring."""

    def __init__(self, config: LearnerConfig, bus: Any, model: torch.nn.Module, model_config: Any, tokenizer: Any,
                 *, meter: Any = None):
        from k3.model.muon import PerHeadMuon

        self.config = config
        self.bus = bus
        self.model = model
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.run_dir = Path(config.job_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.optimizer = PerHeadMuon(model.optimizer_groups(), lr=config.lr, adamw_lr=config.adamw_lr,
                                     weight_decay=config.weight_decay)
        self.version = 0
        self.accepted = 0
        self.learned: set[str] = set()
        self.ledger: list[dict[str, Any]] = []
        self.counters = {"dead_lettered": 0, "duplicates": 0, "dropped_stale": 0, "foreign": 0}
        self._buffer: OrderedDict[str, dict[str, tuple[tuple[int, int], rollout_pb2.Trajectory]]] = OrderedDict()
        self._next_offset: dict[int, int] = {}
        """Partition -> the offset after the last record read from it."""
        self._teachers = self._load_teachers()
        self._rl_metrics = _rl_metrics(meter)
        self._consumer = bus.subscribe([TRAJECTORIES_TOPIC], group=f"learner-{config.job_id}")
        latest = ckpt.latest_checkpoint(self.run_dir)
        if latest is None:
            if config.read_from_ms is not None:
                self._start_at_time(config.read_from_ms)
            self._checkpoint_and_publish()  # version 0: the starting weights, so workers know where they are
        else:
            self._restore(latest)

    # ------------------------------------------------------------------------------------------------ state
    def _restore(self, path: Path) -> None:
        state = ckpt.load_training_state(path, self.model, self.optimizer)
        self.version = int(state["version"])
        self.accepted = int(state["accepted"])
        self.learned = set(state["learned_ids"])
        self.ledger = list(state["ledger"])
        self.counters.update(state["counters"])
        self._next_offset = {int(p): int(o) for p, o in state["resume_offsets"].items()}
        for partition, offset in self._next_offset.items():
            self._consumer.seek(TRAJECTORIES_TOPIC, partition, offset)
        log.info("learner resumed at version %d from %s (offsets %s)", self.version, path, self._next_offset)

    def _start_at_time(self, timestamp_ms: int) -> None:
        """Seeks every partition to its first record published at or after ``timestamp_ms``; the version-0
        checkpoint records these positions, so a learner restarted from it does not rescan the topic either."""
        self._next_offset = self._consumer.offsets_for_time(TRAJECTORIES_TOPIC, timestamp_ms)
        for partition, offset in self._next_offset.items():
            self._consumer.seek(TRAJECTORIES_TOPIC, partition, offset)
        log.info("learner starts reading %s at offsets %s (records published from %d ms)", TRAJECTORIES_TOPIC,
                 self._next_offset, timestamp_ms)

    def _resume_offsets(self) -> dict[str, int]:
        """Per partition, the first record not yet learned from (JSON keys are strings)."""
        out = dict(self._next_offset)
        for group in self._buffer.values():
            for (partition, offset), _ in group.values():
                out[partition] = min(out.get(partition, offset), offset)
        return {str(p): o for p, o in sorted(out.items())}

    def _checkpoint_and_publish(self, final: bool = False) -> Path:
        path = ckpt.save_checkpoint(
            self.run_dir, self.version, model=self.model, optimizer=self.optimizer, model_config=self.model_config,
            tokenizer=self.tokenizer, keep_last=self.config.keep_last,
            trainer_state={"version": self.version, "accepted": self.accepted,
                           "learned_ids": sorted(self.learned), "resume_offsets": self._resume_offsets(),
                           "ledger": self.ledger, "counters": self.counters, "job_id": self.config.job_id},
        )
        self.publish_weights(path, final)
        self._consumer.commit()
        return path

    def publish_weights(self, path: Path | None = None, final: bool = False) -> None:
        path = path or ckpt.latest_checkpoint(self.run_dir)
        self.bus.publish(WEIGHTS_TOPIC, encode_weights(self.config.job_id, self.version,
                                                       str(path / "model.safetensors"), self.accepted, final),
                         key=self.config.job_id.encode())

    @property
    def checkpoint(self) -> Path | None:
        return ckpt.latest_checkpoint(self.run_dir)

    def close(self) -> None:
        self._consumer.close()

    # ------------------------------------------------------------------------------------------------ consuming
    def _dead_letter(self, record: Any, reason: str) -> None:
        self.counters["dead_lettered"] += 1
        log.warning("dead-lettering %s@%d: %s", record.topic, record.offset, reason)
        self.bus.publish(DEAD_LETTER_TOPIC, rollout_pb2.DeadLetter(
            topic=record.topic, partition=record.partition, offset=record.offset, value=record.value,
            reason=reason).SerializeToString())

    def _ingest(self, record: Any) -> None:
        self._next_offset[record.partition] = max(self._next_offset.get(record.partition, 0), record.offset + 1)
        try:
            t = parse_trajectory(record.value)
            if t.job_id != self.config.job_id:  # the topic is shared by every job: not ours, not bad
                self.counters["foreign"] += 1
                return
            validate_trajectory(t, self.model_config.vocab_size)
        except MalformedTrajectory as exc:
            self._dead_letter(record, str(exc))
            return
        if t.group_size != self.config.group_size:
            self._dead_letter(record, f"group_size {t.group_size}, the job's is {self.config.group_size}")
            return
        if self._teachers is not None and self.config.distill_coef and not self._teachers.has(t.domain, t.effort):
            self._dead_letter(record, f"no distillation teacher for domain {t.domain!r} at effort {t.effort!r}")
            return
        if max(t.versions) > self.version:
            self._dead_letter(record, f"a token claims version {max(t.versions)}; the learner is at {self.version}")
            return
        group = self._buffer.setdefault(t.group_id, {})
        if t.id in self.learned or t.id in group:
            self.counters["duplicates"] += 1
            return
        group[t.id] = ((record.partition, record.offset), t)

    def _ready_groups(self) -> list[str]:
        return [g for g, members in self._buffer.items() if len(members) >= self.config.group_size]

    def poll(self, timeout_s: float) -> int:
        """Read what is available (waiting at most ``timeout_s`` for the first record); returns records read."""
        records = self._consumer.poll(timeout_s=timeout_s, max_records=500)
        for record in records:
            self._ingest(record)
        return len(records)

    # ------------------------------------------------------------------------------------------------ learning
    def step(self, timeout_s: float = 30.0) -> dict[str, Any] | None:
        """One update once ``groups_per_step`` complete groups are in; None if they did not come in time."""
        deadline = time.monotonic() + timeout_s
        while len(self._ready_groups()) < self.config.groups_per_step:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.poll(min(left, 0.5))
        started = time.monotonic()
        chosen = self._ready_groups()[: self.config.groups_per_step]
        batch: list[rollout_pb2.Trajectory] = []
        staleness: list[int] = []
        dropped: list[str] = []
        for g in chosen:
            members = [t for _, t in self._buffer.pop(g).values()]
            worst = max(self.version - min(v for v, m in zip(t.versions, t.loss_mask, strict=True) if m)
                        for t in members)
            self.accepted += len(members)
            if worst > self.config.max_staleness:
                self.counters["dropped_stale"] += len(members)
                dropped += [t.id for t in members]  # consumed (as dropped): never learned later either
                continue
            batch += members
            staleness += [self.version - min(v for v, m in zip(t.versions, t.loss_mask, strict=True) if m)
                          for t in members]
        metrics = self._learn(batch) if batch else {"loss": 0.0}
        self.ledger.append({"version": self.version, "ids": [t.id for t in batch],
                            "staleness": staleness, "dropped_ids": dropped})
        self.learned.update(t.id for t in batch)
        self.learned.update(dropped)
        if self._rl_metrics is not None:
            for t in batch:
                self._rl_metrics.record_staleness(self.version, min(v for v, m in zip(t.versions, t.loss_mask,
                                                                                     strict=True) if m))
        self.version += 1
        path = self._checkpoint_and_publish()
        rewards = [t.reward for t in batch]
        return {
            "version": self.version, "trajectories": len(batch), "checkpoint": str(path),
            "reward": sum(rewards) / len(rewards) if rewards else 0.0,
            "verifier_score": sum(t.verifier_score for t in batch) / len(batch) if batch else 0.0,
            "staleness_max": max(staleness, default=0),
            "tokens": sum(sum(t.loss_mask) for t in batch),
            "paused_trajectories": sum(1 for t in batch if t.pauses),
            "mean_length": sum(len(t.output_ids) for t in batch) / len(batch) if batch else 0.0,
            "step_s": time.monotonic() - started, **metrics, **{k: float(v) for k, v in self.counters.items()},
        }

    def _pack(self, batch: list[rollout_pb2.Trajectory]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  list[slice]]:
        """One packed row: ids [1, N], cu_seqlens, the positions predicting each output token, their slices."""
        ids, cu, positions, spans = [], [0], [], []
        for t in batch:
            start = len(ids)
            ids += list(t.prompt_ids) + list(t.output_ids)
            first = start + len(t.prompt_ids) - 1  # the position whose logits predict output token 0
            spans.append(slice(len(positions), len(positions) + len(t.output_ids)))
            positions += range(first, first + len(t.output_ids))
            cu.append(len(ids))
        return (torch.tensor([ids], dtype=torch.long), torch.tensor(cu, dtype=torch.long),
                torch.tensor(positions, dtype=torch.long), spans)

    def _token_logprobs(self, model: torch.nn.Module, batch: list[rollout_pb2.Trajectory]) -> torch.Tensor:
        ids, cu, positions, _ = self._pack(batch)
        device = next(model.parameters()).device
        logits = model(ids.to(device), cu.to(device))[0, positions.to(device)]
        targets = torch.tensor([x for t in batch for x in t.output_ids], dtype=torch.long, device=device)
        return sequence_logprobs(logits, targets)

    def _learn(self, batch: list[rollout_pb2.Trajectory]) -> dict[str, float]:
        cfg = self.config
        self.model.train()
        with torch.no_grad():
            prox = self._token_logprobs(self.model, batch)
        behav = torch.tensor([x for t in batch for x in t.behaviour_logprobs], dtype=torch.float32)
        mask = torch.tensor([x for t in batch for x in t.loss_mask], dtype=torch.float32)
        adv_seq = grpo_advantages([t.reward for t in batch], [t.group_id for t in batch],
                                  scale_by_std=cfg.scale_adv_by_std)
        lengths = [len(t.output_ids) for t in batch]
        adv = torch.repeat_interleave(adv_seq, torch.tensor(lengths))
        distill = 0.0
        if self._teachers is not None and cfg.distill_coef:
            kl_adv = torch.zeros_like(adv)
            offsets = [0]
            for n in lengths:
                offsets.append(offsets[-1] + n)
            by_teacher: dict[int, list[int]] = {}
            for i, t in enumerate(batch):
                by_teacher.setdefault(id(self._teachers.for_trajectory(t.domain, t.effort)), []).append(i)
            for members in by_teacher.values():
                teacher = self._teachers.for_trajectory(batch[members[0]].domain, batch[members[0]].effort)
                with torch.no_grad():
                    t_logp = self._token_logprobs(teacher, [batch[i] for i in members])
                pos = 0
                for i in members:
                    n = lengths[i]
                    sl = slice(offsets[i], offsets[i] + n)
                    kl_adv[sl] = reverse_kl_advantage(prox[sl], t_logp[pos:pos + n], mask[sl])
                    pos += n
            distill = float((kl_adv * mask).sum() / mask.sum().clamp_min(1))
            adv = adv + cfg.distill_coef * kl_adv
        order = list(range(len(batch)))
        chunks = [order[i::cfg.minibatches] for i in range(cfg.minibatches) if order[i::cfg.minibatches]]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        losses, clip_fracs, weights, grad_norms = [], [], [], []
        for chunk in chunks:
            sel = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in chunk])
            logp = self._token_logprobs(self.model, [batch[i] for i in chunk])
            loss, stats = decoupled_ppo_loss(logp, prox[sel], behav[sel], adv[sel], mask[sel],
                                             clip_eps=cfg.clip_eps, weight_cap=cfg.weight_cap)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"the RL loss became {loss.item()} at version {self.version}")
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)))
            self.optimizer.step()
            losses.append(float(loss.detach()))
            clip_fracs.append(stats.clip_fraction)
            weights.append(stats.mean_weight)
        self.model.eval()
        return {"loss": sum(losses) / len(losses), "clip_fraction": sum(clip_fracs) / len(clip_fracs),
                "importance_weight": sum(weights) / len(weights), "grad_norm": max(grad_norms),
                "advantage_abs": float(adv_seq.abs().mean()), "distill_advantage": distill}

    def _load_teachers(self) -> TeacherSet | None:
        if not self.config.teachers:
            return None
        loaded: dict[tuple[str, str], torch.nn.Module] = {}
        for key, path in self.config.teachers.items():
            domain, _, effort = key.partition("/")
            teacher, teacher_config, _ = ckpt.load_model(path)
            if teacher_config.vocab_size != self.model_config.vocab_size:
                raise ValueError(f"teachers.{key}: vocabulary {teacher_config.vocab_size} differs from the "
                                 f"student's {self.model_config.vocab_size}")
            loaded[(domain, effort)] = teacher.requires_grad_(False)
        return TeacherSet(loaded)

    # ------------------------------------------------------------------------------------------------ eval
    def evaluate(self, problems: list, envs: dict, budgets: Any) -> float:
        """Mean greedy verifier score of the current weights on held-out ``problems``."""
        from k3.services.engine.config import EngineConfig
        from k3.services.engine.engine import Engine
        from k3.services.rollout.worker import evaluate_problems

        self.model.eval()
        engine = Engine(self.model, EngineConfig(max_batch=32, max_slots=64, num_pages=4096, max_queue=256))
        try:
            with torch.inference_mode():
                scores = evaluate_problems(engine, envs, problems, budgets)
        finally:
            engine.close()
        return sum(scores) / len(scores) if scores else 0.0


def _rl_metrics(meter: Any):
    if meter is None:
        return None
    try:
        from k3.services.common.rl_metrics import RLMetrics
    except ImportError:
        return None
    return RLMetrics(meter)
