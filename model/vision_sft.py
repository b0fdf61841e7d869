"""Multimodal training: the vision encoder, its projector and the language model trained together on
image-text chats. ``vision_sft(VisionSFTConfig) -> VisionSFTResult``; ``k3 sft --task vision-count`` and
``k3 sft --vision-data FILE.jsonl`` run it (``k3 train --task vision-count`` starts from a fresh preset).

A step draws ``batch_size`` samples, encodes all their images in one packed forward pass of the encoder (with
gradients), packs the chats into one ``[1, N]`` row with ``cu_seqlens`` (nothing attends across samples) and
inserts the visual tokens at the placeholder positions (``k3.model.multimodal``); the loss is the mean
cross-entropy over the answers. One Per-Head Muon optimizer holds both models: the language model's own
groups, and for the encoder whole-matrix Muon on its 2-D weights and AdamW on the rest. The MoE routers are
re-balanced after each step as in pretraining.

Design decisions:

- **Start**: from a pretrained checkpoint (``checkpoint``: a ``k3 train``/``k3 sft`` run or checkpoint folder,
  whose tokenizer is kept) or from a fresh ``preset`` with the byte tokenizer. The encoder is a fresh
  ``vision_preset`` whose projector outputs the language model's width.
- **Visual tokens start at the embedding scale.** A fresh projector's output is about 20 times smaller than
  the language model's token embeddings (``tiny``: norm 0.6 against 11), so the model would first have to
  learn to notice the image at all. ``match_embedding_scale`` rescales the projector's last layer once, at the
  start, so that the visual tokens of a fixed noise image have the RMS of the token embeddings.
- **Eval** is the held-out exact-match accuracy of the greedy answer (every answer token is the argmax given
  the prompt and the answer so far, i.e. what greedy decoding would write) on fixed held-out samples, next
  to chance (the share of the most common held-out answer), plus the held-out answer loss.
- **Checkpoint**: the pretraining format (``k3.model.checkpoint``; the language model in ``model.safetensors``,
  so prefill and decode load it unchanged) with the encoder in ``vision/`` (``vision_config.json`` +
  ``model.safetensors``, the vision service's checkpoint format), written atomically with the rest.
  Resuming a multimodal run is not supported: a stopped run keeps its last checkpoint, and a new run can
  start from it with ``checkpoint``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from k3.model import checkpoint as ckpt
from k3.model.multimodal import merge_visual, visual_embeds
from k3.model.training_loop import progress
from k3.model.transformer import IGNORE_INDEX
from k3.model.vision.config import VISION_PRESETS, get_vision_preset
from k3.model.vision_data import TASKS, CountTask, EncodedSample, VisionDataError, VisionSample, encode_sample

VISION_FOLDER = "vision"


class VisionSFTError(ValueError):
    """A multimodal run cannot start as configured (the message names the setting)."""


@dataclass
class VisionSFTConfig:
    """Everything a multimodal training run needs. Fields are validated on construction."""

    out_dir: str
    """Run folder: checkpoints, ``latest``, ``metrics.jsonl``."""
    task: str | None = "vision-count"
    """A generated task (``vision-count``), or None to train on ``data``."""
    data: str | None = None
    """JSONL file of image-text samples (``k3.model.vision_data.load_jsonl``); every 10th line is held out."""
    checkpoint: str | None = None
    """Pretrained checkpoint or run folder to start the language model from; None starts ``preset`` fresh."""
    preset: str = "tiny"
    """Language-model preset when ``checkpoint`` is None."""
    tokenizer: str | None = None
    """Saved tokenizer folder for a fresh ``preset`` (None: the byte tokenizer); a checkpoint keeps its own."""
    vision_preset: str = "vit-tiny"
    """Vision encoder preset (its projector width is set to the language model's hidden size)."""
    steps: int = 300
    """Optimizer steps; the LR schedule (linear warmup, cosine decay) spans exactly these."""
    batch_size: int = 32
    """Samples per step."""
    lr: float = 0.01
    """Peak learning rate of every group."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at ``lr * min_lr_ratio``."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    eval_every: int = 100
    """Evaluate every this many steps (and at step 0 and at the end); 0 evaluates only at start and end."""
    eval_samples: int = 200
    """Held-out samples of each evaluation (fixed for the run)."""
    seed: int = 0
    """Seeds initialisation, the generated task and the order of samples."""
    threads: int | None = None
    """CPU threads for torch during the run; None keeps torch's default."""
    device: str = "cpu"
    """Torch device to train on."""
    max_minutes: float | None = None
    """Stop (with a checkpoint) once the run has taken this long; None means no limit."""
    progress: bool = True
    """Show a live progress bar on the terminal."""

    def __post_init__(self) -> None:
        if (self.task is None) == (self.data is None):
            raise VisionSFTError("VisionSFTConfig: give exactly one of task (a generated task) and data (a JSONL "
                                 "file)")
        if self.task is not None and self.task not in TASKS:
            raise VisionSFTError(f"VisionSFTConfig.task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.vision_preset not in VISION_PRESETS:
            raise VisionSFTError(f"VisionSFTConfig.vision_preset must be one of {', '.join(VISION_PRESETS)}, got "
                                 f"{self.vision_preset!r}")
        for name in ("steps", "batch_size", "eval_samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise VisionSFTError(f"VisionSFTConfig.{name} must be a positive integer, got {value!r}")
        for name in ("warmup_steps", "eval_every", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise VisionSFTError(f"VisionSFTConfig.{name} must be a non-negative integer, got {value!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise VisionSFTError(f"VisionSFTConfig.lr must be a positive number, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1 or self.grad_clip < 0:
            raise VisionSFTError("VisionSFTConfig.min_lr_ratio must be in [0, 1] and grad_clip >= 0")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise VisionSFTError(f"VisionSFTConfig.max_minutes must be positive, got {self.max_minutes!r}")

    def lr_factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (step - self.warmup_steps) / span)))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine


@dataclass
class Evaluation:
    step: int
    accuracy: float
    chance: float
    loss: float
    samples: int


@dataclass
class VisionSFTResult:
    out_dir: Path
    step: int
    stopped: str | None
    checkpoint: Path
    evaluations: list[Evaluation] = field(default_factory=list)
    train_losses: list[tuple[int, float]] = field(default_factory=list)
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    """CPU time of this process over the run (all threads): the cost on a shared machine."""


class SampleSource:
    """Train samples by step and fixed held-out samples, from a generated task or a JSONL file."""

    def __init__(self, cfg: VisionSFTConfig):
        self.cfg = cfg
        if cfg.task is not None:
            self.task = CountTask(cfg.seed)
            self.train: list[VisionSample] | None = None
            self.held_out = [self.task.sample("eval", i) for i in range(cfg.eval_samples)]
        else:
            from k3.model.vision_data import load_jsonl

            samples = load_jsonl(cfg.data)
            self.train = [s for i, s in enumerate(samples) if i % 10 != 9]
            self.held_out = [s for i, s in enumerate(samples) if i % 10 == 9][: cfg.eval_samples]
            if not self.train or not self.held_out:
                raise VisionSFTError(f"VisionSFTConfig.data {cfg.data!r} needs at least 10 samples (every 10th "
                                     "is held out)")

    def batch(self, step: int) -> list[VisionSample]:
        rng = np.random.Generator(np.random.PCG64([self.cfg.seed, 7, step]))
        if self.train is None:
            return [self.task.sample("train", step * self.cfg.batch_size + i) for i in range(self.cfg.batch_size)]
        return [self.train[int(i)] for i in rng.integers(0, len(self.train), self.cfg.batch_size)]


@dataclass
class PackedVisionBatch:
    """Chats packed into one row with their images (``patches``) and where their visual tokens go."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    encoded: list[EncodedSample]
    offsets: list[int]
    patched: list[Any]


def pack_samples(samples: Sequence[VisionSample], encoder_cfg, tokenizer) -> PackedVisionBatch:
    """Patchify every image, encode the chats with their token counts and pack them (module docstring)."""
    from k3.model.vision.patching import patchify

    patched, encoded, offsets, ids, labels, cu = [], [], [], [], [], [0]
    for sample in samples:
        items = [patchify(encoder_cfg, image, video=False) for image in sample.images]
        enc = encode_sample(sample, tokenizer, [p.num_tokens for p in items])
        patched += items
        offsets.append(len(ids))
        encoded.append(enc)
        ids += enc.input_ids
        labels += [t if m else IGNORE_INDEX for t, m in zip(enc.input_ids[1:], enc.loss_mask[1:], strict=True)]
        labels.append(IGNORE_INDEX)
        cu.append(len(ids))
    return PackedVisionBatch(torch.tensor([ids]), torch.tensor([labels]), torch.tensor(cu, dtype=torch.int32),
                             encoded, offsets, patched)


def batch_logits(lm, encoder, batch: PackedVisionBatch, device: torch.device) -> torch.Tensor:
    """Logits [1, N, vocab] of a packed batch, the visual tokens computed by ``encoder`` (with gradients)."""
    from k3.model.vision.patching import pack

    tokens = encoder(pack(batch.patched)).split([p.num_tokens for p in batch.patched])
    parts, k = [], 0
    for enc, offset in zip(batch.encoded, batch.offsets, strict=True):
        rows = list(tokens[k:k + len(enc.spans)])
        k += len(enc.spans)
        parts.append(visual_embeds(enc.spans, rows, offset))
    visual = merge_visual(parts)
    return lm(batch.input_ids.to(device), batch.cu_seqlens.to(device), visual)


def vision_optimizer_groups(encoder) -> list[dict]:
    """Whole-matrix Muon on the encoder's 2-D weights, AdamW on its biases and norms."""
    matrices = [p for p in encoder.parameters() if p.dim() == 2]
    rest = [p for p in encoder.parameters() if p.dim() != 2]
    return [{"params": matrices, "kind": "muon"}, {"params": rest, "kind": "adamw"}]


def build_models(cfg: VisionSFTConfig):
    """``(lm, encoder, K3Config, tokenizer)`` as the config says (fresh or from ``checkpoint``)."""
    from k3.model.presets import get_preset
    from k3.model.tokenizer import ByteTokenizer, load_tokenizer
    from k3.model.transformer import K3Model
    from k3.model.vision.encoder import VisionEncoder

    if cfg.checkpoint is not None:
        try:
            folder = ckpt.resolve_checkpoint(cfg.checkpoint)
            model_config = ckpt.read_model_config(folder)
            tokenizer = load_tokenizer(folder / "tokenizer")
            lm = K3Model(model_config)
            ckpt.load_weights(lm, folder)
        except (OSError, ValueError, KeyError) as exc:
            raise VisionSFTError(f"VisionSFTConfig.checkpoint: {exc}") from None
    else:
        try:
            model_config = get_preset(cfg.preset)
        except ValueError as exc:
            raise VisionSFTError(f"VisionSFTConfig.preset: {exc}") from None
        try:
            tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer is not None else ByteTokenizer()
        except (OSError, ValueError) as exc:
            raise VisionSFTError(f"VisionSFTConfig.tokenizer: {exc}") from None
        lm = K3Model(model_config)
    if model_config.vocab_size < tokenizer.vocab_size:
        raise VisionSFTError(f"model vocab_size {model_config.vocab_size} is smaller than the tokenizer's "
                             f"{tokenizer.vocab_size}")
    vision_config = dataclasses.replace(get_vision_preset(cfg.vision_preset),
                                        lm_hidden_size=model_config.hidden_size)
    encoder = VisionEncoder(vision_config)
    match_embedding_scale(encoder, lm)
    return lm, encoder, model_config, tokenizer


@torch.no_grad()
def match_embedding_scale(encoder, lm) -> float:
    """Scale the projector's last layer so visual tokens have the token embeddings' RMS; returns the factor."""
    noise = torch.randint(0, 256, (112, 112, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    visual = encoder.encode([noise])[0].float()
    factor = float(lm.embed.weight.float().pow(2).mean().sqrt() / visual.pow(2).mean().sqrt().clamp_min(1e-12))
    encoder.projector.fc2.weight.mul_(factor)
    encoder.projector.fc2.bias.mul_(factor)
    return factor


@torch.no_grad()
def evaluate(lm, encoder, samples: Sequence[VisionSample], tokenizer, batch_size: int,
             device: torch.device) -> tuple[float, float, float]:
    """(exact-match accuracy of the greedy answer, chance, mean answer loss) on ``samples``."""
    lm.eval()
    encoder.eval()
    correct, total_loss, total_tokens = 0, 0.0, 0
    for start in range(0, len(samples), batch_size):
        batch = pack_samples(samples[start:start + batch_size], encoder.cfg, tokenizer)
        logits = batch_logits(lm, encoder, batch, device)[0].float()
        labels = batch.labels[0].to(device)
        mask = labels != IGNORE_INDEX
        total_loss += float(torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum"))
        total_tokens += int(mask.sum())
        hits = logits.argmax(-1) == labels
        for enc, offset in zip(batch.encoded, batch.offsets, strict=True):
            positions = torch.arange(offset + enc.prompt_tokens - 1, offset + len(enc.input_ids) - 1, device=device)
            correct += int(bool(hits[positions].all()))
    lm.train()
    encoder.train()
    answers = Counter(s.answer for s in samples)
    chance = max(answers.values()) / len(samples)
    return correct / len(samples), chance, total_loss / max(1, total_tokens)


def save_vision_checkpoint(out: Path, step: int, lm, encoder, optimizer, model_config, tokenizer,
                           trainer_state: dict[str, Any]) -> Path:
    from k3.model.vision.checkpoint import save_encoder

    return ckpt.save_checkpoint(out, step, model=lm, optimizer=optimizer, model_config=model_config,
                                tokenizer=tokenizer, trainer_state=trainer_state, keep_last=2,
                                extra=lambda folder: save_encoder(encoder, folder / VISION_FOLDER))


def vision_checkpoint_folder(path: str | Path) -> Path:
    """The ``vision/`` folder of a multimodal checkpoint or run; ``CheckpointError`` if it has none."""
    folder = ckpt.resolve_checkpoint(path) / VISION_FOLDER
    if not (folder / "vision_config.json").is_file():
        raise ckpt.CheckpointError(f"{str(path)!r} holds no vision encoder ({VISION_FOLDER}/vision_config.json)")
    return folder


def load_vision_model(path: str | Path, device: str | torch.device = "cpu"):
    """``(lm, encoder, tokenizer)`` of a multimodal checkpoint, in eval mode."""
    from k3.model.vision.checkpoint import load_encoder

    lm, _, tokenizer = ckpt.load_model(path, device)
    encoder = load_encoder(vision_checkpoint_folder(path), device=device)
    return lm, encoder, tokenizer


def vision_sft(cfg: VisionSFTConfig) -> VisionSFTResult:
    """Run multimodal training as configured (module docstring)."""
    from k3.model.muon import PerHeadMuon
    from k3.model.train import balance_routers

    started, cpu_started = time.monotonic(), time.process_time()
    out = Path(cfg.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise VisionSFTError(f"out_dir {str(out)!r} exists and is not empty; choose a new folder")
    device = torch.device(cfg.device)
    with _threads(cfg.threads):
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        try:
            source = SampleSource(cfg)
        except VisionDataError as exc:
            raise VisionSFTError(f"VisionSFTConfig.data: {exc}") from None
        lm, encoder, model_config, tokenizer = build_models(cfg)
        lm, encoder = lm.to(device).train(), encoder.to(device).train()
        optimizer = PerHeadMuon(lm.optimizer_groups() + vision_optimizer_groups(encoder), lr=cfg.lr)
        base_lrs = [group["lr"] for group in optimizer.param_groups]
        moe_layers = [m for m in lm.modules() if hasattr(m, "expert_bias") and hasattr(m, "top_k")]
        for moe in moe_layers:
            moe.record_scores = True
        out.mkdir(parents=True, exist_ok=True)
        metrics = out / "metrics.jsonl"
        result = VisionSFTResult(out_dir=out, step=0, stopped=None, checkpoint=out)
        params = list(lm.parameters()) + list(encoder.parameters())

        def log(record: dict[str, Any]) -> None:
            with open(metrics, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

        def run_eval(step: int, bar) -> None:
            accuracy, chance, loss = evaluate(lm, encoder, source.held_out, tokenizer, cfg.batch_size, device)
            for moe in moe_layers:
                moe.reset_router_stats()  # eval traffic must not count as training load
            result.evaluations.append(Evaluation(step, accuracy, chance, loss, len(source.held_out)))
            log({"kind": "eval", "step": step, "accuracy": accuracy, "chance": chance, "loss": loss})
            bar.note(f"step {step}: held-out accuracy {accuracy:.1%} (chance {chance:.1%}), answer loss {loss:.4f}")

        with progress("vision sft", cfg.steps, 0, {"loss": "-"}, enabled=cfg.progress) as bar:
            run_eval(0, bar)
            for step in range(cfg.steps):
                factor = cfg.lr_factor(step)
                for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
                    group["lr"] = base * factor
                batch = pack_samples(source.batch(step), encoder.cfg, tokenizer)
                logits = batch_logits(lm, encoder, batch, device)
                loss = torch.nn.functional.cross_entropy(logits[0].float(), batch.labels[0].to(device),
                                                         ignore_index=IGNORE_INDEX)
                if not torch.isfinite(loss):
                    raise VisionSFTError(f"the loss became {loss.item()} at step {step + 1}; lower lr")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
                optimizer.step()
                balance_routers(moe_layers, True)
                result.step = step + 1
                result.train_losses.append((result.step, loss.item()))
                log({"kind": "train", "step": result.step, "loss": loss.item(), "lr": cfg.lr * factor})
                bar.advance(result.step, {"loss": f"{loss.item():.4f}"})
                if cfg.eval_every and result.step % cfg.eval_every == 0 and result.step < cfg.steps:
                    run_eval(result.step, bar)
                if cfg.max_minutes is not None and time.monotonic() - started >= cfg.max_minutes * 60:
                    result.stopped = "time limit"
                    break
            run_eval(result.step, bar)
        last = result.evaluations[-1]
        state = {"vision_sft_config": dataclasses.asdict(cfg), "accuracy": last.accuracy, "chance": last.chance,
                 "rng": ckpt.capture_rng_state()}
        result.checkpoint = save_vision_checkpoint(out, result.step, lm, encoder, optimizer, model_config,
                                                   tokenizer, state)
    result.wall_seconds = time.monotonic() - started
    result.cpu_seconds = time.process_time() - cpu_started
    return result


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` for the run (None: unchanged), restored afterwards."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
