"""Running one job in the current process: the body of the Ray actor, callable without Ray in tests.

``execute(kind, params, run_dir, report=..., cancelled=...)`` runs a pretrain job (``k3.model.train``), an
SFT job (``k3.model.sft``) or an RL job (``k3.services.trainer.rl_job``) with the validated ``params``, writing
into ``run_dir``; progress goes to ``report`` as plain dicts and ``cancelled()`` is polled between steps.

Design decisions:

- **Resume by default.** If ``run_dir`` holds a checkpoint, the job continues from it (pretraining and SFT
  resume bit for bit); a pretrain or SFT folder without one (a start that died before its first save) is
  cleared and the job starts over. An RL job resumes from its folder by itself (``run_rl_job``: the learner's
  checkpoint with its learned trajectory ids, the workers' spools), so its folder is never cleared. Running the same job twice therefore never trains a step twice nor loses one that was saved,
  which is what lets a restarted trainer pick up its interrupted jobs.
- The result is a small dict (``step``, ``steps``, ``stopped``, ``checkpoint``, final metrics): the trainer
  decides the job's final state from it (``stopped == "cancelled"`` is CANCELLED, None is SUCCEEDED).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from k3.model import checkpoint as ckpt
from k3.model.training_loop import LoopHooks


def has_checkpoint(run_dir: Path) -> bool:
    try:
        return run_dir.is_dir() and ckpt.latest_checkpoint(run_dir) is not None
    except ckpt.CheckpointError:
        return False


def execute(kind: str, params: dict[str, Any], run_dir: str | Path, *, report: Callable[[dict[str, Any]], None],
            cancelled: Callable[[], bool], data_cache_dir: str | None = None, bus_url: str | None = None,
            job_id: str | None = None, otlp_endpoint: str | None = None) -> dict[str, Any]:
    """Run the job to its end or until ``cancelled()``; see the module docstring."""
    run_dir = Path(run_dir)
    resume = has_checkpoint(run_dir)
    if kind in ("pretrain", "sft") and not resume and run_dir.exists():
        shutil.rmtree(run_dir)  # an RL job resumes from its folder by itself (checkpoints and rollout spools)
    hooks = LoopHooks(on_event=report, should_stop=cancelled)
    if kind == "pretrain":
        from k3.model.train import TrainConfig, train

        cfg = TrainConfig.from_dict({**params, "out_dir": str(run_dir), "resume": resume, "progress": False,
                                     "cache_dir": data_cache_dir})
        result = train(cfg, hooks=hooks)
        return _summary(result)
    if kind == "sft":
        from k3.model.sft import SFTConfig, sft

        cfg = SFTConfig.from_dict({**params, "out_dir": str(run_dir), "resume": resume, "progress": False})
        return _summary(sft(cfg, hooks=hooks))
    if kind == "rl":
        from k3.services.trainer import rl_job

        values = {**params, "job_dir": str(run_dir)}
        if bus_url is not None:
            values["bus_url"] = bus_url
        if job_id is not None:
            values["job_id"] = job_id
        if otlp_endpoint is not None:
            values["otlp_endpoint"] = otlp_endpoint
        config = rl_job.RLJobConfig.from_dict(values)
        result = rl_job.run_rl_job(config, report=report, cancelled=cancelled)
        return dict(result or {})
    raise ValueError(f"unknown job kind {kind!r}")


def _summary(result: Any) -> dict[str, Any]:
    summary = {"step": result.step, "steps": result.steps, "stopped": result.stopped,
               "checkpoint": str(result.checkpoint), "tokens": result.tokens}
    if result.eval_losses:
        summary["eval_loss"] = result.eval_losses[-1][1]
    return summary
