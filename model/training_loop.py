"""What the single-device training loops share: the step/eval/save/stop control flow, the update, the progress
bar, metrics files, the loss plot, determinism and thread settings, and hooks for a supervisor.

Pretraining (``k3.model.train``) and SFT (``k3.model.sft``) differ in their data, their loss inputs, what their
checkpoints record and what their progress bars show; everything else lives here once.

Design decisions:

- ``TrainingLoop.run`` is the one control flow: an eval at step 0 of a new run; then per step the update, an
  eval every ``eval_every`` and a checkpoint every ``save_every`` steps; stop on the last step, on ``stop_at``,
  on a time limit, on Ctrl-C or when a supervisor asks (``LoopHooks.should_stop``); a checkpoint at the end
  whatever the reason. Subclasses provide ``train_step``, ``evaluate``, ``save``, ``plot`` and the bar's fields.
- **Hooks, not config.** A supervisor (the trainer service running a job on Ray) passes ``LoopHooks``: every
  metrics record, every checkpoint and the start of the loop are reported to ``on_event``, and
  ``should_stop`` is polled before each step. They are call arguments, never config fields, so they are not
  written into checkpoints and cannot change what a run computes (resume stays bitwise exact).
- A stop requested by the supervisor behaves like Ctrl-C: the current step finishes, no extra eval runs, a
  checkpoint is written, and the run can be resumed later.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from k3.model import checkpoint as ckpt


@dataclass
class LoopHooks:
    """Callbacks from a running loop to whoever supervises it (all optional)."""

    on_event: Callable[[dict[str, Any]], None] | None = None
    """Receives ``{"kind": "start", "step", "steps"}`` once, every metrics record (``kind`` train or eval,
    as written to ``metrics.jsonl``) and ``{"kind": "checkpoint", "step", "path"}`` after each save."""
    should_stop: Callable[[], bool] | None = None
    """Polled before each step; True stops the run after saving a checkpoint (``stopped == "cancelled"``)."""

    def emit(self, record: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(record)

    def stop_requested(self) -> bool:
        return self.should_stop is not None and bool(self.should_stop())


# ---- the control flow ------------------------------------------------------------------------------------------
class TrainingLoop:
    """Base of a loop's mutable state. Subclasses set the attributes named in ``__init__``'s docstring."""

    label: ClassVar[str] = "train"
    """The progress bar's label."""
    eval_on_early_stop: ClassVar[bool] = True
    """Whether a planned early stop (``stop_at``, time limit) gets an eval point before the checkpoint."""

    # Attributes a subclass provides: cfg (steps, eval_every, save_every, stop_at, max_minutes, progress), out,
    # metrics_path, eval_hist, hooks; the loop maintains step, tokens, started, elapsed_before, saved_step and
    # last_checkpoint.
    cfg: Any
    out: Path
    metrics_path: Path
    eval_hist: list[tuple[int, float]]
    hooks: LoopHooks
    step: int
    tokens: int
    elapsed_before: float
    started: float
    saved_step: int
    last_checkpoint: Path | None

    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    def run(self, step: int, tokens: int, elapsed_before: float, started: float) -> str | None:
        """Train from ``step`` to the end (or an early stop); returns None or why it stopped early:
        "stop_at", "time limit", "interrupted" (Ctrl-C) or "cancelled" (``LoopHooks.should_stop``)."""
        cfg = self.cfg
        self.step, self.tokens, self.elapsed_before, self.started = step, tokens, elapsed_before, started
        if step > 0:
            self.saved_step = step
            self.last_checkpoint = self.out / ckpt.checkpoint_name(step)
        self.hooks.emit({"kind": "start", "step": step, "steps": cfg.steps})
        stop = StopFlag()
        stopped: str | None = None
        with stop.on_sigint(), progress(self.label, cfg.steps, step, self.bar_fields(None),
                                        enabled=cfg.progress) as bar:
            if step == 0:
                self.evaluate(bar)
            while self.step < cfg.steps:
                if self.hooks.stop_requested():
                    stopped = "cancelled"
                    break
                info = self.train_step()
                bar.advance(info["step"], self.bar_fields(info))
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    self.evaluate(bar)
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    self.save()
                if cfg.stop_at is not None and self.step >= cfg.stop_at and self.step < cfg.steps:
                    stopped = "stop_at"
                elif cfg.max_minutes is not None and time.monotonic() - started >= cfg.max_minutes * 60:
                    stopped = "time limit"
                elif stop.requested:
                    stopped = "interrupted"
                if stopped:
                    break
            # The end of the run gets an eval point (and, where the loop wants it, a planned early stop);
            # Ctrl-C and a supervisor's stop leave at once.
            wants_eval = stopped is None or (self.eval_on_early_stop and stopped not in ("interrupted", "cancelled"))
            if wants_eval and (not self.eval_hist or self.eval_hist[-1][0] != self.step):
                self.evaluate(bar)
        if self.saved_step != self.step:
            self.save()
        self.plot()
        return stopped

    # ---- provided by each loop -----------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """One update; returns its metrics record (``kind`` train, ``step`` after the update, ``loss``...)."""
        raise TypeError(f"{type(self).__name__} must define train_step")

    def evaluate(self, bar: ProgressBar) -> float:
        raise TypeError(f"{type(self).__name__} must define evaluate")

    def save(self) -> None:
        raise TypeError(f"{type(self).__name__} must define save")

    def plot(self) -> None:
        raise TypeError(f"{type(self).__name__} must define plot")

    def bar_fields(self, info: dict[str, Any] | None) -> dict[str, str]:
        """The progress bar's extra columns as ``{name: text}``; ``info`` is None for the placeholders."""
        return {}

    # ---- shared pieces -------------------------------------------------------------------------------------
    def record(self, record: dict[str, Any]) -> None:
        """Append a metrics record to ``metrics.jsonl`` and report it to the hooks."""
        with open(self.metrics_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self.hooks.emit(record)

    def saved(self, path: Path) -> None:
        """Note a checkpoint just written for ``self.step``."""
        self.last_checkpoint = path
        self.saved_step = self.step
        self.hooks.emit({"kind": "checkpoint", "step": self.step, "path": str(path)})


def set_lr(optimizer: torch.optim.Optimizer, base_lrs: Sequence[float], factor: float) -> None:
    """Scale every group's learning rate to ``base * factor`` (the schedule's value for this step)."""
    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
        group["lr"] = base * factor


def update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, grad_clip: float) -> float:
    """Backward, clip the global gradient norm to ``grad_clip`` (0: no clipping), step; returns the norm."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    max_norm = grad_clip if grad_clip > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    optimizer.step()
    return grad_norm


@torch.no_grad()
def mean_eval_loss(model: torch.nn.Module, batches: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor],
                   moe_layers: Sequence[torch.nn.Module]) -> float:
    """Target-weighted mean loss over fixed batches (each with ``num_targets``), in eval mode."""
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        n = batch.num_targets
        total += loss_fn(batch).item() * n
        count += n
    for moe in moe_layers:
        moe.reset_router_stats()  # eval traffic must not count as training load
    model.train()
    return total / count


def balance_routers(moe_layers, update_bias: bool) -> float | None:
    """Quantile-balance every MoE router from its last step's scores (when ``update_bias``), reset the routing
    statistics, and return the worst max/mean expert load of that step (``None`` without MoE layers)."""
    if not moe_layers:
        return None
    from k3.model.balancing import quantile_balance_bias

    worst = 0.0
    with torch.no_grad():
        for moe in moe_layers:
            counts = moe.tokens_per_expert.float()
            worst = max(worst, float(counts.max() / counts.mean().clamp_min(1e-9)))
            if update_bias and moe.last_router_scores is not None:
                moe.expert_bias.copy_(quantile_balance_bias(moe.last_router_scores, moe.expert_bias, moe.top_k))
            moe.reset_router_stats()
    return worst


# ---- process settings ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """Deterministic kernels for the duration of training, restoring the caller's setting afterwards."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    # On the CPU every op used has a deterministic path; on GPUs some (index_add_) do not, so only warn there.
    torch.use_deterministic_algorithms(True, warn_only=device.type != "cpu")
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """``torch.set_num_threads(count)`` for the duration of training (None: leave it alone)."""
    previous = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class StopFlag:
    """Turns the first Ctrl-C into a request to stop after the current step; a second one aborts."""

    def __init__(self) -> None:
        self.requested = False

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    @contextlib.contextmanager
    def on_sigint(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be installed from the main thread
            return
        previous = signal.signal(signal.SIGINT, self._handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


# ---- metrics files and the plot --------------------------------------------------------------------------------
def read_metrics(path: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """``(train, eval)`` histories of ``(step, loss)`` from a ``metrics.jsonl`` (empty if there is none)."""
    train_hist, eval_hist = [], []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            (train_hist if record["kind"] == "train" else eval_hist).append((record["step"], record["loss"]))
    return train_hist, eval_hist


def truncate_metrics(path: Path, step: int) -> None:
    """Drop records written after the checkpoint being resumed (a run killed without saving leaves some)."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)


def plot_losses(path: Path, train_hist: list[tuple[int, float]], eval_hist: list[tuple[int, float]],
                cfg: Any, *, title: str | None = None, stage_marks: bool = True) -> None:
    """Train (raw and smoothed) and eval loss against step, with the context stage boundaries marked.

    ``cfg`` is a ``TrainConfig`` (its ``steps``, ``stages`` and ``stage_bounds()``); ``title`` replaces the
    pretraining title and ``stage_marks=False`` leaves the stages out, for loops without context stages (SFT).
    The plot is drawn with matplotlib's object API on an Agg canvas (no pyplot global state), written atomically.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train_hist:
        steps, losses = zip(*train_hist, strict=True)
        ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="train")
        # Bias-corrected EMA (as in Adam): starting from 0 and dividing by 1 - 0.9^t follows the early drop
        # instead of lagging behind the first, untrained value.
        smooth, ema = [], 0.0
        for t, value in enumerate(losses, start=1):
            ema = 0.9 * ema + 0.1 * value
            smooth.append(ema / (1 - 0.9**t))
        ax.plot(steps, smooth, color="tab:blue", linewidth=1.5, label="train (EMA 0.9)")
    if eval_hist:
        steps, losses = zip(*eval_hist, strict=True)
        ax.plot(steps, losses, color="tab:red", marker="o", markersize=3, linewidth=1.5, label="eval (held out)")
    if stage_marks:
        for end, (_, seq_len) in zip([0, *cfg.stage_bounds()[:-1]], cfg.stages, strict=True):
            ax.axvline(end, color="gray", linestyle=":", linewidth=0.8)
            ax.annotate(f"ctx {seq_len}", (end, 0.0), xycoords=("data", "axes fraction"), fontsize=8,
                        color="gray", xytext=(3, 4), textcoords="offset points")
    ax.set_xlim(0, cfg.steps)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title if title is not None else f"k3 pretraining — preset {cfg.preset}")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, format="png")
    os.replace(tmp, path)


# ---- progress display ------------------------------------------------------------------------------------------
class ProgressBar:
    """A rich progress bar (or nothing, when disabled): step of steps, then the loop's own fields."""

    def __init__(self, progress: Any, task: Any) -> None:
        self.progress, self.task = progress, task

    def advance(self, step: int, fields: dict[str, str]) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, **fields)

    def note(self, text: str) -> None:
        if self.progress is not None:
            self.progress.console.print(text)


@contextlib.contextmanager
def progress(label: str, total: int, start_step: int, fields: dict[str, str], *,
             enabled: bool = True) -> Iterator[ProgressBar]:
    """A live bar ``label [====] step/total loss ... elapsed remaining`` while the block runs.

    ``fields`` maps each extra column's name to its placeholder text; the column shows ``{name}`` through the
    templates in ``COLUMN_TEMPLATES`` (or the bare value for names without one).
    """
    if not enabled:
        yield ProgressBar(None, None)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    extra = [TextColumn(COLUMN_TEMPLATES.get(name, f"{{task.fields[{name}]}}")) for name in fields]
    columns = [TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), *extra, TimeElapsedColumn(),
               TimeRemainingColumn()]
    with Progress(*columns) as bar:
        task = bar.add_task(label, total=total, completed=start_step, **fields)
        yield ProgressBar(bar, task)


COLUMN_TEMPLATES = {
    "loss": "loss [cyan]{task.fields[loss]}",
    "tps": "{task.fields[tps]} tok/s",
    "stage": "stage {task.fields[stage]}",
    "convs": "{task.fields[convs]} chats/step",
}
"""How the known bar fields are shown."""
