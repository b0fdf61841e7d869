"""Pretraining loop as a library: ``train(TrainConfig) -> TrainResult``.

One process, one device. Each step draws a packed batch (``k3.model.data``) at the current context stage,
computes the next-token loss, clips the gradient norm, steps Per-Head Muon under a warmup + cosine schedule and
re-balances the MoE routers with Quantile Balancing. Every ``eval_every`` steps the loss on fixed held-out
batches is measured, ``metrics.jsonl`` gains a line per step and eval, and ``loss.png`` is redrawn; every
``save_every`` steps (and at the end, on a time limit, on ``stop_at`` or on Ctrl-C) a checkpoint is written.

Design decisions:

- **Progressive context.** ``stages`` is a list of ``(fraction_of_steps, seq_len)``; stage boundaries are the
  rounded cumulative fractions of ``steps``. Rows per step are ``batch_tokens // seq_len`` so the tokens per
  step (and the gradient noise) stay about the same while the context grows. The full model's
  8K -> 64K -> 256K -> 1M becomes 128 -> 256 -> 512 for the small presets.
- **Exact resume.** Everything a step depends on is either a pure function of the step number (learning rate,
  stage, the sampler's batch) or saved in the checkpoint (weights, optimizer state, router biases, RNG states).
  With deterministic algorithms on the CPU, stopping at step k and resuming reproduces the uninterrupted run bit
  for bit. The settings that change the math are frozen at the first start; a resumed run may only change
  how it is run (eval/save cadence, time limit, progress display). ``stop_at`` stops a run early with the
  schedule of the full ``steps`` — the same as being interrupted there.
- **Eval** always uses the same windows (evenly spread over the held-out files) at ``eval_seq_len`` (default:
  the longest stage), so points of the eval curve are comparable across stages and across resumes.
- **Ctrl-C** sets a flag that the loop checks between steps, so the checkpoint is never taken in the middle of
  an optimizer step; a second Ctrl-C aborts at once. A supervisor stops a run the same way through
  ``LoopHooks.should_stop`` and follows it through ``LoopHooks.on_event``.
- The step/eval/save/stop control flow, the update, the progress bar, the metrics files and the plot are shared
  with SFT in ``k3.model.training_loop``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3.model import checkpoint as ckpt
from k3.model.config import K3Config
from k3.model.data import CorpusConfig, PackedBatch, TokenizedCorpus, WindowSampler, eval_batches, load_corpus
from k3.model.training_loop import (
    LoopHooks,
    ProgressBar,
    TrainingLoop,
    balance_routers,
    deterministic,
    mean_eval_loss,
    plot_losses,
    read_metrics,
    set_lr,
    torch_threads,
    truncate_metrics,
    update,
)

__all__ = ["TrainConfig", "TrainError", "TrainResult", "balance_routers", "plot_losses", "resume_config", "train"]

DEFAULT_STAGES: tuple[tuple[float, int], ...] = ((0.5, 128), (0.3, 256), (0.2, 512))
"""Progressive context for the small presets: half the steps at 128 tokens, then 256, then 512."""

RUNTIME_FIELDS = frozenset({
    "out_dir", "resume", "eval_every", "save_every", "keep_last", "max_minutes", "stop_at", "progress",
    "cache_dir", "device", "tokenizer_dir", "threads",
})
"""Fields a resumed run may change: they decide how the run is carried out, not what it computes."""


class TrainError(ValueError):
    """A training run cannot start or continue as configured (the message names the setting)."""


@dataclass
class TrainConfig:
    """Everything a pretraining run needs. Fields are validated on construction."""

    out_dir: str
    """Run folder: checkpoints, ``latest``, ``metrics.jsonl``, ``loss.png`` and (by default) the data cache."""
    preset: str = "tiny"
    """Model preset name (``k3.model.presets.get_preset``)."""
    model_overrides: dict[str, Any] = field(default_factory=dict)
    """K3Config fields that replace the preset's (e.g. ``{"num_layers": 2}`` for a quick experiment)."""
    steps: int = 20
    """Optimizer steps of the whole run; the LR schedule and context stages span exactly these. The defaults
    (20 steps of 512 tokens) make a tiny-preset demo of under two minutes on two idle CPU cores."""
    seed: int = 0
    """Seeds model initialisation and the batch sampler."""
    lr: float = 0.02
    """Peak learning rate of the Muon groups."""
    adamw_lr: float | None = None
    """Peak learning rate of the AdamW groups (embeddings, norms, vectors); None means ``lr``."""
    weight_decay: float = 0.0
    """Decoupled weight decay of every group."""
    warmup_steps: int | None = None
    """Linear warmup steps; None means 5 % of ``steps`` (at least 1)."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at ``lr * min_lr_ratio`` on the last step."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    batch_tokens: int = 512
    """Tokens per step; each stage uses ``max(1, batch_tokens // seq_len)`` rows of its ``seq_len``."""
    stages: tuple[tuple[float, int], ...] = DEFAULT_STAGES
    """Progressive context: ``(fraction_of_steps, seq_len)`` pairs, fractions summing to 1, seq_len rising."""
    eval_every: int = 10
    """Evaluate every this many steps (and at step 0 and at the end); 0 evaluates only at start and end."""
    eval_batches: int = 2
    """Number of fixed held-out batches per evaluation."""
    eval_seq_len: int | None = None
    """Window length of the eval batches; None means the longest stage's ``seq_len``."""
    save_every: int = 10
    """Checkpoint every this many steps (0: only at the end or when stopped)."""
    keep_last: int = 2
    """Keep this many newest checkpoints (0 keeps all)."""
    max_minutes: float | None = None
    """Stop (with a checkpoint) once this invocation has run this long; None means no limit."""
    stop_at: int | None = None
    """Stop (with a checkpoint) after this step although the schedule spans ``steps``; resume continues."""
    tokenizer_dir: str | None = None
    """Folder of a saved tokenizer (``load_tokenizer``); None means the byte-level tokenizer."""
    corpus_root: str | None = None
    """Folder of text files to train on; None means the Python standard library's sources and docs."""
    corpus_max_bytes: int = 16_000_000
    """Cap on the corpus size in bytes (train and eval together)."""
    eval_fraction: float = 0.05
    """Fraction of corpus files held out for evaluation."""
    cache_dir: str | None = None
    """Where the tokenised corpus is cached; None means ``out_dir/cache``."""
    device: str = "cpu"
    """Torch device to train on; the run is bitwise reproducible on the CPU."""
    threads: int | None = None
    """CPU threads for torch (``torch.set_num_threads``) during the run; None keeps torch's default. On a busy
    machine fewer threads than cores avoid threads spinning while they wait for each other."""
    balance_experts: bool = True
    """Re-balance every MoE router after each step with Quantile Balancing (DESIGN.md §1.6)."""
    resume: bool = False
    """Continue the run in ``out_dir`` from its latest checkpoint instead of starting a new one."""
    progress: bool = True
    """Show a live progress bar on the terminal."""

    def __post_init__(self) -> None:
        self.stages = tuple((float(f), int(s)) for f, s in self.stages)
        _check(isinstance(self.out_dir, (str, os.PathLike)) and str(self.out_dir) != "", "out_dir",
               "a folder path", self.out_dir)
        self.out_dir = str(self.out_dir)
        _check(isinstance(self.preset, str) and self.preset != "", "preset", "a preset name", self.preset)
        _check(isinstance(self.model_overrides, dict), "model_overrides", "a dict of K3Config fields",
               self.model_overrides)
        self.model_overrides = dict(self.model_overrides)
        for name in ("steps", "batch_tokens", "eval_batches", "corpus_max_bytes"):
            _check(_is_int(getattr(self, name)) and getattr(self, name) > 0, name, "a positive integer",
                   getattr(self, name))
        for name in ("seed", "eval_every", "save_every", "keep_last"):
            _check(_is_int(getattr(self, name)) and getattr(self, name) >= 0, name, "a non-negative integer",
                   getattr(self, name))
        for name in ("lr", "grad_clip", "weight_decay"):
            value = getattr(self, name)
            _check(_is_number(value) and value >= 0 and math.isfinite(value), name, "a finite number >= 0", value)
        _check(self.lr > 0, "lr", "positive", self.lr)
        _check(self.adamw_lr is None or (_is_number(self.adamw_lr) and 0 < self.adamw_lr < math.inf), "adamw_lr",
               "a positive number or None", self.adamw_lr)
        _check(_is_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "in [0, 1]",
               self.min_lr_ratio)
        _check(self.warmup_steps is None or (_is_int(self.warmup_steps) and 0 <= self.warmup_steps <= self.steps),
               "warmup_steps", f"None or an integer in [0, steps={self.steps}]", self.warmup_steps)
        _check(self.threads is None or (_is_int(self.threads) and self.threads > 0), "threads",
               "None or a positive integer", self.threads)
        _check(self.eval_seq_len is None or (_is_int(self.eval_seq_len) and self.eval_seq_len > 0),
               "eval_seq_len", "None or a positive integer", self.eval_seq_len)
        _check(self.max_minutes is None or (_is_number(self.max_minutes) and self.max_minutes > 0),
               "max_minutes", "None or a positive number", self.max_minutes)
        _check(self.stop_at is None or (_is_int(self.stop_at) and 0 < self.stop_at <= self.steps),
               "stop_at", f"None or an integer in [1, steps={self.steps}]", self.stop_at)
        _check(_is_number(self.eval_fraction) and 0 < self.eval_fraction < 1, "eval_fraction", "in (0, 1)",
               self.eval_fraction)
        _check(len(self.stages) > 0, "stages", "a non-empty list of (fraction, seq_len)", self.stages)
        for fraction, seq_len in self.stages:
            _check(0 < fraction <= 1 and seq_len > 0, "stages",
                   "pairs of (fraction in (0, 1], positive seq_len)", self.stages)
        _check(abs(sum(f for f, _ in self.stages) - 1.0) < 1e-6, "stages", "fractions summing to 1", self.stages)
        lengths = [s for _, s in self.stages]
        _check(lengths == sorted(lengths), "stages", "non-decreasing seq_len (short context first)", self.stages)

    # ---- derived schedule -------------------------------------------------------------------------------------
    @property
    def resolved_warmup(self) -> int:
        return max(1, self.steps // 20) if self.warmup_steps is None else self.warmup_steps

    @property
    def resolved_eval_seq_len(self) -> int:
        return self.eval_seq_len if self.eval_seq_len is not None else self.stages[-1][1]

    def stage_bounds(self) -> list[int]:
        """Exclusive end step of each stage (the last is ``steps``)."""
        bounds, total = [], 0.0
        for fraction, _ in self.stages:
            total += fraction
            bounds.append(min(self.steps, round(total * self.steps)))
        bounds[-1] = self.steps
        return bounds

    def stage_at(self, step: int) -> tuple[int, int, int]:
        """``(stage index, seq_len, rows)`` of the 0-based step ``step``."""
        for index, end in enumerate(self.stage_bounds()):
            if step < end:
                seq_len = self.stages[index][1]
                return index, seq_len, max(1, self.batch_tokens // seq_len)
        raise ValueError(f"step {step} is past the last stage (steps={self.steps})")

    def lr_factor(self, step: int) -> float:
        """Multiplier of the peak LR for the 0-based step ``step``: linear warmup, then cosine to min_lr_ratio."""
        warmup = self.resolved_warmup
        if step < warmup:
            return (step + 1) / warmup
        span = max(1, self.steps - warmup - 1)
        progress = min(1.0, (step - warmup) / span)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    # ---- serialisation ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["stages"] = [list(s) for s in self.stages]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrainError(f"TrainConfig: unknown field(s) {', '.join(unknown)}")
        return cls(**data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, what: str, value: Any) -> None:
    if not ok:
        raise TrainError(f"TrainConfig.{name} must be {what}, got {value!r}")


def resume_config(out_dir: str | os.PathLike, **overrides: Any) -> TrainConfig:
    """The config of the run in ``out_dir`` with ``overrides`` applied (``resume=True``).

    Overriding a setting that changes what the run computes with a different value is an error naming it.
    """
    checkpoint_dir = ckpt.latest_checkpoint(out_dir) if Path(out_dir).is_dir() else None
    if checkpoint_dir is None:
        raise TrainError(f"cannot resume: {str(out_dir)!r} has no checkpoint (no {ckpt.LATEST} file)")
    saved = ckpt.read_trainer_state(checkpoint_dir)["train_config"]
    for name, value in overrides.items():
        if name not in saved:
            raise TrainError(f"TrainConfig has no field {name!r}")
        if name not in RUNTIME_FIELDS and _normalise(value) != _normalise(saved[name]):
            raise TrainError(
                f"{name}={value!r} differs from the run's {saved[name]!r}; a resumed run keeps the settings "
                f"that decide what it computes (start a new run in another folder to change them)"
            )
    return TrainConfig.from_dict({**saved, **overrides, "out_dir": str(out_dir), "resume": True})


def _normalise(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_normalise(v) for v in value]
    return value


# ---- results ---------------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    """What a call to ``train`` did. Loss histories cover the whole run, including before a resume."""

    out_dir: Path
    step: int
    """Steps completed so far (equals ``steps`` when the run finished)."""
    steps: int
    stopped: str | None
    """None when the run finished; otherwise why it stopped early: "stop_at", "time limit", "interrupted"
    (Ctrl-C) or "cancelled" (``LoopHooks.should_stop``)."""
    checkpoint: Path
    plot: Path
    metrics: Path
    train_losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, loss) for every step; the loss of the batch that update ``step`` was computed on."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, held-out loss) after ``step`` updates."""
    tokens: int = 0
    """Training tokens processed over the whole run."""
    wall_seconds: float = 0.0
    """Wall time of this call."""

    @property
    def finished(self) -> bool:
        return self.stopped is None


# ---- the loop --------------------------------------------------------------------------------------------------
def train(cfg: TrainConfig, *, hooks: LoopHooks | None = None) -> TrainResult:
    """Run (or resume) pretraining as configured; see the module docstring.

    ``hooks`` lets a supervisor follow the run and stop it (``k3.model.training_loop.LoopHooks``).
    """
    started = time.monotonic()
    out = Path(cfg.out_dir)
    if cfg.resume:
        checkpoint_dir = ckpt.latest_checkpoint(out) if out.is_dir() else None
        if checkpoint_dir is None:
            raise TrainError(f"cannot resume: {str(out)!r} has no checkpoint (no {ckpt.LATEST} file)")
        _check_same_run(cfg, TrainConfig.from_dict(ckpt.read_trainer_state(checkpoint_dir)["train_config"]))
    else:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise TrainError(f"out_dir {str(out)!r} exists and is not empty; resume it or choose a new folder")
        checkpoint_dir = None
    device = _device(cfg.device)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _load_tokenizer(cfg, checkpoint_dir)
    model_config = _model_config(cfg, checkpoint_dir, tokenizer)
    try:
        corpus_cfg = CorpusConfig(cfg.corpus_root, cfg.corpus_max_bytes, cfg.eval_fraction)
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    try:
        corpus = load_corpus(corpus_cfg, tokenizer, cfg.cache_dir or out / "cache")
    except ValueError as exc:
        raise TrainError(f"corpus: {exc}") from None
    longest = max(cfg.stages[-1][1], cfg.resolved_eval_seq_len)
    if longest + 1 > min(corpus.train.num_tokens, corpus.eval.num_tokens):
        raise TrainError(f"corpus too small for windows of {longest} tokens (train {corpus.train.num_tokens}, "
                         f"eval {corpus.eval.num_tokens} tokens); raise corpus_max_bytes")

    from k3.model.muon import PerHeadMuon
    from k3.model.transformer import K3Model

    with deterministic(device), torch_threads(cfg.threads):
        # Seeding the global generators is what makes initialisation reproducible; on resume they are
        # overwritten by the checkpoint's saved states below.
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        model = K3Model(model_config).to(device)
        optimizer = PerHeadMuon(
            model.optimizer_groups(), lr=cfg.lr, adamw_lr=cfg.adamw_lr, weight_decay=cfg.weight_decay
        )
        base_lrs = [group["lr"] for group in optimizer.param_groups]
        sampler = WindowSampler(corpus.train.num_tokens, cfg.seed)
        metrics_path = out / "metrics.jsonl"
        step, tokens, elapsed_before = 0, 0, 0.0
        if checkpoint_dir is not None:
            state = ckpt.load_training_state(checkpoint_dir, model, optimizer)
            if state["corpus_key"] != corpus.key:
                raise TrainError(
                    f"the corpus or tokenizer changed since {checkpoint_dir.name} (data key {corpus.key}, "
                    f"checkpoint {state['corpus_key']}); resuming would not continue the same run"
                )
            sampler.load_state_dict(state["sampler"])
            ckpt.restore_rng_state(state["rng"])
            step, tokens, elapsed_before = state["step"], state["tokens"], state["elapsed_s"]
            truncate_metrics(metrics_path, step)
        train_hist, eval_hist = read_metrics(metrics_path)
        fixed_eval = list(eval_batches(
            corpus.eval, cfg.resolved_eval_seq_len, max(1, cfg.batch_tokens // cfg.resolved_eval_seq_len),
            cfg.eval_batches,
        ))
        moe_layers = [m for m in model.modules() if hasattr(m, "expert_bias") and hasattr(m, "top_k")]
        for moe in moe_layers:
            moe.record_scores = cfg.balance_experts

        loop = _Loop(
            cfg=cfg, out=out, model=model, model_config=model_config, optimizer=optimizer, base_lrs=base_lrs,
            sampler=sampler, corpus=corpus, tokenizer=tokenizer, fixed_eval=fixed_eval, moe_layers=moe_layers,
            metrics_path=metrics_path, train_hist=train_hist, eval_hist=eval_hist, hooks=hooks or LoopHooks(),
        )
        stopped = loop.run(step, tokens, elapsed_before, started)
    return TrainResult(
        out_dir=out,
        step=loop.step,
        steps=cfg.steps,
        stopped=stopped,
        checkpoint=loop.last_checkpoint,
        plot=out / "loss.png",
        metrics=metrics_path,
        train_losses=train_hist,
        eval_losses=eval_hist,
        tokens=loop.tokens,
        wall_seconds=time.monotonic() - started,
    )


@dataclass
class _Loop(TrainingLoop):
    """The mutable state of one ``train`` call, split out so each phase reads as one short method."""

    cfg: TrainConfig
    out: Path
    model: torch.nn.Module
    model_config: K3Config
    optimizer: torch.optim.Optimizer
    base_lrs: list[float]
    sampler: WindowSampler
    corpus: TokenizedCorpus
    tokenizer: Any
    fixed_eval: list[PackedBatch]
    moe_layers: list[torch.nn.Module]
    metrics_path: Path
    train_hist: list[tuple[int, float]]
    eval_hist: list[tuple[int, float]]
    hooks: LoopHooks = field(default_factory=LoopHooks)
    step: int = 0
    tokens: int = 0
    elapsed_before: float = 0.0
    started: float = 0.0
    last_checkpoint: Path | None = None
    saved_step: int = -1

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def train_step(self) -> dict[str, Any]:
        cfg, model = self.cfg, self.model
        t0 = time.monotonic()
        stage, seq_len, rows = cfg.stage_at(self.step)
        batch = self.sampler.next_batch(self.corpus.train, rows, seq_len)
        factor = cfg.lr_factor(self.step)
        set_lr(self.optimizer, self.base_lrs, factor)
        model.train()
        loss = self.loss(batch)
        if not torch.isfinite(loss):
            raise TrainError(f"the loss became {loss.item()} at step {self.step + 1}; lower lr (now {cfg.lr})")
        grad_norm = update(model, self.optimizer, loss, cfg.grad_clip)
        max_load = self.balance_experts()
        self.step += 1
        self.tokens += batch.input_ids.numel()
        dt = time.monotonic() - t0
        info = {
            "kind": "train", "step": self.step, "loss": loss.item(), "lr": cfg.lr * factor, "grad_norm": grad_norm,
            "stage": stage, "seq_len": seq_len, "rows": rows, "tokens": self.tokens,
            "tokens_per_s": batch.input_ids.numel() / dt if dt > 0 else None, "max_expert_load": max_load,
            "elapsed_s": self.elapsed(),
        }
        self.train_hist.append((self.step, info["loss"]))
        self.record(info)
        return info

    def bar_fields(self, info: dict[str, Any] | None) -> dict[str, str]:
        if info is None:
            return {"loss": "-", "tps": "-", "stage": "-"}
        return {"loss": f"{info['loss']:.4f}", "tps": f"{info['tokens_per_s'] or 0.0:,.0f}",
                "stage": f"{info['stage'] + 1} (ctx {info['seq_len']}x{info['rows']})"}

    def loss(self, batch: PackedBatch) -> torch.Tensor:
        return self.model.loss(
            batch.input_ids.to(self.device), batch.targets.to(self.device), batch.cu_seqlens.to(self.device)
        )

    def balance_experts(self) -> float | None:
        """Quantile-balance every router from this step's scores; return the worst max/mean expert load."""
        return balance_routers(self.moe_layers, self.cfg.balance_experts)

    def evaluate(self, bar: ProgressBar) -> float:
        value = mean_eval_loss(self.model, self.fixed_eval, self.loss, self.moe_layers)
        self.eval_hist.append((self.step, value))
        self.record({"kind": "eval", "step": self.step, "loss": value, "tokens": self.tokens,
                     "elapsed_s": self.elapsed()})
        bar.note(f"step {self.step}: eval loss {value:.4f}")
        self.plot()
        return value

    def save(self) -> None:
        trainer_state = {
            "sampler": self.sampler.state_dict(),
            "rng": ckpt.capture_rng_state(),
            "tokens": self.tokens,
            "elapsed_s": self.elapsed(),
            "corpus_key": self.corpus.key,
            "train_config": self.cfg.to_dict(),
        }
        self.saved(ckpt.save_checkpoint(
            self.out, self.step, model=self.model, optimizer=self.optimizer, model_config=self.model_config,
            tokenizer=self.tokenizer, trainer_state=trainer_state, keep_last=self.cfg.keep_last,
        ))

    def plot(self) -> None:
        plot_losses(self.out / "loss.png", self.train_hist, self.eval_hist, self.cfg)


# ---- pieces ----------------------------------------------------------------------------------------------------
def _check_same_run(cfg: TrainConfig, saved: TrainConfig) -> None:
    for f in dataclasses.fields(TrainConfig):
        if f.name in RUNTIME_FIELDS:
            continue
        if getattr(cfg, f.name) != getattr(saved, f.name):
            raise TrainError(
                f"TrainConfig.{f.name}={getattr(cfg, f.name)!r} differs from the run's {getattr(saved, f.name)!r}; "
                f"a resumed run keeps the settings that decide what it computes"
            )


def _load_tokenizer(cfg: TrainConfig, checkpoint_dir: Path | None) -> Any:
    from k3.model.data import tokenizer_fingerprint
    from k3.model.tokenizer import ByteTokenizer, load_tokenizer

    chosen = None
    if cfg.tokenizer_dir is not None:
        if not (Path(cfg.tokenizer_dir) / "k3_tokenizer.json").is_file():
            raise TrainError(f"tokenizer_dir {cfg.tokenizer_dir!r} holds no saved tokenizer (k3_tokenizer.json)")
        chosen = load_tokenizer(cfg.tokenizer_dir)
    if checkpoint_dir is None:
        return chosen if chosen is not None else ByteTokenizer()
    saved = load_tokenizer(checkpoint_dir / "tokenizer")
    if chosen is not None and tokenizer_fingerprint(chosen) != tokenizer_fingerprint(saved):
        raise TrainError(f"tokenizer_dir {cfg.tokenizer_dir!r} is not the tokenizer this run was trained with")
    return saved


def _model_config(cfg: TrainConfig, checkpoint_dir: Path | None, tokenizer: Any) -> Any:
    from k3.model.presets import get_preset

    try:
        model_config = get_preset(cfg.preset)
    except (KeyError, ValueError) as exc:
        raise TrainError(f"TrainConfig.preset: {exc.args[0] if exc.args else exc}") from None
    if cfg.model_overrides:
        try:
            model_config = K3Config.from_dict({**model_config.to_dict(), **cfg.model_overrides})
        except (TypeError, ValueError) as exc:
            raise TrainError(f"TrainConfig.model_overrides: {exc}") from None
    if checkpoint_dir is not None:
        model_config = ckpt.read_model_config(checkpoint_dir)
    if model_config.vocab_size < tokenizer.vocab_size:
        raise TrainError(f"preset {cfg.preset!r} has vocab_size {model_config.vocab_size}, smaller than the "
                         f"tokenizer's {tokenizer.vocab_size}")
    longest = max(cfg.stages[-1][1], cfg.resolved_eval_seq_len)
    if longest > model_config.max_seq_len:
        raise TrainError(f"TrainConfig.stages/eval_seq_len reach {longest} tokens, beyond the preset's "
                         f"max_seq_len {model_config.max_seq_len}")
    return model_config


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TrainError(f"TrainConfig.device {name!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"TrainConfig.device is {name!r} but no CUDA device is available")
    return device
