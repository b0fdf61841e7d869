"""The ``k3.v1.Jobs`` gRPC service (``k3 serve trainer``): submit, watch, cancel and list training jobs.

Design decisions:

- **Submit** validates the spec completely (``spec.validate``: INVALID_ARGUMENT naming the field, e.g.
  ``spec_json.optimizer.lr``; FAILED_PRECONDITION for ``kind: rl`` where the RL job module is missing or for a
  ``checkpoint: job:ID`` whose job has not succeeded), records the job (``jobs_store``), starts it on Ray
  (``ray_runner``) and answers at once with the job in state PENDING.
- **Watch** streams the job's events from its first (a late watcher sees the whole history: progress,
  metrics, checkpoints) and then follows it live; on a finished job it replays the history and ends. It
  also ends when the client goes away or the trainer stops.
- **Cancel** asks the job to stop at its next step (it saves a checkpoint) and answers with the job; the
  job becomes CANCELLED once its Ray work has stopped (or was killed after ``ray.cancel_grace_s``).
  Cancelling a CANCELLED job answers the job unchanged; a SUCCEEDED or FAILED job is FAILED_PRECONDITION.
- Unknown job ids are NOT_FOUND.
- **Restarts.** Jobs live in ``trainer.jobs_dir``; a restarted trainer lists them all and, with
  ``trainer.resume_interrupted``, restarts the ones that had not finished: they continue from their last
  checkpoint (``jobs_exec`` resumes exactly). Stopping the trainer asks running jobs to checkpoint first.
- Every job event is also published as JSON on the bus topic ``k3.jobs`` (key: the job id), on Kafka when
  ``kafka_bootstrap`` (``K3_KAFKA_BOOTSTRAP``) or ``bus_url`` says so, else on the embedded log in
  ``<jobs_dir>/bus``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from k3.protos.v1 import jobs_pb2, jobs_pb2_grpc
from k3.services.common.config import ConfigError, ServerConfig, documented
from k3.services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from k3.services.registry import ServiceSpec
from k3.services.trainer import jobs_store
from k3.services.trainer.jobs_store import JobRecord, JobStore, UnknownJob
from k3.services.trainer.ray_runner import JobOutcome, RayConfig, RayRunner
from k3.services.trainer.spec import SpecLimits, ValidatedSpec, spec_to_dict, validate

log = logging.getLogger(__name__)

SERVICE_NAME = jobs_pb2.DESCRIPTOR.services_by_name["Jobs"].full_name
JOBS_TOPIC = "k3.jobs"
_NOT_METRICS = ("kind", "step", "steps", "stage", "seq_len", "rows", "elapsed_s")
"""Numbers of a step's record that are not metrics (the step itself, the context stage, wall time)."""


@dataclass
class TrainerSettings:
    """Where jobs live and what the trainer accepts."""

    jobs_dir: str = documented("runs/jobs", doc="Folder of every job's record, events and outputs (shared "
                               "storage on a multi-node Ray cluster).")
    resume_interrupted: bool = documented(
        True, doc="On start, restart jobs that had not finished (from their last checkpoint); false fails them."
    )
    max_parameters: int = documented(
        2_000_000_000, doc="Largest model (total parameters) a job may train; larger ones are INVALID_ARGUMENT."
    )
    data_cache_dir: str | None = documented(
        None, doc="Where pretraining caches its tokenised corpus, shared by jobs; None: <jobs_dir>/cache."
    )

    def __post_init__(self) -> None:
        if not self.jobs_dir.strip():
            raise ConfigError("must not be empty", field="jobs_dir")
        if self.max_parameters < 1:
            raise ConfigError(f"must be >= 1, got {self.max_parameters}", field="max_parameters")


@dataclass
class TrainerServiceConfig:
    """Configuration of ``k3 serve trainer``."""

    server: ServerConfig = documented(default_factory=lambda: ServerConfig(port=50057),
                                      doc="How the gRPC server listens.")
    trainer: TrainerSettings = documented(default_factory=TrainerSettings, doc="Jobs folder and limits.")
    ray: RayConfig = documented(default_factory=RayConfig, doc="The Ray cluster jobs run on.")
    bus_url: str | None = documented(
        None, doc="Event bus for k3.jobs (embedded:///dir or kafka://host:port); None: kafka_bootstrap if set, "
        "else embedded:///<jobs_dir>/bus."
    )
    kafka_bootstrap: str | None = documented(
        None, doc="Kafka bootstrap servers (host:port,...) used when bus_url is not set.",
        env=("K3_KAFKA_BOOTSTRAP",),
    )

    def __post_init__(self) -> None:
        if self.bus_url is not None and not self.bus_url.strip():
            raise ConfigError("must not be blank (use null for the default)", field="bus_url")

    def resolved_bus_url(self) -> str:
        if self.bus_url is not None:
            return self.bus_url
        if self.kafka_bootstrap:
            return f"kafka://{self.kafka_bootstrap}"
        return f"embedded://{(Path(self.trainer.jobs_dir) / 'bus').resolve()}"


def rl_job_module() -> Any:
    """The RL job entry point, or FAILED_PRECONDITION when this installation has none."""
    try:
        from k3.services.trainer import rl_job
    except ImportError as exc:
        if exc.name not in ("k3.services.trainer.rl_job", None):
            raise
        raise FailedPrecondition("RL jobs need k3.services.trainer.rl_job", field="kind",
                                 reason="RL_UNAVAILABLE") from None
    return rl_job


def event_update(event: dict[str, Any]) -> dict[str, Any]:
    """A job's raw event (from the training loop's hooks or the RL job's ``report``) as a store update."""
    kind = event.get("kind")
    if kind == "running":
        return {"state": jobs_store.RUNNING, "message": f"running on {event.get('node', '?')} "
                f"(pid {event.get('pid', '?')})"}
    if kind == "start":
        step = int(event.get("step", 0))
        text = f"resumed at step {step} of {event.get('steps')}" if step else f"training {event.get('steps')} steps"
        update = {"state": jobs_store.RUNNING, "step": step, "message": text}
        if isinstance(event.get("steps"), int):
            update["steps"] = event["steps"]
        return update
    if kind == "train":
        return {"step": int(event["step"]), "metrics": _numbers(_without(event, _NOT_METRICS))}
    if kind == "eval":
        # Pretraining and SFT report the held-out loss as "loss"; RL reports "eval_reward".
        metrics = {("eval_loss" if k == "loss" else k): v for k, v in _without(event, _NOT_METRICS).items()}
        return {"step": int(event["step"]), "metrics": _numbers(metrics)}
    if kind == "checkpoint":
        return {"step": int(event["step"]), "checkpoint": str(event["path"])}
    # Anything else (the RL job's actor restarts, ...): step, metrics, checkpoint and message where present.
    update: dict[str, Any] = {"message": str(event.get("message") or kind or "event")}
    for key in ("step", "steps"):
        if isinstance(event.get(key), int | float) and not isinstance(event.get(key), bool):
            update[key] = int(event[key])
    metrics = dict(event.get("metrics") or {})
    metrics.update({k: v for k, v in event.items()
                    if k not in ("step", "steps", "metrics", "checkpoint", "message", "kind")})
    if numbers := _numbers(metrics):
        update["metrics"] = numbers
    if event.get("checkpoint"):
        update["checkpoint"] = str(event["checkpoint"])
    return update


def _without(event: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in event.items() if k not in keys}


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def final_update(outcome: JobOutcome) -> dict[str, Any]:
    """The job's terminal state and message from how its Ray work ended."""
    result = outcome.result
    if result is not None:
        stopped = result.get("stopped")
        if stopped == "cancelled" or (outcome.cancel_requested and result.get("cancelled")):
            update = {"state": jobs_store.CANCELLED, "message": f"cancelled at step {result.get('step')}"}
            if isinstance(result.get("step"), int):
                update["step"] = result["step"]
            if result.get("checkpoint"):
                update["checkpoint"] = str(result["checkpoint"])
            return update
        if stopped:
            return {"state": jobs_store.FAILED, "message": f"stopped early ({stopped}) at step {result.get('step')}"}
        update = {"state": jobs_store.SUCCEEDED, "message": f"finished at step {result.get('step')}"}
        if isinstance(result.get("step"), int):
            update["step"] = result["step"]
        if result.get("checkpoint"):
            update["checkpoint"] = str(result["checkpoint"])
        return update
    if outcome.cancel_requested:
        how = "its actor was killed" if outcome.killed else "it stopped"
        return {"state": jobs_store.CANCELLED, "message": f"cancelled ({how})"}
    return {"state": jobs_store.FAILED, "message": outcome.error or "the job ended without a result"}


def job_proto(record: JobRecord) -> jobs_pb2.Job:
    spec = record.spec
    return jobs_pb2.Job(
        id=record.id, state=record.state, message=record.message, step=record.step, steps=record.steps,
        spec=jobs_pb2.JobSpec(name=spec.get("name", ""), kind=spec.get("kind", ""), preset=spec.get("preset", ""),
                              checkpoint=spec.get("checkpoint", ""), spec_json=spec.get("spec_json", "")),
    )


def event_proto(event: dict[str, Any]) -> jobs_pb2.JobEvent:
    return jobs_pb2.JobEvent(id=event["id"], state=event["state"], step=int(event["step"]),
                             metrics=event.get("metrics") or {}, checkpoint=event.get("checkpoint", ""),
                             message=event.get("message", ""), steps=int(event.get("steps", 0)))


class Trainer:
    """Jobs, their store and the Ray runner: the logic behind the gRPC methods."""

    def __init__(self, config: TrainerServiceConfig, *, runner: RayRunner | None = None):
        self.config = config
        settings = config.trainer
        self.jobs_dir = Path(settings.jobs_dir).resolve()
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.data_cache_dir = str(Path(settings.data_cache_dir or self.jobs_dir / "cache").resolve())
        self.limits = SpecLimits(max_parameters=settings.max_parameters,
                                 default_threads=max(1, int(config.ray.job_num_cpus)))
        from k3.services.bus import open_bus

        self.bus_url = config.resolved_bus_url()
        self.bus = open_bus(self.bus_url)
        try:
            self.store = JobStore(self.jobs_dir, publish=self._publish)
            self.runner = runner if runner is not None else RayRunner(config.ray)
        except BaseException:
            self.bus.close()
            raise
        self._restart_interrupted()

    # ---- the gRPC methods' logic -----------------------------------------------------------------------------
    def submit(self, spec: jobs_pb2.JobSpec) -> JobRecord:
        validated = validate(spec, resolve_job=self._resolve_job, limits=self.limits, rl_available=rl_job_module)
        record = self.store.create(spec_to_dict(spec), validated.kind, validated.name, validated.params,
                                   validated.steps)
        self._start(record, validated)
        return self.store.get(record.id)

    def cancel(self, job_id: str) -> JobRecord:
        record = self._get(job_id)
        if record.state == jobs_store.CANCELLED:
            return record
        if record.terminal:
            raise FailedPrecondition(f"job {job_id} already {record.state}; only a PENDING or RUNNING job can be "
                                     "cancelled", field="id", reason="JOB_FINISHED")
        running = self.runner.get(job_id)
        if running is None:  # nothing on Ray (it was never restarted after a trainer restart)
            self.store.update(job_id, state=jobs_store.CANCELLED, message="cancelled")
        else:
            self.store.update(job_id, message="cancel requested")
            running.cancel()
        return self.store.get(job_id)

    def watch(self, job_id: str, is_active) -> Iterator[dict[str, Any]]:
        self._get(job_id)
        cursor = 0
        while is_active():
            events, done = self.store.events(job_id, cursor, timeout=1.0)
            yield from events
            cursor += len(events)
            if done:
                return

    def list(self) -> list[JobRecord]:
        return self.store.list()

    def close(self, grace: float | None = None) -> None:
        try:
            self.runner.close(grace)
        finally:
            self.store.close()
            self.bus.close()

    # ---- internals -------------------------------------------------------------------------------------------
    def _get(self, job_id: str) -> JobRecord:
        if not job_id:
            raise InvalidArgument("id", "is required", reason="MISSING_FIELD")
        try:
            return self.store.get(job_id)
        except UnknownJob:
            raise NotFound(f"no job with id {job_id!r}", field="id", reason="UNKNOWN_JOB") from None

    def _resolve_job(self, job_id: str) -> tuple[str, Path]:
        try:
            record = self.store.get(job_id)
        except UnknownJob:
            raise InvalidArgument("checkpoint", f"no job with id {job_id!r}", reason="UNKNOWN_JOB") from None
        return record.state, self.store.run_dir(job_id)

    def _options(self, kind: str, job_id: str) -> dict[str, Any]:
        if kind == "pretrain":
            return {"data_cache_dir": self.data_cache_dir}
        if kind == "rl":
            return {"bus_url": self.bus_url, "job_id": job_id, "otlp_endpoint": self.config.server.otlp_endpoint}
        return {}

    def _start(self, record: JobRecord, validated: ValidatedSpec | None = None) -> None:
        job_id = record.id
        self.store.update(job_id, attempt=True, message="waiting for Ray to place the job")
        try:
            self.runner.start(
                job_id, record.kind, record.params, str(self.store.run_dir(job_id)), self._options(record.kind, job_id),
                on_event=lambda event: self._on_event(job_id, event),
                on_exit=lambda outcome: self.store.update(job_id, **final_update(outcome)),
            )
        except Exception as exc:
            log.exception("job %s could not be started on Ray", job_id)
            self.store.update(job_id, state=jobs_store.FAILED, message=f"could not start on Ray: {exc}")
            raise Unavailable(f"job {job_id} could not be started on Ray: {exc}") from None

    def _on_event(self, job_id: str, event: dict[str, Any]) -> None:
        update = event_update(event)
        if update:
            self.store.update(job_id, **update)

    def _restart_interrupted(self) -> None:
        for record in self.store.list():
            if record.terminal:
                continue
            if not self.config.trainer.resume_interrupted:
                self.store.update(record.id, state=jobs_store.FAILED,
                                  message="the trainer restarted while the job ran (trainer.resume_interrupted "
                                  "is off)")
                continue
            self.store.update(record.id, state=jobs_store.PENDING,
                              message=f"the trainer restarted; resuming (attempt {record.attempts + 1})")
            try:
                self._start(record)
            except Unavailable:
                continue

    def _publish(self, job_id: str, event: dict[str, Any]) -> None:
        self.bus.publish(JOBS_TOPIC, json.dumps(event).encode(), key=job_id.encode())


class JobsServicer(jobs_pb2_grpc.JobsServicer):
    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def Submit(self, request: jobs_pb2.JobSpec, context) -> jobs_pb2.Job:
        return job_proto(self.trainer.submit(request))

    def Watch(self, request: jobs_pb2.WatchRequest, context) -> Iterator[jobs_pb2.JobEvent]:
        for event in self.trainer.watch(request.id, context.is_active):
            yield event_proto(event)

    def Cancel(self, request: jobs_pb2.CancelRequest, context) -> jobs_pb2.Job:
        return job_proto(self.trainer.cancel(request.id))

    def List(self, request: jobs_pb2.ListRequest, context) -> jobs_pb2.ListResponse:
        return jobs_pb2.ListResponse(jobs=[job_proto(r) for r in self.trainer.list()])


class TrainerService:
    """The trainer as a ``Service`` for ``k3.services.common.server``; owns the ``Trainer``."""

    name = "trainer"
    service_names = (SERVICE_NAME,)

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def add_to_server(self, server: grpc.Server) -> None:
        jobs_pb2_grpc.add_JobsServicer_to_server(JobsServicer(self.trainer), server)

    def close(self) -> None:
        self.trainer.close()


def build(config: TrainerServiceConfig) -> TrainerService:
    return TrainerService(Trainer(config))


SPEC = ServiceSpec(config_type=TrainerServiceConfig, build=build)
