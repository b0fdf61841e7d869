"""An RL job: rollout-worker actors and a learner actor on Ray, joined by the event bus.

``run_rl_job(RLJobConfig, report=..., cancelled=...)`` is the entry point the Jobs service calls (inside its
job actor) and that scripts and tests call directly.

Layout of ``job_dir``: the learner's checkpoints (``checkpoint-V/`` with ``model.safetensors``, ``latest``;
V is the weight version), ``rollout/<worker_id>/`` (each worker's spool of admitted and paused trajectories),
``bus/`` (the embedded event log when no ``bus_url`` is given) and ``rl_metrics.jsonl`` (every reported
event).

Design decisions:

- Rollouts and learning run concurrently: workers generate in their own actors as fast as the staleness bound
  lets them, the learner consumes; they share nothing but ``k3.trajectories`` and ``k3.weights``.
- The driver (this function) only steers: it asks the learner for one update at a time (so it can report,
  evaluate and notice ``cancelled()`` between updates), and watches the actors. A dead worker is replaced by
  one with the same ``worker_id``, which adopts the dead one's spool (nothing admitted is lost); a dead learner
  is replaced by one that resumes from the latest checkpoint (nothing is learned twice; see ``learner``).
- Resuming a job is starting it again on the same ``job_dir``: the learner continues from its latest
  checkpoint, workers from their spools.
- ``from_dict`` errors are ``ValueError``s whose message starts with the field's name, for the Jobs API's
  INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3.model.rl.effort import EFFORT_LEVELS, EffortBudgets

log = logging.getLogger(__name__)

# A new job's learner reads k3.trajectories from the records published since it started, less this much:
# the job's workers start after the learner, but their machines' clocks stamp the records.
_CLOCK_SKEW_MS = 60_000


@dataclass
class RLJobConfig:
    """An RL job. Exactly one of ``preset`` and ``checkpoint`` names the starting policy."""

    preset: str | None = None
    """Model preset to start from with fresh weights (``tiny``, ``small``)."""
    checkpoint: str | None = None
    """Checkpoint (or run folder) to start from, e.g. an SFT run."""
    environments: list[str] = field(default_factory=lambda: ["reasoning_gym/chain_sum"])
    """Environments problems are dealt from, round-robin (``k3.services.rollout.environment``)."""
    steps: int = 20
    """Learner updates (weight versions) of the whole job."""
    prompts_per_step: int = 4
    """GRPO groups (distinct problems) per update."""
    group_size: int = 4
    """Samples per problem; the group's mean reward is the baseline."""
    efforts: list[str] = field(default_factory=lambda: ["low"])
    """Thinking-effort levels problems are asked at, round-robin."""
    effort_budgets: dict[str, Any] = field(default_factory=dict)
    """Overrides of ``EffortBudgets`` (``low``/``high``/``max`` token budgets, ``allowed_multiple``, ``penalty``)."""
    max_staleness: int = 1
    """Most versions a learned token may lag the learner (AReaL's η)."""
    optimizer: str = "per_head_muon"
    """Only Per-Head Muon (AdamW for vectors and embeddings) is supported."""
    lr: float = 0.002
    """Muon learning rate."""
    adamw_lr: float = 0.0005
    """AdamW learning rate of embeddings, norms and vectors."""
    weight_decay: float = 0.0
    clip_eps: float = 0.2
    """PPO clip range of π_θ/π_prox."""
    weight_cap: float = 2.0
    """Cap of the behaviour importance weight π_prox/π_behav."""
    minibatches: int = 1
    """Optimizer steps per update."""
    grad_clip: float = 1.0
    partial_rollout_threshold: float = 0.75
    """Share of a rollout round's trajectories that must finish before the rest are paused; 1.0 = off."""
    temperature: float = 1.0
    """Sampling temperature of rollouts."""
    num_workers: int = 1
    """Rollout-worker actors."""
    eval_size: int = 32
    """Held-out problems of the evaluation (greedy, verifier score)."""
    eval_interval: int = 5
    """Evaluate every N updates (and at the start and the end); 0 = start and end only."""
    seed: int = 0
    bus_url: str | None = None
    """``kafka://host:port`` or ``embedded:///dir``; default: the embedded log in ``job_dir/bus``."""
    job_dir: str | None = None
    """Where the job writes (set by the Jobs service); required to run."""
    job_id: str | None = None
    """Name of the job on the bus (topic keys, consumer groups); default: derived from ``job_dir``."""
    otlp_endpoint: str | None = None
    """OTLP/gRPC collector (host:port) the actors push their metrics to (``k3.rl.reward`` from the rollout
    workers as ``k3-rl-rollout``, ``k3.rl.staleness`` from the learner as ``k3-rl-learner``); set by the
    trainer from its own ``server.otlp_endpoint``; None: the actors record nothing."""
    threads: int = 1
    """torch threads per actor process."""
    step_timeout_s: float = 600.0
    """Longest wait for one update's trajectories before the job fails."""
    teachers: dict[str, str] = field(default_factory=dict)
    """On-policy distillation teachers: ``"domain/effort"`` (effort may be ``*``) -> checkpoint."""
    distill_coef: float = 0.0
    """Weight of the per-token reverse-KL advantage (0: no distillation)."""
    actor_num_cpus: float = 0.0
    """Ray CPUs reserved per worker / learner actor (0 lets them share the job's)."""

    # ------------------------------------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RLJobConfig:
        """Validated config; ``ValueError`` starting with the offending field's name otherwise."""
        if not isinstance(d, dict):
            raise ValueError(f"the RL job spec must be an object, got {type(d).__name__}")
        names = {f.name: f for f in dataclasses.fields(cls)}
        for key in d:
            if key not in names:
                raise ValueError(f"{key}: unknown field of an RL job (known: {', '.join(sorted(names))})")
        cfg = cls(**{k: v for k, v in d.items() if v is not None or k in ("preset", "checkpoint", "bus_url",
                                                                           "job_dir", "job_id", "otlp_endpoint")})
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {what}, got {getattr(self, name)!r}")

        def is_int(v: Any, low: int) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= low

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")

        if (self.preset is None) == (self.checkpoint is None):
            raise ValueError("preset: set exactly one of preset and checkpoint (the starting policy)")
        if self.preset is not None:
            from k3.model.presets import PRESETS

            need(self.preset in ("tiny", "small"), "preset", f"must be tiny or small (CPU presets; all: "
                 f"{', '.join(PRESETS)})")
        if self.checkpoint is not None:
            need(isinstance(self.checkpoint, str) and bool(self.checkpoint), "checkpoint", "must be a path")
            from k3.model.checkpoint import CheckpointError, resolve_checkpoint

            try:
                resolve_checkpoint(self.checkpoint)
            except CheckpointError as exc:
                raise ValueError(f"checkpoint: {exc}") from None
        need(isinstance(self.environments, list) and bool(self.environments)
             and all(isinstance(e, str) for e in self.environments), "environments",
             "must be a non-empty list of environment names")
        from k3.services.rollout.environment import environment_names

        known = environment_names()
        for name in self.environments:
            if name not in known:
                raise ValueError(f"environments: unknown environment {name!r} (known: {', '.join(known)})")
        need(len(set(self.environments)) == len(self.environments), "environments", "must not repeat a name")
        for name, low in (("steps", 1), ("prompts_per_step", 1), ("group_size", 2), ("max_staleness", 0),
                          ("minibatches", 1), ("num_workers", 1), ("eval_size", 0), ("eval_interval", 0),
                          ("seed", 0), ("threads", 1)):
            need(is_int(getattr(self, name), low), name, f"must be an integer >= {low}")
        need(self.minibatches <= self.prompts_per_step * self.group_size, "minibatches",
             "must not exceed the trajectories of an update (prompts_per_step x group_size)")
        need(self.prompts_per_step % self.num_workers == 0, "num_workers",
             "must divide prompts_per_step (each worker produces an equal share of every update)")
        need(isinstance(self.efforts, list) and bool(self.efforts) and all(e in EFFORT_LEVELS for e in self.efforts),
             "efforts", f"must be a non-empty list of {', '.join(EFFORT_LEVELS)}")
        need(isinstance(self.effort_budgets, dict), "effort_budgets", "must be an object")
        try:
            self.budgets()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"effort_budgets: {exc}") from None
        need(self.optimizer == "per_head_muon", "optimizer", "must be per_head_muon")
        for name in ("lr", "adamw_lr"):
            need(is_num(getattr(self, name)) and getattr(self, name) > 0, name, "must be a number > 0")
        need(is_num(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "must be a number >= 0")
        need(is_num(self.clip_eps) and 0 < self.clip_eps < 1, "clip_eps", "must be in (0, 1)")
        need(is_num(self.weight_cap) and self.weight_cap >= 1, "weight_cap", "must be a number >= 1")
        need(is_num(self.grad_clip) and self.grad_clip >= 0, "grad_clip", "must be a number >= 0 (0 = off)")
        need(is_num(self.partial_rollout_threshold) and 0 < self.partial_rollout_threshold <= 1,
             "partial_rollout_threshold", "must be in (0, 1]")
        need(is_num(self.temperature) and 0 < self.temperature <= 10, "temperature", "must be in (0, 10]")
        need(is_num(self.step_timeout_s) and self.step_timeout_s > 0, "step_timeout_s", "must be a number > 0")
        need(is_num(self.distill_coef) and self.distill_coef >= 0, "distill_coef", "must be a number >= 0")
        need(is_num(self.actor_num_cpus) and self.actor_num_cpus >= 0, "actor_num_cpus", "must be a number >= 0")
        need(isinstance(self.teachers, dict) and all(
            isinstance(k, str) and re.fullmatch(r"[a-z_]+/(low|high|max|\*)", k) and isinstance(v, str)
            for k, v in self.teachers.items()), "teachers", 'must map "domain/effort" to checkpoint paths')
        need(not self.distill_coef or bool(self.teachers), "distill_coef", "needs teachers")
        if self.distill_coef:
            self._check_teacher_coverage()
        if self.bus_url is not None:
            need(isinstance(self.bus_url, str) and (self.bus_url.startswith("kafka://")
                                                     or self.bus_url.startswith("embedded:///")), "bus_url",
                 "must be kafka://host:port[,host:port] or embedded:///absolute/path")
        if self.otlp_endpoint is not None:
            need(isinstance(self.otlp_endpoint, str) and re.fullmatch(r"[^\s:/]+:\d{1,5}", self.otlp_endpoint)
                 is not None, "otlp_endpoint", "must be host:port")
        if self.job_id is not None:
            need(isinstance(self.job_id, str) and re.fullmatch(r"[A-Za-z0-9._-]{1,100}", self.job_id) is not None,
                 "job_id", "must be 1-100 letters, digits, '.', '_' or '-'")

    def budgets(self) -> EffortBudgets:
        return EffortBudgets.from_dict(self.effort_budgets)

    def resolved_job_id(self) -> str:
        if self.job_id:
            return self.job_id
        name = re.sub(r"[^A-Za-z0-9._-]", "-", Path(self.job_dir or "rl").resolve().name)[:100]
        return name or "rl"

    def _check_teacher_coverage(self) -> None:
        """Every (environment's domain, effort) the job samples must have a teacher: found at submission,
        not as a trajectory the learner cannot score."""
        from k3.model.rl.distill import TeacherSet
        from k3.services.rollout.environment import environment_domain

        teachers = TeacherSet({tuple(key.split("/")): path for key, path in self.teachers.items()})
        for name in self.environments:
            domain = environment_domain(name)
            for effort in self.efforts:
                if not teachers.has(domain, effort):
                    raise ValueError(f"teachers: no teacher for domain {domain!r} at effort {effort!r} (environment "
                                     f"{name}); add \"{domain}/{effort}\" or \"{domain}/*\"")

    def resolved_bus_url(self) -> str:
        return self.bus_url or f"embedded://{Path(self.job_dir).resolve() / 'bus'}"


# ==================================================================================================== actors
def _set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))


def _starting_policy(cfg: RLJobConfig):
    """(model, model_config, tokenizer) of the job's starting point."""
    import torch

    from k3.model import checkpoint as ckpt

    if cfg.checkpoint is not None:
        return ckpt.load_model(cfg.checkpoint)
    from k3.model.presets import get_preset
    from k3.model.tokenizer import ByteTokenizer
    from k3.model.transformer import K3Model

    torch.manual_seed(cfg.seed)
    model_config = get_preset(cfg.preset)
    return K3Model(model_config), model_config, ByteTokenizer()


def _held_out(cfg: RLJobConfig, envs: dict) -> list:
    effort = cfg.efforts[0]
    return [envs[cfg.environments[i % len(cfg.environments)]].problem(i // len(cfg.environments), "eval", effort)
            for i in range(cfg.eval_size)]


def _actor_telemetry(cfg: RLJobConfig, service: str):
    """Metric providers pushing to ``cfg.otlp_endpoint`` periodically and on close (no traces), or None without one.

    Actors are processes Ray places anywhere, with no port to scrape, so they push (OTLP) instead of serving
    a Prometheus endpoint; the collector exposes the series next to the services' own.
    """
    if cfg.otlp_endpoint is None:
        return None
    from k3.services.common.config import ServerConfig
    from k3.services.common.telemetry import setup_telemetry

    return setup_telemetry(service, ServerConfig(otlp_endpoint=cfg.otlp_endpoint, tracing=False, metrics=True))


def _meter(telemetry):
    return telemetry.meter() if telemetry is not None else None


class LearnerActor:
    """The learner in its own process (wrapped with ``ray.remote`` by ``run_rl_job``)."""

    def __init__(self, cfg_dict: dict[str, Any]):
        from k3.model import checkpoint as ckpt
        from k3.services.bus import open_bus
        from k3.services.rollout.environment import make_environment
        from k3.services.trainer.learner import Learner, LearnerConfig

        cfg = RLJobConfig.from_dict(cfg_dict)
        _set_threads(cfg.threads)
        self.cfg = cfg
        latest = ckpt.latest_checkpoint(cfg.job_dir)
        if latest is not None:  # resuming: the architecture and tokenizer come from the job's own checkpoint
            model, model_config, tokenizer = ckpt.load_model(latest)
        else:
            model, model_config, tokenizer = _starting_policy(cfg)
        self.bus = open_bus(cfg.resolved_bus_url())
        self.telemetry = _actor_telemetry(cfg, "rl-learner")
        self.learner = Learner(LearnerConfig(
            job_id=cfg.resolved_job_id(), job_dir=cfg.job_dir, group_size=cfg.group_size,
            groups_per_step=cfg.prompts_per_step, max_staleness=cfg.max_staleness, lr=cfg.lr, adamw_lr=cfg.adamw_lr,
            weight_decay=cfg.weight_decay, clip_eps=cfg.clip_eps, weight_cap=cfg.weight_cap,
            minibatches=cfg.minibatches, grad_clip=cfg.grad_clip, seed=cfg.seed, teachers=dict(cfg.teachers),
            distill_coef=cfg.distill_coef, read_from_ms=int(time.time() * 1000) - _CLOCK_SKEW_MS),
            self.bus, model, model_config, tokenizer, meter=_meter(self.telemetry))
        self.envs = {name: make_environment(name, tokenizer=tokenizer, budgets=cfg.budgets(), seed=cfg.seed)
                     for name in cfg.environments}
        self.eval_problems = _held_out(cfg, self.envs)

    def version(self) -> int:
        return self.learner.version

    def checkpoint(self) -> str:
        return str(self.learner.checkpoint)

    def step(self, timeout_s: float) -> dict[str, Any] | None:
        return self.learner.step(timeout_s)

    def evaluate(self) -> float:
        return self.learner.evaluate(self.eval_problems, self.envs, self.cfg.budgets())

    def finish(self) -> None:
        """Announce the last version as final: workers stop admitting and exit."""
        self.learner.publish_weights(final=True)

    def ledger(self) -> dict[str, Any]:
        return {"ledger": self.learner.ledger, "learned": sorted(self.learner.learned),
                "counters": dict(self.learner.counters)}

    def close(self) -> None:
        self.learner.close()
        self.bus.close()
        if self.telemetry is not None:
            self.telemetry.shutdown()  # flushes the last metrics to the collector


class RolloutActor:
    """One rollout worker in its own process (wrapped with ``ray.remote(max_concurrency=2)``)."""

    def __init__(self, cfg_dict: dict[str, Any], worker_index: int):
        import threading

        from k3.model import checkpoint as ckpt
        from k3.services.bus import open_bus
        from k3.services.rollout.worker import RolloutWorker, WorkerConfig

        cfg = RLJobConfig.from_dict(cfg_dict)
        _set_threads(cfg.threads)
        latest = ckpt.latest_checkpoint(cfg.job_dir)
        if latest is None:
            raise RuntimeError(f"{cfg.job_dir} has no learner checkpoint yet; start the learner first")
        model, _, tokenizer = ckpt.load_model(latest)
        self.bus = open_bus(cfg.resolved_bus_url())
        self.telemetry = _actor_telemetry(cfg, "rl-rollout")
        self.worker = RolloutWorker(WorkerConfig(
            job_id=cfg.resolved_job_id(), worker_id=f"w{worker_index}", worker_index=worker_index,
            num_workers=cfg.num_workers, environments=tuple(cfg.environments), efforts=tuple(cfg.efforts),
            group_size=cfg.group_size, groups_per_step=cfg.prompts_per_step // cfg.num_workers,
            max_staleness=cfg.max_staleness, partial_threshold=cfg.partial_rollout_threshold,
            temperature=cfg.temperature, seed=cfg.seed, budgets=cfg.budgets()),
            model, tokenizer, self.bus, str(Path(cfg.job_dir) / "rollout"), meter=_meter(self.telemetry))
        self.worker.version = int(ckpt.read_trainer_state(latest)["version"])
        self._stop = threading.Event()

    def run(self) -> dict[str, Any]:
        """Rollout rounds until ``stop`` or the learner's final version."""
        while not self._stop.is_set() and not self.worker.final:
            self.worker.step()
        return self.worker.status()

    def stop(self) -> None:
        self._stop.set()

    def status(self) -> dict[str, Any]:
        return self.worker.status()

    def close(self) -> None:
        self.worker.close()
        self.bus.close()
        if self.telemetry is not None:
            self.telemetry.shutdown()


# ==================================================================================================== driver
class _Job:
    """The driver's handles on the actors, with replacement of dead ones."""

    def __init__(self, cfg: RLJobConfig, report: Callable[[dict], None]):
        import ray

        self.ray = ray
        self.cfg = cfg
        self.report = report
        self.cfg_dict = cfg.to_dict()
        opts = {"num_cpus": cfg.actor_num_cpus}
        self.learner_cls = ray.remote(**opts)(LearnerActor)
        self.worker_cls = ray.remote(max_concurrency=2, **opts)(RolloutActor)
        self.learner = self._start_learner()
        self.workers: dict[int, Any] = {}
        self.runs: dict[int, Any] = {}
        for i in range(cfg.num_workers):
            self._start_worker(i)

    def _name(self, role: str) -> str:
        return f"k3-rl-{self.cfg.resolved_job_id()}-{role}"

    def _claim(self, name: str, timeout_s: float = 60.0) -> str:
        """``name``, freed first from an actor a crashed predecessor of this driver left behind.

        When the trainer dies, Ray reaps the actors its job owned only after a while; a resumed job that
        started its actors at once would find their names taken. Killing the leftover also matters on its
        own: a stale rollout worker would go on publishing from the spool its replacement adopts.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                stale = self.ray.get_actor(name)
            except ValueError:
                return name
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray actor name {name} stayed taken for {timeout_s:.0f} s after killing "
                                   "its holder")
            self.ray.kill(stale, no_restart=True)
            time.sleep(0.2)

    def _start_learner(self):
        actor = self.learner_cls.options(name=self._claim(self._name("learner"))).remote(self.cfg_dict)
        self.ray.get(actor.version.remote())  # constructed: the version-0 checkpoint exists
        return actor

    def _start_worker(self, i: int) -> None:
        self.workers[i] = self.worker_cls.options(name=self._claim(self._name(f"w{i}"))).remote(self.cfg_dict, i)
        self.runs[i] = self.workers[i].run.remote()

    def check_workers(self) -> None:
        """Replace every worker whose run ended with an error (its spool is adopted by the replacement)."""
        for i, ref in list(self.runs.items()):
            ready, _ = self.ray.wait([ref], timeout=0)
            if not ready:
                continue
            try:
                self.ray.get(ref)
            except Exception as exc:  # RayActorError (killed, crashed) or an error raised by the worker
                log.warning("rollout worker w%d died: %s; starting a replacement", i, exc)
                self.report({"kind": "worker_restarted", "worker": f"w{i}", "error": str(exc)[:500]})
                self._start_worker(i)

    def call_learner(self, method: str, *args):
        """Call the learner; a dead learner is replaced once (it resumes from its latest checkpoint)."""
        from ray.exceptions import RayActorError

        try:
            return self.ray.get(getattr(self.learner, method).remote(*args))
        except RayActorError as exc:
            log.warning("learner died: %s; resuming from the latest checkpoint", exc)
            self.report({"kind": "learner_restarted", "error": str(exc)[:500]})
            self.learner = self._start_learner()
            return self.ray.get(getattr(self.learner, method).remote(*args))

    def shutdown(self) -> None:
        ray = self.ray
        try:
            self.call_learner("finish")
        except Exception:
            log.exception("could not announce the final version")
        for w in self.workers.values():
            try:
                w.stop.remote()
            except Exception:
                pass
        for i, ref in self.runs.items():
            try:
                ray.get(ref, timeout=120)
            except Exception as exc:
                log.warning("worker w%d ended with %s", i, exc)
        for actor in [*self.workers.values(), self.learner]:
            try:
                ray.get(actor.close.remote(), timeout=30)
            except Exception:
                pass
            ray.kill(actor)


def _ensure_ray() -> bool:
    """Start a local Ray (2 CPUs, no dashboard) unless one is connected; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return True


def run_rl_job(config: RLJobConfig, *, report: Callable[[dict[str, Any]], None],
               cancelled: Callable[[], bool]) -> dict[str, Any]:
    """Run (or resume) the job to ``config.steps`` updates or until ``cancelled()``; see the module docstring.

    ``report`` receives ``{"kind": "start", "step", "steps"}``, one ``{"kind": "train", "step", ...metrics}`` per
    update (reward, verifier_score, staleness_max, tokens, loss, clip_fraction, importance_weight, ...),
    ``{"kind": "checkpoint", "step", "path"}`` after it, ``{"kind": "eval", "step", "eval_reward"}`` at each
    evaluation, and ``worker_restarted`` / ``learner_restarted`` when an actor was replaced. Returns
    ``{"step", "steps", "stopped" (None or "cancelled"), "checkpoint", "eval_rewards": [[step, reward]...]}``.
    """
    if not config.job_dir:
        raise ValueError("job_dir: an RL job needs a folder to write to")
    Path(config.job_dir).mkdir(parents=True, exist_ok=True)
    started_ray = _ensure_ray()
    metrics_path = Path(config.job_dir) / "rl_metrics.jsonl"

    def emit(event: dict[str, Any]) -> None:
        with metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")
        report(event)

    evals: list[list[float]] = []
    stopped = None
    version, checkpoint = 0, ""
    try:
        job = _Job(config, emit)
    except BaseException:
        if started_ray:
            import ray

            ray.shutdown()
        raise
    try:
        version = job.call_learner("version")
        emit({"kind": "start", "step": version, "steps": config.steps})

        def evaluate(step: int) -> None:
            if config.eval_size:
                reward = job.call_learner("evaluate")
                evals.append([step, reward])
                emit({"kind": "eval", "step": step, "eval_reward": reward})

        if version == 0:
            evaluate(0)
        waited = 0.0
        while version < config.steps:
            if cancelled():
                stopped = "cancelled"
                break
            job.check_workers()
            started = time.monotonic()
            result = job.call_learner("step", 2.0)
            if result is None:
                waited += time.monotonic() - started
                if waited > config.step_timeout_s:
                    raise TimeoutError(f"no complete batch of trajectories within step_timeout_s "
                                       f"({config.step_timeout_s} s)")
                continue
            waited = 0.0
            version = result["version"]
            checkpoint = result.pop("checkpoint")
            emit({"kind": "train", "step": version, **result})
            emit({"kind": "checkpoint", "step": version, "path": checkpoint})
            if version == config.steps or (config.eval_interval and version % config.eval_interval == 0):
                evaluate(version)
        checkpoint = job.call_learner("checkpoint")
    finally:
        job.shutdown()
        if started_ray:
            import ray

            ray.shutdown()
    return {"step": version, "steps": config.steps, "stopped": stopped, "checkpoint": checkpoint,
            "eval_rewards": evals}
