"""Supervised fine-tuning as a library: ``sft(SFTConfig) -> SFTResult``.

Starts from a pretraining checkpoint (``k3 train``) and trains on XTML conversations from
``k3.model.sft_data``, with the loss only on the assistant's tokens. One process, one device. It follows the
pretraining loop's conventions and shares its pieces (``k3.model.training_loop``): the control flow, the
checkpoint format (weights, optimizer, trainer state, config and tokenizer; ``latest``), ``metrics.jsonl``,
``loss.png``, Per-Head Muon under warmup + cosine, Quantile Balancing of the routers, Ctrl-C handling, the
supervisor's hooks and deterministic CPU kernels.

Design decisions:

- **Masked cross-entropy.** A step packs whole conversations into one ``[1, N]`` row with ``cu_seqlens``
  (each conversation its own sequence, so nothing attends or carries state across them). The label of
  position t is token t+1 when the mask marks token t+1 as assistant output, else ``IGNORE_INDEX``; the loss
  is the mean over assistant tokens of the step.
- **Token budget per step.** Conversations vary in length, so a step draws conversations until the next one
  would overflow ``batch_tokens`` (that one is dropped); no padding is ever computed.
- **Counter-based sampling.** The conversations of step s come from a generator seeded with ``(seed, s)``:
  the kind is drawn by the mix weights, then an index into that kind's (virtually unbounded) train split. A
  resumed run therefore needs nothing but the step number, and stopping at step k then resuming reproduces
  the uninterrupted run bit for bit on the CPU (weights, optimizer, router biases and RNG states are in the
  checkpoint).
- **Eval** is the assistant-token loss on fixed held-out conversations (the eval split of ``sft_data``,
  never trained on), shared between kinds by the mix weights.
- A resumed run may change only how it runs (``RUNTIME_FIELDS``); the settings that decide what it computes
  are frozen at the first start, including the starting checkpoint and the data mix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from k3.model import checkpoint as ckpt
from k3.model.data import IGNORE_INDEX, tokenizer_fingerprint
from k3.model.sft_data import DATA_FORMAT, KINDS, ConversationBank, SFTDataError, SFTExample, parse_mix
from k3.model.train import TrainConfig
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

RUNTIME_FIELDS = frozenset({
    "out_dir", "resume", "eval_every", "save_every", "keep_last", "max_minutes", "stop_at", "progress",
    "device", "threads",
})
"""Fields a resumed run may change: they decide how the run is carried out, not what it computes."""


class SFTError(ValueError):
    """An SFT run cannot start or continue as configured (the message names the setting)."""


@dataclass
class SFTConfig:
    """Everything an SFT run needs. Fields are validated on construction."""

    out_dir: str
    """Run folder: checkpoints, ``latest``, ``metrics.jsonl`` and ``loss.png``."""
    checkpoint: str | None = None
    """Pretrained checkpoint (a checkpoint folder or a run folder, whose latest checkpoint is used) to start
    from. Required for a new run; a resumed run continues from its own checkpoints."""
    steps: int = 200
    """Optimizer steps of the whole run; the LR schedule spans exactly these."""
    seed: int = 0
    """Seeds the conversations (``ConversationBank``) and the order they are drawn in."""
    mix: str | dict[str, float] = "reasoning=0.5,tools=0.5"
    """Share of each conversation kind, ``"reasoning=0.5,tools=0.5"`` or a mapping; stored normalised."""
    lr: float = 0.005
    """Peak learning rate of the Muon groups (lower than pretraining's: the model is already trained)."""
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
    batch_tokens: int = 4096
    """Token budget of one step: whole conversations are packed until the next would overflow it."""
    eval_every: int = 50
    """Evaluate every this many steps (and at step 0 and at the end); 0 evaluates only at start and end."""
    eval_conversations: int = 16
    """Number of fixed held-out conversations the eval loss is measured on."""
    save_every: int = 100
    """Checkpoint every this many steps (0: only at the end or when stopped)."""
    keep_last: int = 2
    """Keep this many newest checkpoints (0 keeps all)."""
    max_minutes: float | None = None
    """Stop (with a checkpoint) once this invocation has run this long; None means no limit."""
    stop_at: int | None = None
    """Stop (with a checkpoint) after this step although the schedule spans ``steps``; resume continues."""
    device: str = "cpu"
    """Torch device to train on; the run is bitwise reproducible on the CPU."""
    threads: int | None = None
    """CPU threads for torch during the run; None keeps torch's default."""
    balance_experts: bool = True
    """Re-balance every MoE router after each step with Quantile Balancing (DESIGN.md §1.6)."""
    resume: bool = False
    """Continue the run in ``out_dir`` from its latest checkpoint instead of starting a new one."""
    progress: bool = True
    """Show a live progress bar on the terminal."""

    def __post_init__(self) -> None:
        _check(isinstance(self.out_dir, str | os.PathLike) and str(self.out_dir) != "", "out_dir",
               "a folder path", self.out_dir)
        self.out_dir = str(self.out_dir)
        _check(self.checkpoint is None or (isinstance(self.checkpoint, str | os.PathLike)
                                           and str(self.checkpoint) != ""),
               "checkpoint", "a checkpoint folder or None", self.checkpoint)
        if self.checkpoint is not None:
            self.checkpoint = str(Path(self.checkpoint).resolve())
        _check(self.resume or self.checkpoint is not None, "checkpoint",
               "given for a new run (the pretrained checkpoint to start from)", self.checkpoint)
        try:
            self.mix = parse_mix(self.mix)
        except SFTDataError as exc:
            raise SFTError(f"SFTConfig.{exc}") from None
        for name in ("steps", "batch_tokens", "eval_conversations"):
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
        _check(self.max_minutes is None or (_is_number(self.max_minutes) and self.max_minutes > 0),
               "max_minutes", "None or a positive number", self.max_minutes)
        _check(self.stop_at is None or (_is_int(self.stop_at) and 0 < self.stop_at <= self.steps),
               "stop_at", f"None or an integer in [1, steps={self.steps}]", self.stop_at)
        _check(self.threads is None or (_is_int(self.threads) and self.threads > 0), "threads",
               "None or a positive integer", self.threads)

    def schedule(self) -> TrainConfig:
        """The LR schedule as the pretraining config computes it (one stage; only the schedule is used)."""
        return TrainConfig(out_dir=self.out_dir, preset="sft", steps=self.steps, lr=self.lr,
                           warmup_steps=self.warmup_steps, min_lr_ratio=self.min_lr_ratio,
                           stages=((1.0, self.batch_tokens),), progress=self.progress)

    def eval_counts(self) -> dict[str, int]:
        """Held-out conversations per kind: ``eval_conversations`` shared by the mix (>= 1 per used kind)."""
        used = [k for k in KINDS if self.mix[k] > 0]
        return {k: max(1, round(self.eval_conversations * self.mix[k])) for k in used}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SFTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SFTError(f"SFTConfig: unknown field(s) {', '.join(unknown)}")
        return cls(**data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check(ok: bool, name: str, what: str, value: Any) -> None:
    if not ok:
        raise SFTError(f"SFTConfig.{name} must be {what}, got {value!r}")


def resume_sft_config(out_dir: str | os.PathLike, **overrides: Any) -> SFTConfig:
    """The config of the SFT run in ``out_dir`` with ``overrides`` applied (``resume=True``).

    Overriding a setting that changes what the run computes with a different value is an error naming it.
    """
    saved = _saved_config(Path(out_dir))
    for name, value in overrides.items():
        if name not in saved:
            raise SFTError(f"SFTConfig has no field {name!r}")
        if name in RUNTIME_FIELDS:
            continue
        given = SFTConfig.from_dict({**saved, name: value, "resume": True})
        if getattr(given, name) != saved[name]:
            raise SFTError(
                f"{name}={value!r} differs from the run's {saved[name]!r}; a resumed run keeps the settings "
                f"that decide what it computes (start a new run in another folder to change them)"
            )
    return SFTConfig.from_dict({**saved, **overrides, "out_dir": str(out_dir), "resume": True})


def _saved_config(out: Path) -> dict[str, Any]:
    checkpoint_dir = ckpt.latest_checkpoint(out) if out.is_dir() else None
    if checkpoint_dir is None:
        raise SFTError(f"cannot resume: {str(out)!r} has no checkpoint (no {ckpt.LATEST} file)")
    state = ckpt.read_trainer_state(checkpoint_dir)
    if "sft_config" not in state:
        raise SFTError(f"cannot resume: {checkpoint_dir} is not an SFT checkpoint (no sft_config)")
    return state["sft_config"]


# ---- packing ---------------------------------------------------------------------------------------------------
@dataclass
class PackedChats:
    """Whole conversations packed into one row; ``cu_seqlens`` bounds each conversation."""

    input_ids: torch.Tensor
    """``[1, N]`` int64 token ids."""
    labels: torch.Tensor
    """``[1, N]`` int64: the next token where it is assistant output, else ``IGNORE_INDEX``."""
    cu_seqlens: torch.Tensor
    """``[conversations + 1]`` int32 cumulative lengths."""

    @property
    def num_conversations(self) -> int:
        return int(self.cu_seqlens.numel() - 1)

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def pack_examples(examples: Sequence[SFTExample]) -> PackedChats:
    """Pack SFT examples with masked next-token labels (no label crosses a conversation's end)."""
    if not examples:
        raise SFTError("pack_examples needs at least one conversation")
    ids: list[int] = []
    labels: list[int] = []
    cu = [0]
    for example in examples:
        if len(example.input_ids) != len(example.loss_mask) or len(example.input_ids) < 2:
            raise SFTError("an SFT example needs equally long input_ids and loss_mask of at least 2 tokens")
        ids.extend(example.input_ids)
        labels.extend(t if m else IGNORE_INDEX for t, m in zip(example.input_ids[1:], example.loss_mask[1:],
                                                                strict=True))
        labels.append(IGNORE_INDEX)  # the last token has no successor inside its conversation
        cu.append(len(ids))
    return PackedChats(
        input_ids=torch.tensor([ids], dtype=torch.long),
        labels=torch.tensor([labels], dtype=torch.long),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
    )


class ChatSampler:
    """Draws the conversations of step ``s`` from a generator seeded with ``(seed, s)`` (module docstring)."""

    def __init__(self, bank: ConversationBank, tokenizer: Any, mix: dict[str, float], seed: int,
                 batch_tokens: int, max_seq_len: int) -> None:
        self.bank, self.tokenizer, self.seed = bank, tokenizer, seed
        self.kinds = [k for k in KINDS if mix[k] > 0]
        self.weights = np.asarray([mix[k] for k in self.kinds], dtype=np.float64)
        self.weights /= self.weights.sum()
        self.batch_tokens, self.max_seq_len = batch_tokens, max_seq_len

    def batch(self, step: int) -> PackedChats:
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        examples: list[SFTExample] = []
        total = 0
        while True:
            kind = self.kinds[int(rng.choice(len(self.kinds), p=self.weights))]
            index = int(rng.integers(0, 1 << 40))
            example = self.bank.example(self.bank.conversation(kind, index), self.tokenizer)
            n = len(example.input_ids)
            if n > self.max_seq_len:
                raise SFTError(f"a {kind} conversation of {n} tokens exceeds the model's max_seq_len "
                               f"{self.max_seq_len}")
            if total + n > self.batch_tokens:
                if not examples:
                    raise SFTError(f"SFTConfig.batch_tokens={self.batch_tokens} is smaller than a {kind} "
                                   f"conversation of {n} tokens; raise it")
                return pack_examples(examples)
            examples.append(example)
            total += n


def eval_batches(bank: ConversationBank, tokenizer: Any, counts: dict[str, int],
                 batch_tokens: int) -> list[PackedChats]:
    """The fixed held-out conversations, packed in order into batches of at most ``batch_tokens``."""
    examples = [bank.example(conv, tokenizer) for kind, n in counts.items() for conv in bank.held_out(kind, n)]
    batches: list[PackedChats] = []
    current: list[SFTExample] = []
    for example in examples:
        if current and sum(len(e.input_ids) for e in current) + len(example.input_ids) > batch_tokens:
            batches.append(pack_examples(current))
            current = []
        current.append(example)
    batches.append(pack_examples(current))
    return batches


def data_key(tokenizer: Any) -> str:
    """Changes whenever the conversations or their token ids could change (format, reasoning-gym, tokenizer)."""
    from importlib.metadata import version

    source = f"{DATA_FORMAT}:{version('reasoning-gym')}:{tokenizer_fingerprint(tokenizer)}"
    return hashlib.sha256(source.encode()).hexdigest()[:20]


# ---- results ---------------------------------------------------------------------------------------------------
@dataclass
class SFTResult:
    """What a call to ``sft`` did. Loss histories cover the whole run, including before a resume."""

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
    """(step, assistant-token loss) of every step."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    """(step, held-out assistant-token loss) after ``step`` updates."""
    tokens: int = 0
    """Tokens (all roles) processed over the whole run."""
    wall_seconds: float = 0.0

    @property
    def finished(self) -> bool:
        return self.stopped is None


# ---- the loop --------------------------------------------------------------------------------------------------
def load_base(path: str | os.PathLike) -> tuple[Path, Any, Any]:
    """``(checkpoint folder, K3Config, tokenizer)`` of a pretrained checkpoint, with errors naming the problem."""
    from k3.model.tokenizer import load_tokenizer

    try:
        checkpoint_dir = ckpt.resolve_checkpoint(path)
    except ckpt.CheckpointError as exc:
        raise SFTError(f"checkpoint: {exc}") from None
    try:
        model_config = ckpt.read_model_config(checkpoint_dir)
        tokenizer = load_tokenizer(checkpoint_dir / "tokenizer")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SFTError(f"checkpoint {str(checkpoint_dir)!r} is not a valid k3 checkpoint: {exc}") from None
    if model_config.vocab_size < tokenizer.vocab_size:
        raise SFTError(f"checkpoint {str(checkpoint_dir)!r}: model vocab_size {model_config.vocab_size} is "
                       f"smaller than its tokenizer's {tokenizer.vocab_size}")
    return checkpoint_dir, model_config, tokenizer


def _load_weights(model: torch.nn.Module, checkpoint_dir: Path) -> None:
    try:
        ckpt.load_weights(model, checkpoint_dir)
    except ckpt.CheckpointError as exc:
        raise SFTError(f"checkpoint: {exc}") from None
    except (SafetensorError, OSError) as exc:
        raise SFTError(f"checkpoint {str(checkpoint_dir)!r}: cannot read model.safetensors: {exc}") from None


def sft(cfg: SFTConfig, *, hooks: LoopHooks | None = None) -> SFTResult:
    """Run (or resume) supervised fine-tuning as configured; see the module docstring.

    ``hooks`` lets a supervisor follow the run and stop it (``k3.model.training_loop.LoopHooks``).
    """
    started = time.monotonic()
    out = Path(cfg.out_dir)
    if cfg.resume:
        saved = SFTConfig.from_dict({**_saved_config(out), "resume": True})
        for f in dataclasses.fields(SFTConfig):
            if f.name == "checkpoint" and cfg.checkpoint is None:
                continue  # a resumed run starts from its own checkpoints; naming the base again is optional
            if f.name not in RUNTIME_FIELDS and getattr(cfg, f.name) != getattr(saved, f.name):
                raise SFTError(f"SFTConfig.{f.name}={getattr(cfg, f.name)!r} differs from the run's "
                               f"{getattr(saved, f.name)!r}; a resumed run keeps the settings that decide what "
                               f"it computes")
        if cfg.checkpoint is None:
            cfg = dataclasses.replace(cfg, checkpoint=saved.checkpoint)
        start_dir = ckpt.latest_checkpoint(out)
    else:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise SFTError(f"out_dir {str(out)!r} exists and is not empty; resume it or choose a new folder")
        start_dir = None
    base_dir, model_config, tokenizer = load_base(start_dir if start_dir is not None else cfg.checkpoint)
    out.mkdir(parents=True, exist_ok=True)

    from k3.model.muon import PerHeadMuon
    from k3.model.transformer import K3Model

    key = data_key(tokenizer)
    bank = ConversationBank(cfg.seed)
    device = torch.device(cfg.device)
    with deterministic(device), torch_threads(cfg.threads):
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        model = K3Model(model_config)
        if start_dir is None:
            _load_weights(model, base_dir)
        model = model.to(device)
        optimizer = PerHeadMuon(model.optimizer_groups(), lr=cfg.lr, adamw_lr=cfg.adamw_lr,
                                weight_decay=cfg.weight_decay)
        base_lrs = [group["lr"] for group in optimizer.param_groups]
        metrics_path = out / "metrics.jsonl"
        step, tokens, elapsed_before = 0, 0, 0.0
        if start_dir is not None:
            state = ckpt.load_training_state(start_dir, model, optimizer)
            if state["data_key"] != key:
                raise SFTError(f"the SFT data or tokenizer changed since {start_dir.name} (data key {key}, "
                               f"checkpoint {state['data_key']}); resuming would not continue the same run")
            ckpt.restore_rng_state(state["rng"])
            base_dir = Path(state["base_checkpoint"])  # the pretrained checkpoint the run started from
            step, tokens, elapsed_before = state["step"], state["tokens"], state["elapsed_s"]
            truncate_metrics(metrics_path, step)
        else:
            metrics_path.touch()
        train_hist, eval_hist = read_metrics(metrics_path)
        sampler = ChatSampler(bank, tokenizer, cfg.mix, cfg.seed, cfg.batch_tokens, model_config.max_seq_len)
        fixed_eval = eval_batches(bank, tokenizer, cfg.eval_counts(), cfg.batch_tokens)
        moe_layers = [m for m in model.modules() if hasattr(m, "expert_bias") and hasattr(m, "top_k")]
        for moe in moe_layers:
            moe.record_scores = cfg.balance_experts
        loop = _SFTLoop(cfg, out, model, model_config, optimizer, base_lrs, sampler, tokenizer, fixed_eval,
                        moe_layers, metrics_path, train_hist, eval_hist, key, base_dir, hooks or LoopHooks())
        stopped = loop.run(step, tokens, elapsed_before, started)
    return SFTResult(
        out_dir=out, step=loop.step, steps=cfg.steps, stopped=stopped, checkpoint=loop.last_checkpoint,
        plot=out / "loss.png", metrics=metrics_path, train_losses=train_hist, eval_losses=eval_hist,
        tokens=loop.tokens, wall_seconds=time.monotonic() - started,
    )


class _SFTLoop(TrainingLoop):
    """The mutable state of one ``sft`` call, split out so each phase reads as one short method."""

    label = "sft"
    eval_on_early_stop = False  # SFT evaluates on its cadence and at the end, not at a planned stop

    def __init__(self, cfg, out, model, model_config, optimizer, base_lrs, sampler, tokenizer, fixed_eval,
                 moe_layers, metrics_path, train_hist, eval_hist, key, base_dir, hooks: LoopHooks) -> None:
        self.cfg, self.out, self.model, self.model_config = cfg, out, model, model_config
        self.optimizer, self.base_lrs, self.sampler, self.tokenizer = optimizer, base_lrs, sampler, tokenizer
        self.fixed_eval, self.moe_layers, self.metrics_path = fixed_eval, moe_layers, metrics_path
        self.train_hist, self.eval_hist, self.key, self.base_dir = train_hist, eval_hist, key, base_dir
        self.hooks = hooks
        self.schedule = cfg.schedule()
        self.device = next(model.parameters()).device
        self.step = 0
        self.tokens = 0
        self.elapsed_before = 0.0
        self.started = 0.0
        self.last_checkpoint: Path | None = out
        self.saved_step = -1

    def train_step(self) -> dict[str, Any]:
        cfg, model = self.cfg, self.model
        t0 = time.monotonic()
        batch = self.sampler.batch(self.step)
        factor = self.schedule.lr_factor(self.step)
        set_lr(self.optimizer, self.base_lrs, factor)
        model.train()
        loss = self.loss(batch)
        if not torch.isfinite(loss):
            raise SFTError(f"the loss became {loss.item()} at step {self.step + 1}; lower lr (now {cfg.lr})")
        grad_norm = update(model, self.optimizer, loss, cfg.grad_clip)
        max_load = self.balance_experts()
        self.step += 1
        n = batch.input_ids.numel()
        self.tokens += n
        dt = time.monotonic() - t0
        info = {
            "kind": "train", "step": self.step, "loss": loss.item(), "lr": cfg.lr * factor, "grad_norm": grad_norm,
            "conversations": batch.num_conversations, "step_tokens": n, "assistant_tokens": batch.num_targets,
            "tokens": self.tokens, "tokens_per_s": n / dt if dt > 0 else None, "max_expert_load": max_load,
            "elapsed_s": self.elapsed(),
        }
        self.train_hist.append((self.step, info["loss"]))
        self.record(info)
        return info

    def bar_fields(self, info: dict[str, Any] | None) -> dict[str, str]:
        if info is None:
            return {"loss": "-", "tps": "-", "convs": "-"}
        return {"loss": f"{info['loss']:.4f}", "tps": f"{info['tokens_per_s'] or 0.0:,.0f}",
                "convs": str(info["conversations"])}

    def loss(self, batch: PackedChats) -> torch.Tensor:
        return self.model.loss(batch.input_ids.to(self.device), batch.labels.to(self.device),
                               batch.cu_seqlens.to(self.device))

    def balance_experts(self) -> float | None:
        """Quantile-balance every router from this step's scores; return the worst max/mean expert load."""
        return balance_routers(self.moe_layers, self.cfg.balance_experts)

    def evaluate(self, bar: ProgressBar) -> float:
        value = mean_eval_loss(self.model, self.fixed_eval, self.loss, self.moe_layers)
        self.eval_hist.append((self.step, value))
        self.record({"kind": "eval", "step": self.step, "loss": value, "tokens": self.tokens,
                     "elapsed_s": self.elapsed()})
        bar.note(f"step {self.step}: held-out assistant loss {value:.4f}")
        self.plot()
        return value

    def save(self) -> None:
        trainer_state = {
            "rng": ckpt.capture_rng_state(),
            "tokens": self.tokens,
            "elapsed_s": self.elapsed(),
            "data_key": self.key,
            "base_checkpoint": str(self.base_dir),
            "sft_config": self.cfg.to_dict(),
        }
        self.saved(ckpt.save_checkpoint(
            self.out, self.step, model=self.model, optimizer=self.optimizer, model_config=self.model_config,
            tokenizer=self.tokenizer, trainer_state=trainer_state, keep_last=self.cfg.keep_last,
        ))

    def plot(self) -> None:
        base = Path(self.cfg.checkpoint).name if self.cfg.checkpoint else "?"
        plot_losses(self.out / "loss.png", self.train_hist, self.eval_hist, self.schedule, stage_marks=False,
                    title=f"k3 SFT from {base} — assistant-token loss")
