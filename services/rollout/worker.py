"""The rollout worker: generation with the shared engine, partial rollout, version tags, publishing.

One ``RolloutWorker`` owns an ``Engine`` over its own copy of the policy. ``step()`` is one rollout round:

1. **Weights.** New ``k3.weights`` events are read; the newest version is loaded into the model. This happens
   only between rounds, when nothing runs in the engine (every unfinished trajectory is paused), so a forward
   pass never sees half-loaded weights.
2. **Admission.** Trajectories paused in earlier rounds are resumed first; then new groups (``group_size``
   samples of one problem) are admitted while AReaL's rule allows (``StalenessGate``; whole groups only).
   Each admitted trajectory gets a ticket in the ``Spool`` before it starts.
3. **Generation.** Every trajectory runs in its own thread, reading its engine stream: each token is recorded
   with its behaviour log-prob and the version of the weights that produced it. Multi-turn environments append
   their tokens (tool results, next generation prompt; loss mask 0) between turns.
4. **Partial rollout.** Once ``partial_threshold`` of the round's trajectories have finished, the others are
   paused (``Engine.pause``): their sequence state (KDA slot + MLA pages) is copied out and saved in the spool,
   and the engine is free. The next round resumes them under whatever weights are current then: the tokens not
   yet run through the model go through ``K3Model.prefill`` on top of the kept state, and generation continues
   with ``load_state`` + ``resume``. The learner's decoupled-PPO loss corrects for the mixed versions.
5. **Publishing.** Each finished trajectory is scored (a verifier that raises gives 0 with the error as the
   reason; the effort budget's overlong penalty is subtracted), published as a ``k3.v1.Trajectory`` on
   ``k3.trajectories`` and its ticket deleted.

``partial_threshold = 1.0`` turns partial rollout off: every round waits for its slowest trajectory.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from k3.model.rl.effort import EffortBudgets
from k3.model.rl.staleness import StalenessGate
from k3.model.state import SequenceState
from k3.protos.v1 import rollout_pb2
from k3.services.engine.config import EngineConfig
from k3.services.engine.engine import Engine, PausedSequence
from k3.services.engine.sampling import SamplingOptions
from k3.services.rollout.codec import TRAJECTORIES_TOPIC, WEIGHTS_TOPIC, decode_weights
from k3.services.rollout.environment import Environment, Episode, Problem, make_environment
from k3.services.rollout.spool import Progress, Spool, Ticket

log = logging.getLogger(__name__)


@dataclass
class WorkerConfig:
    """How one rollout worker generates."""

    job_id: str
    """Job the trajectories belong to (topic keys, ids, the weights events it follows)."""
    worker_id: str = "w0"
    """Stable name of the worker: a replacement with the same id adopts its spool."""
    worker_index: int = 0
    """This worker's position among ``num_workers``; problems are dealt round-robin."""
    num_workers: int = 1
    environments: tuple[str, ...] = ("reasoning_gym/chain_sum",)
    efforts: tuple[str, ...] = ("low",)
    group_size: int = 4
    groups_per_step: int = 2
    """Groups the learner consumes per version, this worker's share (the staleness gate's batch)."""
    max_staleness: int = 1
    partial_threshold: float = 0.75
    """Share of a round's trajectories that must finish before the rest are paused (1.0: wait for all)."""
    temperature: float = 1.0
    seed: int = 0
    budgets: EffortBudgets = field(default_factory=EffortBudgets)
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(max_batch=32, max_slots=64, num_pages=4096,
                                                                      max_queue=256))
    weights_wait_s: float = 0.5
    """How long ``step`` waits for a weight event when the staleness bound admits nothing."""


@dataclass
class _Trajectory:
    ticket: Ticket
    problem: Problem
    episode: Episode
    progress: Progress
    state: SequenceState | None = None
    finish_reason: str = ""
    done: bool = False
    stopped: bool = False
    """Its thread ended without finishing it (paused, or failed)."""
    pause_requested: bool = False
    request_id: str = ""
    segment: int = 0
    error: BaseException | None = None


class RolloutWorker:
    """See the module docstring. Thread-compatible: ``step`` is called from one thread at a time."""

    def __init__(self, config: WorkerConfig, model: Any, tokenizer: Any, bus: Any, spool_root: str,
                 *, weights_loader: Callable[[Any, str], None] | None = None, meter: Any = None,
                 environments: dict[str, Environment] | None = None):
        self.config = config
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.bus = bus
        self.engine = Engine(model, config.engine)
        self.spool = Spool(spool_root, config.worker_id)
        self.gate = StalenessGate(config.max_staleness, config.groups_per_step * config.group_size)
        self.envs = environments or {name: make_environment(name, tokenizer=tokenizer, budgets=config.budgets,
                                                            seed=config.seed)
                                     for name in config.environments}
        self._load_weights = weights_loader or load_safetensors_weights
        self._weights = bus.subscribe([WEIGHTS_TOPIC], group=f"rollout-{config.job_id}-{config.worker_id}")
        self._weights.seek_to_beginning()  # every worker replays the weight history to find the newest
        self.version = 0
        self.final = False
        counters = self.spool.load_counters()
        self.next_group, self.published = counters["next_group"], counters["published"]
        self.paused: list[_Trajectory] = [self._adopt(t, p, s) for t, p, s in self.spool.pending()]
        self.stats = {"rounds": 0, "paused_total": 0, "resumed_total": 0, "adopted": len(self.paused),
                      "verifier_errors": 0}
        self._rl_metrics = _rl_metrics(meter)
        self._cond = threading.Condition()

    # ------------------------------------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._weights.close()
        self.engine.close()

    @property
    def running(self) -> int:
        """Admitted, not yet published (paused included)."""
        return len(self.paused)

    def status(self) -> dict[str, Any]:
        return {"worker_id": self.config.worker_id, "version": self.version, "published": self.published,
                "paused": len(self.paused), "final": self.final,
                "admissible": self.gate.admissible(self.published, len(self.paused), self.version), **self.stats}

    # ------------------------------------------------------------------------------------------------ weights
    def sync_weights(self, wait_s: float = 0.0) -> bool:
        """Load the newest published weights, if newer than ours; True when they changed."""
        newest = None
        deadline = time.monotonic() + wait_s
        while True:
            for record in self._weights.poll(timeout_s=max(0.0, deadline - time.monotonic()) if newest is None
                                             else 0.0):
                event = decode_weights(record.value)
                if event is None or event.job_id != self.config.job_id:
                    continue
                newest = event  # events are in publish order: the last one is the learner's current weights
            if newest is not None or time.monotonic() >= deadline:
                break
        if newest is None:
            return False
        self.final = self.final or newest.final
        if newest.version == self.version:
            return False
        try:
            self._load_weights(self.model, newest.path)
        except FileNotFoundError:
            log.warning("weights of version %d are gone (%s); waiting for a newer version", newest.version,
                        newest.path)
            return False
        self.version = int(newest.version)
        return True

    # ------------------------------------------------------------------------------------------------ one round
    def step(self) -> list[rollout_pb2.Trajectory]:
        """One rollout round (see the module docstring); returns the trajectories it published."""
        cfg = self.config
        self.sync_weights()
        batch = self.paused
        self.paused = []
        for t in batch:
            t.stopped = t.pause_requested = False
        self.stats["resumed_total"] += sum(1 for t in batch if t.progress.output_ids)
        groups = self.gate.admissible(self.published, len(batch), self.version) // cfg.group_size
        for _ in range(groups if not self.final else 0):
            batch += self._admit_group()
        if not batch:
            self.sync_weights(wait_s=cfg.weights_wait_s)
            return []
        self.stats["rounds"] += 1
        threads = [threading.Thread(target=self._run, args=(t,), daemon=True, name=f"rollout-{t.ticket.member}")
                   for t in batch]
        for th in threads:
            th.start()
        need = max(1, math.ceil(cfg.partial_threshold * len(batch) - 1e-9))
        with self._cond:
            self._cond.wait_for(lambda: sum(t.done for t in batch) >= need
                                or all(t.done or t.stopped for t in batch))
            for t in batch:
                if not t.done:
                    t.pause_requested = True
        pauses = [(t, self.engine.pause(t.request_id)) for t in batch if not t.done and t.request_id]
        taken = [(t, future.result()) for t, future in pauses]
        for th in threads:
            th.join()
        for t in batch:
            if t.error is not None:
                raise RuntimeError(f"trajectory {t.ticket.trajectory_id} failed") from t.error
        for t, paused in taken:
            if paused is not None and not t.done:
                self._keep_paused_state(t, paused)
        finished = [t for t in batch if t.done]
        for t in batch:
            if not t.done:
                t.progress.pauses += 1
                self.stats["paused_total"] += 1
                self.spool.pause(t.ticket.trajectory_id, t.progress, t.state)
                self.paused.append(t)
        return [self._publish(t) for t in finished]

    def _keep_paused_state(self, t: _Trajectory, paused: PausedSequence) -> None:
        """Keep the engine's copy of a paused sequence (its thread has read every token event by now)."""
        context = list(t.problem.prompt_ids) + t.progress.output_ids
        if paused.token_ids != context:
            raise RuntimeError(f"paused {t.ticket.trajectory_id}: the engine's tokens disagree with the record")
        t.state = paused.state

    # ------------------------------------------------------------------------------------------------ admission
    def _admit_group(self) -> list[_Trajectory]:
        cfg = self.config
        seq = self.next_group
        index = seq * cfg.num_workers + cfg.worker_index
        env_name = cfg.environments[index % len(cfg.environments)]
        effort = cfg.efforts[(index // len(cfg.environments)) % len(cfg.efforts)]
        group_id = f"{cfg.job_id}/{cfg.worker_id}/g{seq}"
        out = []
        for member in range(cfg.group_size):
            ticket = Ticket(f"{group_id}/{member}", group_id, cfg.group_size, env_name, "train", index // len(
                cfg.environments), effort, seq, member)
            self.spool.admit(ticket)
            out.append(self._adopt(ticket, None, None))
        self.next_group += 1
        self.spool.save_counters(self.next_group, self.published)
        return out

    def _adopt(self, ticket: Ticket, progress: Progress | None, state) -> _Trajectory:
        env = self.envs.get(ticket.environment)
        if env is None:
            raise ValueError(f"ticket {ticket.trajectory_id} needs environment {ticket.environment!r}, which this "
                             f"worker does not run")
        problem = env.problem(ticket.index, ticket.split, ticket.effort)
        episode = env.episode(problem)
        if progress is not None and progress.turn_start > 0:
            # A multi-turn episode's conversation lives in memory only: start it again from the prompt.
            progress, state = None, None
        return _Trajectory(ticket, problem, episode, progress or Progress(), state)

    # ------------------------------------------------------------------------------------------------ generation
    def _run(self, t: _Trajectory) -> None:
        try:
            self._generate(t)
        except BaseException as exc:  # surfaced by step(); never leave the round waiting
            t.error = exc
        finally:
            with self._cond:
                t.stopped = not t.done
                self._cond.notify_all()

    def _sampling(self, t: _Trajectory, env: Environment, room: int) -> SamplingOptions:
        key = f"{self.config.seed}:{t.ticket.trajectory_id}:{t.segment}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1
        return SamplingOptions(temperature=self.config.temperature, max_tokens=room,
                               stop_token_ids=env.stop_token_ids, seed=seed)

    def _generate(self, t: _Trajectory) -> None:
        env = self.envs[t.ticket.environment]
        limit = self.config.budgets.limit(t.problem.token_budget)
        prompt = list(t.problem.prompt_ids)
        while True:
            room = min(limit - t.progress.generated,
                       self.config.engine.max_context - len(prompt) - len(t.progress.output_ids) - 1)
            if room <= 0:
                self._finish(t, "length")
                return
            with self._cond:
                if t.pause_requested:
                    return
                t.segment += 1
                t.request_id = f"{t.ticket.trajectory_id}#{t.segment}"
                stream = self._start(t, prompt, self._sampling(t, env, room))
            version = self.version
            finish = ""
            for event in stream:
                if event.token_id is not None:
                    p = t.progress
                    p.output_ids.append(event.token_id)
                    p.behaviour_logprobs.append(float(event.logprob))
                    p.versions.append(version)
                    p.loss_mask.append(1)
                    p.generated += 1
                finish = event.finish_reason or finish
            if finish in ("pause", "abort"):
                return
            turn = t.progress.output_ids[t.progress.turn_start:]
            inserted = t.episode.after_turn(turn, finish)
            if not inserted or finish != "stop":
                self._finish(t, finish or "stop")
                return
            p = t.progress
            p.output_ids += inserted
            p.behaviour_logprobs += [0.0] * len(inserted)
            p.versions += [self.version] * len(inserted)
            p.loss_mask += [0] * len(inserted)
            p.turn_start = len(p.output_ids)

    def _start(self, t: _Trajectory, prompt: list[int], sampling: SamplingOptions):
        """Submit a fresh turn, or continue a paused one on top of its kept state (lock held)."""
        context = prompt + t.progress.output_ids
        state, t.state = t.state, None
        if state is None:
            return self.engine.submit(context, sampling, request_id=t.request_id)
        # The tokens after the kept state (at least the last sampled one) run under the current weights.
        rest = torch.tensor(context[state.num_tokens:], dtype=torch.long)
        with torch.inference_mode():
            logits, state = self.model.prefill(rest, state)
        self.engine.load_state(t.request_id, state, logits[-1], context)
        return self.engine.resume(t.request_id, sampling)

    def _finish(self, t: _Trajectory, reason: str) -> None:
        with self._cond:
            t.finish_reason = reason
            t.done = True
            self._cond.notify_all()

    # ------------------------------------------------------------------------------------------------ publishing
    def _publish(self, t: _Trajectory) -> rollout_pb2.Trajectory:
        p, problem = t.progress, t.problem
        try:
            score = t.episode.score(p.output_ids)
            verifier, reason = float(score.value), score.reason
            if not 0.0 <= verifier <= 1.0 or math.isnan(verifier):
                raise ValueError(f"verifier score {verifier} is outside [0, 1]")
        except Exception as exc:  # a verifier bug costs this trajectory its reward, never the worker
            verifier, reason = 0.0, f"verifier raised {type(exc).__name__}: {exc}"
            self.stats["verifier_errors"] += 1
        penalty = self.config.budgets.penalty_for(p.generated, problem.token_budget)
        msg = rollout_pb2.Trajectory(
            id=t.ticket.trajectory_id, job_id=self.config.job_id, group_id=t.ticket.group_id,
            prompt_ids=problem.prompt_ids, output_ids=p.output_ids, behaviour_logprobs=p.behaviour_logprobs,
            versions=p.versions, reward=verifier - penalty, environment=problem.environment, effort=problem.effort,
            loss_mask=p.loss_mask, problem_id=problem.problem_id, group_size=t.ticket.group_size,
            verifier_score=verifier, penalty=penalty, reward_reason=reason, domain=problem.domain,
            finish_reason=t.finish_reason, worker_id=self.config.worker_id, pauses=p.pauses,
            token_budget=problem.token_budget,
        )
        self.bus.publish(TRAJECTORIES_TOPIC, msg.SerializeToString(), key=t.ticket.group_id.encode())
        self.published += 1
        self.spool.done(t.ticket.trajectory_id)
        self.spool.save_counters(self.next_group, self.published)
        if self._rl_metrics is not None:
            self._rl_metrics.record_reward(verifier, task=problem.environment)
        return msg


def _rl_metrics(meter: Any):
    if meter is None:
        return None
    try:
        from k3.services.common.rl_metrics import RLMetrics
    except ImportError:  # telemetry catalogue without the RL helpers: record nothing
        return None
    return RLMetrics(meter)


def load_safetensors_weights(model: Any, path: str) -> None:
    """Load a weights file written by the learner (``model.safetensors`` of a checkpoint) strictly."""
    from safetensors.torch import load_model

    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    missing, unexpected = load_model(model, path, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the model (missing {sorted(missing)[:3]}, unexpected "
                         f"{sorted(unexpected)[:3]})")


def evaluate_problems(engine: Engine, envs: dict[str, Environment], problems: Sequence[Problem],
                      budgets: EffortBudgets, *, version: int = 0) -> list[float]:
    """Greedy verifier scores of ``problems`` on ``engine`` (single- and multi-turn): the held-out metric."""
    results: list[float] = [0.0] * len(problems)

    def one(i: int, problem: Problem) -> None:
        env = envs[problem.environment]
        episode = env.episode(problem)
        limit = budgets.limit(problem.token_budget)
        output: list[int] = []
        generated, turn_start = 0, 0
        while True:
            room = min(limit - generated, engine.config.max_context - len(problem.prompt_ids) - len(output) - 1)
            if room <= 0:
                break
            done = engine.submit(list(problem.prompt_ids) + output,
                                 SamplingOptions(temperature=0.0, max_tokens=room,
                                                 stop_token_ids=env.stop_token_ids)).result()
            output += done.token_ids
            generated += len(done.token_ids)
            inserted = episode.after_turn(output[turn_start:], done.finish_reason)
            if not inserted or done.finish_reason != "stop":
                break
            output += inserted
            turn_start = len(output)
        try:
            results[i] = float(episode.score(output).value)
        except Exception:
            results[i] = 0.0

    threads = [threading.Thread(target=one, args=(i, p), daemon=True) for i, p in enumerate(problems)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results
