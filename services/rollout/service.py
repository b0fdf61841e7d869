"""``k3 serve rollout``: a rollout worker as a gRPC service (``k3.v1.Rollout``).

``StartRollouts(job_id, environment, num_prompts, group_size, effort, weight_version)`` starts a rollout worker
for the job in a background thread: it generates with the served model through its own engine, with partial
rollout, and publishes ``k3.v1.Trajectory`` on ``k3.trajectories`` of the configured bus, following the job's
``k3.weights`` events for new weights (``num_prompts`` groups per learner version is its staleness batch).
``RolloutStatus`` reports its counters, ``StopRollouts`` stops it (its paused trajectories stay in the spool and
are adopted by the next worker of the job).

Design decisions:

- One job at a time per process: the worker loads each new weight version into the served model, which two
  jobs cannot share (a second job gets FAILED_PRECONDITION until the first is stopped).
- Bad requests are INVALID_ARGUMENT naming the field (an unknown environment lists the known ones); an
  unknown job in Status/Stop is NOT_FOUND.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass

import grpc

from k3.model.rl.effort import EFFORT_LEVELS
from k3.protos.v1 import rollout_pb2, rollout_pb2_grpc
from k3.services.common.config import ConfigError, ServerConfig, documented
from k3.services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from k3.services.engine.config import EngineConfig
from k3.services.engine.model_source import ModelSourceConfig
from k3.services.registry import ServiceSpec
from k3.services.rollout.environment import environment_names

log = logging.getLogger(__name__)

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name
_JOB_ID = re.compile(r"[A-Za-z0-9._-]{1,100}")


@dataclass
class RolloutSettings:
    """How the service's workers generate."""

    bus_url: str = documented("embedded:///tmp/k3-bus", doc="Event bus the trajectories go to.")
    spool_dir: str = documented("/tmp/k3-rollout", doc="Folder of the workers' spools (admitted/paused).")
    max_staleness: int = documented(1, doc="Staleness bound (AReaL's eta) of the admission rule.")
    partial_threshold: float = documented(0.75, doc="Share of a round that must finish before pausing the rest.")
    temperature: float = documented(1.0, doc="Sampling temperature.")
    seed: int = documented(0, doc="Seed of problems and sampling.")

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ConfigError(f"must be >= 0, got {self.max_staleness}", field="max_staleness")
        if not 0 < self.partial_threshold <= 1:
            raise ConfigError(f"must be in (0, 1], got {self.partial_threshold}", field="partial_threshold")
        if not self.temperature > 0:
            raise ConfigError(f"must be > 0, got {self.temperature}", field="temperature")


@dataclass
class RolloutServiceConfig:
    """Configuration of ``k3 serve rollout``."""

    server: ServerConfig = documented(default_factory=ServerConfig, doc="How the gRPC server listens.")
    model: ModelSourceConfig = documented(default_factory=ModelSourceConfig, doc="The policy to generate with.")
    engine: EngineConfig = documented(default_factory=lambda: EngineConfig(max_batch=32, max_slots=64,
                                                                           num_pages=4096, max_queue=256),
                                      doc="Slots, pages, batching of the rollout engine.")
    rollout: RolloutSettings = documented(default_factory=RolloutSettings, doc="Bus, spool and sampling.")


class _Run:
    """One job's worker and its thread."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.stop = threading.Event()
        self.error = ""
        self.thread = threading.Thread(target=self._loop, name=f"rollout-{worker.config.job_id}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while not self.stop.is_set() and not self.worker.final:
                self.worker.step()
        except Exception as exc:  # reported by RolloutStatus; the server keeps serving
            log.exception("rollout worker of job %s failed", self.worker.config.job_id)
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def state(self) -> str:
        if self.error:
            return "FAILED"
        return "RUNNING" if self.thread.is_alive() else "STOPPED"


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, service: RolloutService):
        self.service = service

    def StartRollouts(self, request, context) -> rollout_pb2.RolloutAck:
        return self.service.start(request)

    def RolloutStatus(self, request, context) -> rollout_pb2.RolloutStatusResponse:
        return self.service.status(request.job_id)

    def StopRollouts(self, request, context) -> rollout_pb2.RolloutStatusResponse:
        return self.service.stop(request.job_id)


class RolloutService:
    name = "rollout"
    service_names = (SERVICE_NAME,)

    def __init__(self, config: RolloutServiceConfig, model=None, tokenizer=None):
        from k3.services.bus import open_bus

        self.config = config
        if model is None:
            model, tokenizer = config.model.load(server_config=config.server)
        if tokenizer is None:
            raise ConfigError("rollouts need a tokenizer (environments render XTML prompts)", field="model.tokenizer")
        self.model, self.tokenizer = model, tokenizer
        self.bus = open_bus(config.rollout.bus_url)
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}

    def add_to_server(self, server: grpc.Server) -> None:
        rollout_pb2_grpc.add_RolloutServicer_to_server(RolloutServicer(self), server)

    def _check(self, request) -> None:
        if not _JOB_ID.fullmatch(request.job_id):
            raise InvalidArgument("job_id", "must be 1-100 letters, digits, '.', '_' or '-'", reason="BAD_JOB_ID")
        known = environment_names()
        if request.environment not in known:
            raise InvalidArgument("environment", f"unknown environment {request.environment!r}; known: "
                                  f"{', '.join(known)}", reason="UNKNOWN_ENVIRONMENT")
        if request.num_prompts < 1:
            raise InvalidArgument("num_prompts", f"must be >= 1, got {request.num_prompts}")
        if request.group_size < 2:
            raise InvalidArgument("group_size", f"must be >= 2 (GRPO needs a group), got {request.group_size}")
        if (request.effort or "low") not in EFFORT_LEVELS:
            raise InvalidArgument("effort", f"must be one of {', '.join(EFFORT_LEVELS)}, got {request.effort!r}")
        if request.weight_version < 0:
            raise InvalidArgument("weight_version", f"must be >= 0, got {request.weight_version}")

    def start(self, request) -> rollout_pb2.RolloutAck:
        from k3.services.rollout.worker import RolloutWorker, WorkerConfig

        self._check(request)
        s = self.config.rollout
        with self._lock:
            running = [j for j, r in self._runs.items() if r.state == "RUNNING"]
            if running:
                raise FailedPrecondition(f"job {running[0]!r} is rolling out on this worker; stop it first",
                                         field="job_id", reason="BUSY")
            old = self._runs.pop(request.job_id, None)
            if old is not None:
                old.worker.close()
            worker = RolloutWorker(WorkerConfig(
                job_id=request.job_id, worker_id="svc", environments=(request.environment,),
                efforts=(request.effort or "low",), group_size=request.group_size,
                groups_per_step=request.num_prompts, max_staleness=s.max_staleness,
                partial_threshold=s.partial_threshold, temperature=s.temperature, seed=s.seed,
                engine=self.config.engine), self.model, self.tokenizer, self.bus, s.spool_dir)
            worker.version = max(worker.version, int(request.weight_version))
            self._runs[request.job_id] = _Run(worker)
        return rollout_pb2.RolloutAck(accepted=request.num_prompts * request.group_size, worker_id="svc")

    def _run(self, job_id: str) -> _Run:
        run = self._runs.get(job_id)
        if run is None:
            raise NotFound(f"no rollouts of job {job_id!r} on this worker", field="job_id")
        return run

    def status(self, job_id: str) -> rollout_pb2.RolloutStatusResponse:
        with self._lock:
            run = self._run(job_id)
        st = run.worker.status()
        return rollout_pb2.RolloutStatusResponse(
            running=0, paused=st["paused"], finished=st["published"], weight_version=st["version"],
            published=st["published"], admitted_limit=st["admissible"], state=run.state, message=run.error)

    def stop(self, job_id: str) -> rollout_pb2.RolloutStatusResponse:
        with self._lock:
            run = self._run(job_id)
        run.stop.set()
        run.thread.join()
        return self.status(job_id)

    def close(self) -> None:
        for run in list(self._runs.values()):
            run.stop.set()
            run.thread.join(timeout=60)
            run.worker.close()
        self.bus.close()


def build(config: RolloutServiceConfig) -> RolloutService:
    return RolloutService(config)


SPEC = ServiceSpec(config_type=RolloutServiceConfig, build=build)
