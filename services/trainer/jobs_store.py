"""The trainer's record of jobs: state and events in memory, persisted as JSON in the jobs folder.

Layout of ``jobs_dir``::

    <id>/job.json       the job: spec, state, message, step, steps, latest checkpoint and metrics, times
    <id>/events.jsonl   every event of the job, one JSON object per line, in order
    <id>/run/           the job's output folder (checkpoints, metrics.jsonl, loss.png, ...)

Design decisions:

- ``job.json`` is rewritten atomically (temporary file + rename) on every state change, so a trainer killed at
  any moment leaves each job either before or after a change, never half-written. Events are appended and
  flushed; a torn last line (a crash mid-write) is skipped when loading.
- Watchers wait on one condition variable and read events by index: a ``Watch`` of a running job replays
  what happened so far and then follows, a ``Watch`` of a finished job replays and ends. Events are kept in
  memory for the trainer's lifetime (one small dict per step).
- Every event is also handed to ``publish`` (the trainer sends it to the bus topic ``k3.jobs``); a failing
  publish is logged and never fails the job: the jobs folder is the record, the bus a notification.
- States: PENDING (accepted, waiting for Ray to place it), RUNNING, then one of SUCCEEDED, FAILED,
  CANCELLED. A terminal state never changes again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PENDING, RUNNING, SUCCEEDED, FAILED, CANCELLED = "PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")


class UnknownJob(LookupError):
    """No job has this id."""


@dataclass
class JobRecord:
    """One job as the trainer knows it (persisted as ``job.json``)."""

    id: str
    spec: dict[str, Any]
    """As submitted: name, kind, preset, checkpoint, spec_json."""
    kind: str
    name: str
    params: dict[str, Any]
    """The validated config the job runs with (``spec.ValidatedSpec.params``)."""
    state: str = PENDING
    message: str = ""
    step: int = 0
    steps: int = 0
    checkpoint: str = ""
    """The latest checkpoint the job wrote."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The latest value of every metric the job reported."""
    created: float = 0.0
    updated: float = 0.0
    attempts: int = 0
    """How many times the job was started (more than one after a trainer restart resumed it)."""

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


class JobStore:
    """Jobs and their events, in memory and in ``root`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, *, publish: Callable[[str, dict[str, Any]], None] | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._publish = publish
        self._lock = threading.Condition()
        self._jobs: dict[str, JobRecord] = {}
        self._events: dict[str, list[dict[str, Any]]] = {}
        self._closed = False
        self._load()

    # ---- queries ---------------------------------------------------------------------------------------------
    def get(self, job_id: str) -> JobRecord:
        with self._lock:
            try:
                return self._copy(self._jobs[job_id])
            except KeyError:
                raise UnknownJob(job_id) from None

    def list(self) -> list[JobRecord]:
        """Every job, oldest first."""
        with self._lock:
            return [self._copy(j) for j in sorted(self._jobs.values(), key=lambda j: (j.created, j.id))]

    def run_dir(self, job_id: str) -> Path:
        return self.root / job_id / "run"

    def events(self, job_id: str, start: int, timeout: float) -> tuple[list[dict[str, Any]], bool]:
        """Events from index ``start`` on, waiting up to ``timeout`` seconds for one; also whether the job is
        terminal (no more events will come) or the store closed."""
        deadline = time.monotonic() + timeout
        with self._lock:
            if job_id not in self._jobs:
                raise UnknownJob(job_id)
            while True:
                events = self._events[job_id]
                done = self._jobs[job_id].terminal or self._closed
                if len(events) > start or done:
                    return list(events[start:]), done
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return [], False
                self._lock.wait(remaining)

    # ---- changes ---------------------------------------------------------------------------------------------
    def create(self, spec: dict[str, Any], kind: str, name: str, params: dict[str, Any], steps: int) -> JobRecord:
        now = time.time()
        job_id = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{uuid.uuid4().hex[:8]}"
        record = JobRecord(id=job_id, spec=spec, kind=kind, name=name, params=params, steps=steps, created=now,
                           updated=now)
        (self.root / job_id).mkdir()
        with self._lock:
            self._jobs[job_id] = record
            self._events[job_id] = []
            self._save(record)
        self.update(job_id, state=PENDING, message="submitted")
        return self.get(job_id)

    def update(self, job_id: str, *, state: str | None = None, message: str | None = None, step: int | None = None,
               steps: int | None = None, metrics: dict[str, float] | None = None, checkpoint: str | None = None,
               attempt: bool = False) -> JobRecord | None:
        """Apply a change and record it as an event; returns None if the job is already terminal (a late
        event after cancellation is dropped rather than reopening the job)."""
        with self._lock:
            record = self._jobs.get(job_id)
            if record is None:
                raise UnknownJob(job_id)
            if record.terminal:
                return None
            if state is not None:
                record.state = state
            if message is not None:
                record.message = message
            if step is not None:
                record.step = int(step)
            if steps is not None:
                record.steps = int(steps)
            if metrics:
                record.metrics.update(metrics)
            if checkpoint:
                record.checkpoint = checkpoint
            if attempt:
                record.attempts += 1
            record.updated = time.time()
            event = {"id": job_id, "state": record.state, "step": record.step, "steps": record.steps,
                     "metrics": dict(metrics or {}),
                     "checkpoint": checkpoint or "", "message": message or "", "time": record.updated}
            self._events[job_id].append(event)
            self._append_event(job_id, event)
            self._save(record)
            self._lock.notify_all()
            copy = self._copy(record)
        if self._publish is not None:
            try:
                self._publish(job_id, event)
            except Exception as exc:  # the bus is a notification; the jobs folder is the record
                log.warning("could not publish event of job %s on the bus: %s", job_id, exc)
        return copy

    def close(self) -> None:
        """Wake every watcher: the trainer is stopping."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    # ---- persistence -----------------------------------------------------------------------------------------
    def _save(self, record: JobRecord) -> None:
        path = self.root / record.id / "job.json"
        tmp = path.with_name(".job.json.tmp")
        tmp.write_text(json.dumps(asdict(record), indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)

    def _append_event(self, job_id: str, event: dict[str, Any]) -> None:
        with open(self.root / job_id / "events.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")
            f.flush()

    def _load(self) -> None:
        for folder in sorted(self.root.iterdir()):
            path = folder / "job.json"
            if not folder.is_dir() or not _ID.match(folder.name) or not path.is_file():
                continue
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                record = JobRecord(**data)
            except (OSError, ValueError, TypeError) as exc:
                log.warning("skipping job folder %s: unreadable job.json (%s)", folder, exc)
                continue
            events = []
            events_path = folder / "events.jsonl"
            if events_path.is_file():
                for line in events_path.read_text(encoding="utf-8").splitlines():
                    try:
                        events.append(json.loads(line))
                    except ValueError:
                        continue  # a line torn by a crash mid-write
            self._jobs[record.id] = record
            self._events[record.id] = events

    @staticmethod
    def _copy(record: JobRecord) -> JobRecord:
        return JobRecord(**{**asdict(record), "metrics": dict(record.metrics)})
