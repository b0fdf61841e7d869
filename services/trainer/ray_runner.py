"""Jobs on Ray: one actor per job, progress streamed back to the trainer, cancellation with a grace period.

``RayRunner(config)`` connects to Ray (``ray.init``) and ``start(...)`` launches a job as a ``JobActor`` sized
by ``job_num_cpus``/``job_num_gpus``; a thread in the trainer follows it and forwards its events.

Design decisions:

- **Where Ray runs.** ``address`` names an existing cluster (``ray://head:10001`` or ``auto``); left empty,
  ``ray.init`` reads ``RAY_ADDRESS`` (the Helm chart sets it when its RayCluster is on) and otherwise starts
  a local instance sized by ``num_cpus``. If the process already initialised Ray (an embedding application,
  the tests), that runtime is used and left running on close.
- **One threaded actor per job** (``max_concurrency`` 4): ``run`` executes the job
  (``k3.services.trainer.jobs_exec.execute``) while ``poll`` and ``cancel`` are served beside it. Events stay
  in the actor until the trainer's follower thread long-polls them (``poll(start, timeout)``), so progress
  needs no extra infrastructure (no queue actor, no callback into the trainer) and nothing is lost if the
  follower is slow.
- **Cancellation** sets the actor's flag, which the training loop checks before every step: the job saves a
  checkpoint and returns ``stopped == "cancelled"``. If it has not returned within ``cancel_grace_s`` (a
  step that takes too long, data loading, a hung call), the actor is killed with ``ray.kill``, which ends its
  worker process and frees its resources. A job still waiting for resources is killed at once.
- Actors are owned by the trainer process: if the trainer dies, Ray ends them too, and the restarted trainer
  resumes the job from its last checkpoint (``jobs_exec`` resumes by default).
- Job outputs are written by the actor to ``run_dir``; on a multi-node cluster ``jobs_dir`` must be storage
  every node mounts at the same path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from k3.services.common.config import ConfigError, documented

log = logging.getLogger(__name__)


@dataclass
class RayConfig:
    """How the trainer reaches Ray and sizes job actors."""

    address: str | None = documented(
        None, doc="Ray cluster to use (ray://host:10001 or auto); None: $RAY_ADDRESS if set, else a local instance."
    )
    num_cpus: int | None = documented(None, doc="CPUs of a local instance; None lets Ray count the machine's.")
    namespace: str = documented("k3-trainer", doc="Ray namespace of the trainer's actors.")
    job_num_cpus: float = documented(1.0, doc="CPUs reserved per job actor (torch threads default to it).")
    job_num_gpus: float = documented(0.0, doc="GPUs reserved per job actor.")
    cancel_grace_s: float = documented(
        30.0, doc="After Cancel, how long a job may take to stop at a step boundary before its actor is killed."
    )
    poll_timeout_s: float = documented(1.0, doc="Long-poll period of the thread following each job.")

    def __post_init__(self) -> None:
        if self.address is not None and not self.address.strip():
            raise ConfigError("must not be blank (use null for $RAY_ADDRESS or a local instance)", field="address")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ConfigError(f"must be >= 1, got {self.num_cpus}", field="num_cpus")
        if not self.namespace:
            raise ConfigError("must not be empty", field="namespace")
        if not self.job_num_cpus > 0:
            raise ConfigError(f"must be > 0, got {self.job_num_cpus}", field="job_num_cpus")
        if self.job_num_gpus < 0:
            raise ConfigError(f"must be >= 0, got {self.job_num_gpus}", field="job_num_gpus")
        if self.cancel_grace_s < 0:
            raise ConfigError(f"must be >= 0, got {self.cancel_grace_s}", field="cancel_grace_s")
        if not self.poll_timeout_s > 0:
            raise ConfigError(f"must be > 0, got {self.poll_timeout_s}", field="poll_timeout_s")


class JobActorBody:
    """What runs inside the job's Ray actor (wrapped by ``ray.remote`` in ``RayRunner``)."""

    def __init__(self) -> None:
        self._events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._cancel = threading.Event()
        self._done = False

    def run(self, kind: str, params: dict[str, Any], run_dir: str, options: dict[str, Any]) -> dict[str, Any]:
        from k3.services.trainer.jobs_exec import execute

        self._report({"kind": "running", "pid": os.getpid(), "node": _node_ip()})
        try:
            return execute(kind, params, run_dir, report=self._report, cancelled=self._cancel.is_set, **options)
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def poll(self, start: int, timeout: float) -> tuple[list[dict[str, Any]], bool]:
        """Events from index ``start`` (waiting up to ``timeout`` for one) and whether ``run`` has returned."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._events) <= start and not self._done:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return list(self._events[start:]), self._done

    def cancel(self) -> None:
        self._cancel.set()

    def _report(self, event: dict[str, Any]) -> None:
        with self._cond:
            self._events.append(dict(event))
            self._cond.notify_all()


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "?"


@dataclass
class JobOutcome:
    """How a job's Ray work ended."""

    result: dict[str, Any] | None
    """What ``execute`` returned, or None when it raised or the actor died."""
    error: str = ""
    """Why it failed ("" on success)."""
    cancel_requested: bool = False
    killed: bool = False
    """The actor was killed (cancelled past the grace period, or before it started)."""


class RunningJob:
    """A job's actor and the trainer-side thread that follows it."""

    def __init__(self, runner: RayRunner, job_id: str, actor: Any, run_ref: Any,
                 on_event: Callable[[dict[str, Any]], None], on_exit: Callable[[JobOutcome], None]):
        self.runner, self.job_id, self.actor, self.run_ref = runner, job_id, actor, run_ref
        self._on_event, self._on_exit = on_event, on_exit
        self._lock = threading.Lock()
        self.cancel_requested = False
        self.killed = False
        self.started = False
        self.finished = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"k3-job-{job_id}", daemon=True)

    def begin(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        """Ask the job to stop at its next step; kill the actor if it has not stopped within the grace period
        (at once if it never started)."""
        with self._lock:
            if self.cancel_requested or self.finished.is_set():
                return
            self.cancel_requested = True
            started = self.started
        if not started:
            self._kill()
            return
        try:
            self.actor.cancel.remote()
        except Exception as exc:  # the actor is already gone; the follower reports it
            log.info("job %s: cancel call failed (%s)", self.job_id, exc)
        timer = threading.Timer(self.runner.config.cancel_grace_s, self._kill_if_running)
        timer.daemon = True
        timer.start()

    def _kill_if_running(self) -> None:
        if not self.finished.is_set():
            log.warning("job %s did not stop within %.0fs of Cancel; killing its actor", self.job_id,
                        self.runner.config.cancel_grace_s)
            self._kill()

    def _kill(self) -> None:
        import ray

        with self._lock:
            self.killed = True
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception as exc:
            log.info("job %s: ray.kill failed (%s)", self.job_id, exc)

    def join(self, timeout: float | None = None) -> bool:
        return self.finished.wait(timeout)

    def _follow(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

        cursor = 0
        outcome = JobOutcome(result=None)
        try:
            while True:
                try:
                    events, done = ray.get(self.actor.poll.remote(cursor, self.runner.config.poll_timeout_s))
                except GetTimeoutError:
                    continue
                for event in events:
                    if event.get("kind") == "running":
                        with self._lock:
                            self.started = True
                    self._safe_event(event)
                cursor += len(events)
                if done:
                    break
            outcome.result = ray.get(self.run_ref)
        except RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            outcome.error = f"{type(cause).__name__}: {cause}" if cause is not None else str(exc).splitlines()[0]
        except RayActorError as exc:
            outcome.error = "the job's Ray actor died" + (f": {exc.error_msg.splitlines()[0]}"
                                                          if getattr(exc, "error_msg", "") else "")
        except RayError as exc:
            outcome.error = f"Ray error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        except Exception as exc:  # never let a follower die silently: the job must reach a final state
            log.exception("job %s: following it failed", self.job_id)
            outcome.error = f"{type(exc).__name__}: {exc}"
        with self._lock:
            outcome.cancel_requested, outcome.killed = self.cancel_requested, self.killed
        try:
            # The job's work is over: end its worker process now rather than when Ray collects the handle.
            ray.kill(self.actor, no_restart=True)
        except Exception:
            pass
        try:
            if not self.runner.closing:
                self._on_exit(outcome)
            # else: the trainer is stopping; the job keeps its non-final state and resumes on restart
        finally:
            self.finished.set()
            self.runner._forget(self.job_id)

    def _safe_event(self, event: dict[str, Any]) -> None:
        try:
            self._on_event(event)
        except Exception:
            log.exception("job %s: handling an event failed", self.job_id)


class RayRunner:
    """Starts jobs as Ray actors and follows them (see the module docstring)."""

    def __init__(self, config: RayConfig):
        import ray

        self.config = config
        self.closing = False
        self._jobs: dict[str, RunningJob] = {}
        self._lock = threading.Lock()
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            kwargs: dict[str, Any] = {"namespace": config.namespace, "include_dashboard": False,
                                      "log_to_driver": False}
            if config.address is not None:
                kwargs["address"] = config.address
            elif not os.environ.get("RAY_ADDRESS") and config.num_cpus is not None:
                kwargs["num_cpus"] = config.num_cpus
            try:
                ray.init(**kwargs)
            except (ConnectionError, ValueError, RuntimeError) as exc:
                raise ValueError(f"ray: cannot connect to or start Ray ({exc})") from None
        self._actor_class = ray.remote(JobActorBody)

    def start(self, job_id: str, kind: str, params: dict[str, Any], run_dir: str, options: dict[str, Any], *,
              on_event: Callable[[dict[str, Any]], None], on_exit: Callable[[JobOutcome], None]) -> RunningJob:
        actor = self._actor_class.options(
            # Unnamed: a named actor of a trainer that just died may still hold its name while Ray cleans up.
            num_cpus=self.config.job_num_cpus, num_gpus=self.config.job_num_gpus, max_concurrency=4,
        ).remote()
        run_ref = actor.run.remote(kind, params, run_dir, options)
        job = RunningJob(self, job_id, actor, run_ref, on_event, on_exit)
        with self._lock:
            self._jobs[job_id] = job
        job.begin()
        return job

    def get(self, job_id: str) -> RunningJob | None:
        with self._lock:
            return self._jobs.get(job_id)

    def running(self) -> list[str]:
        with self._lock:
            return list(self._jobs)

    def _forget(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def close(self, grace: float | None = None) -> None:
        """Stop the running jobs for a later resume: ask each to stop at its next step (it saves a checkpoint),
        kill those still running after ``grace`` seconds (default ``cancel_grace_s``), and shut Ray down if this
        runner started it. The jobs keep their non-final state, so a restarted trainer resumes them."""
        import ray

        self.closing = True
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            try:
                job.actor.cancel.remote()
            except Exception:
                pass
        deadline = time.monotonic() + (self.config.cancel_grace_s if grace is None else grace)
        for job in jobs:
            if not job.join(timeout=max(0.0, deadline - time.monotonic())):
                job._kill()
        for job in jobs:
            job.join(timeout=10.0)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
