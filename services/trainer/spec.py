"""Job specs: what ``Jobs.Submit`` accepts, validated into the config a job runs with.

A ``k3.v1.JobSpec`` carries ``kind`` (pretrain, sft, rl), ``name``, ``preset``, ``checkpoint`` and
``spec_json``, a JSON object of the kind's fields. Every field the trainer accepts and where it lands:

- **pretrain** (``k3.model.train.TrainConfig``): ``preset`` (required), and in ``spec_json``: ``steps``,
  ``seed``, ``batch_tokens``, ``stages`` (``[[fraction, seq_len], ...]``), ``model_overrides``, ``data``
  (``corpus_root``, ``max_bytes``, ``eval_fraction``), ``tokenizer_dir``, ``eval_every``, ``eval_batches``,
  ``eval_seq_len``, ``save_every``, ``keep_last``, ``threads``, ``device``, ``balance_experts`` and
  ``optimizer`` (``lr``, ``adamw_lr``, ``weight_decay``, ``warmup_steps``, ``min_lr_ratio``, ``grad_clip``).
- **sft** (``k3.model.sft.SFTConfig``): ``checkpoint`` (required), and ``steps``, ``seed``, ``batch_tokens``,
  ``data`` (``mix``: ``"reasoning=0.5,tools=0.5"`` or a mapping), ``eval_every``, ``eval_conversations``,
  ``save_every``, ``keep_last``, ``threads``, ``device``, ``balance_experts``, ``optimizer`` as above.
- **rl** (``k3.services.trainer.rl_job.RLJobConfig``): ``preset`` or ``checkpoint``, and the RL job's own
  fields (environments, steps, prompts and group size, effort levels, staleness bound, optimiser...), which
  ``RLJobConfig.from_dict`` validates.

Design decisions:

- **One source of truth per rule.** Ranges and cross-field rules live in the training configs; this module
  checks only the shape of the spec (known keys, sections are objects), builds the config and translates its
  error (``TrainConfig.lr must be ...``) into INVALID_ARGUMENT on the spec's own path
  (``spec_json.optimizer.lr``). Checks that the configs defer to the start of a run (the preset exists,
  model overrides form a valid model, the context fits the model, the checkpoint is readable, the model is
  not too large for this trainer) run here, at submit time, so a bad spec never becomes a failed job.
- ``checkpoint`` is a folder on the trainer's storage (a checkpoint or a run folder) or ``job:ID``, the
  output of an earlier job, which must have SUCCEEDED.
- The trainer decides where a job writes (``out_dir``), how it reports progress and whether it resumes;
  those fields cannot be set from a spec.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from k3.protos.v1 import jobs_pb2
from k3.services.common.errors import FailedPrecondition, InvalidArgument

KINDS = ("pretrain", "sft", "rl")
MAX_SPEC_JSON_BYTES = 64 * 1024
MAX_NAME_LENGTH = 128
JOB_REF_PREFIX = "job:"

_OPTIMIZER = {
    "optimizer.lr": "lr", "optimizer.adamw_lr": "adamw_lr", "optimizer.weight_decay": "weight_decay",
    "optimizer.warmup_steps": "warmup_steps", "optimizer.min_lr_ratio": "min_lr_ratio",
    "optimizer.grad_clip": "grad_clip",
}
_COMMON = {
    "steps": "steps", "seed": "seed", "batch_tokens": "batch_tokens", "eval_every": "eval_every",
    "save_every": "save_every", "keep_last": "keep_last", "threads": "threads", "device": "device",
    "balance_experts": "balance_experts", **_OPTIMIZER,
}
PRETRAIN_FIELDS: Mapping[str, str] = {
    **_COMMON, "stages": "stages", "model_overrides": "model_overrides", "tokenizer_dir": "tokenizer_dir",
    "eval_batches": "eval_batches", "eval_seq_len": "eval_seq_len", "data.corpus_root": "corpus_root",
    "data.max_bytes": "corpus_max_bytes", "data.eval_fraction": "eval_fraction",
}
"""Spec path (``spec_json.<path>``) -> ``TrainConfig`` field."""
SFT_FIELDS: Mapping[str, str] = {
    **_COMMON, "eval_conversations": "eval_conversations", "data.mix": "mix",
}
"""Spec path (``spec_json.<path>``) -> ``SFTConfig`` field."""
RL_TRAINER_FIELDS = ("job_dir", "job_id", "bus_url", "otlp_endpoint")
"""``RLJobConfig`` fields the trainer sets for every RL job."""
SECTIONS = ("optimizer", "data")
"""Keys of ``spec_json`` that are objects of further fields."""

_CONFIG_ERROR = re.compile(r"^(?:TrainConfig|SFTConfig)\.(\w+):?\s*(.*)$", re.DOTALL)


@dataclass
class ValidatedSpec:
    """A job spec that passed validation: what the runner needs to start the job."""

    kind: str
    """pretrain, sft or rl."""
    name: str
    """The job's display name (the kind when none was given)."""
    params: dict[str, Any]
    """The kind's config as a dict (``TrainConfig``/``SFTConfig``/``RLJobConfig`` fields) without the fields
    the runner sets (output folder, progress display, resume)."""
    steps: int
    """Total steps of the job, for progress."""
    checkpoint: str = ""
    """The resolved starting checkpoint folder ("" when the job starts from a preset)."""
    spec: dict[str, Any] = field(default_factory=dict)
    """The submitted spec as given (kind, name, preset, checkpoint, spec_json), for listing and persistence."""


@dataclass
class SpecLimits:
    """What this trainer accepts beyond what the configs check."""

    max_parameters: int = 2_000_000_000
    """Largest model (total parameters) a job may train; larger presets or overrides are refused."""
    default_threads: int = 1
    """``threads`` of a job whose spec leaves it out (the runner passes its per-job CPU count)."""


def spec_to_dict(spec: jobs_pb2.JobSpec) -> dict[str, Any]:
    return {"name": spec.name, "kind": spec.kind, "preset": spec.preset, "checkpoint": spec.checkpoint,
            "spec_json": spec.spec_json}


def validate(spec: jobs_pb2.JobSpec, *, resolve_job: Callable[[str], tuple[str, Path]] | None = None,
             limits: SpecLimits | None = None, rl_available: Callable[[], Any] | None = None) -> ValidatedSpec:
    """Validate a submitted spec; raises ``InvalidArgument`` (or ``FailedPrecondition``) naming the field.

    ``resolve_job(id)`` returns ``(state, output folder)`` of an existing job for ``checkpoint: job:ID`` (raising
    ``InvalidArgument`` for an unknown id); ``rl_available()`` returns the RL job module or raises
    ``FailedPrecondition`` when RL jobs cannot run here.
    """
    limits = limits or SpecLimits()
    kind = spec.kind.strip()
    if kind not in KINDS:
        raise InvalidArgument("kind", f"unknown job kind {spec.kind!r} (expected one of {', '.join(KINDS)})",
                              reason="UNKNOWN_KIND")
    name = _check_name(spec.name) or kind
    body = _parse_spec_json(spec.spec_json)
    checkpoint = _resolve_checkpoint(spec.checkpoint, resolve_job) if spec.checkpoint else ""
    given = spec_to_dict(spec)
    if kind == "pretrain":
        if checkpoint:
            raise InvalidArgument("checkpoint", "a pretrain job starts from a preset's random weights; leave "
                                  "checkpoint empty (fine-tune a checkpoint with an sft or rl job)",
                                  reason="UNEXPECTED_FIELD")
        if not spec.preset:
            raise InvalidArgument("preset", "is required for a pretrain job (e.g. tiny, small)", reason="MISSING_FIELD")
        params = _pretrain(spec.preset, body, limits)
        return ValidatedSpec(kind, name, params, params["steps"], "", given)
    if kind == "sft":
        if spec.preset:
            raise InvalidArgument("preset", "an sft job's model is its checkpoint's; leave preset empty",
                                  reason="UNEXPECTED_FIELD")
        if not checkpoint:
            raise InvalidArgument("checkpoint", "is required for an sft job (a pretrained checkpoint folder or "
                                  "job:ID of a finished pretrain job)", reason="MISSING_FIELD")
        params = _sft(checkpoint, body, limits)
        return ValidatedSpec(kind, name, params, params["steps"], checkpoint, given)
    params = _rl(spec.preset, checkpoint, body, limits, rl_available)
    return ValidatedSpec(kind, name, params, int(params.get("steps") or 0), checkpoint, given)


# ---- pieces -----------------------------------------------------------------------------------------------------
def _check_name(name: str) -> str:
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidArgument("name", f"is {len(name)} characters long; the limit is {MAX_NAME_LENGTH}",
                              reason="TOO_LONG")
    if any(not ch.isprintable() for ch in name):
        raise InvalidArgument("name", "must not contain control characters", reason="BAD_CHARACTERS")
    return name.strip()


def _parse_spec_json(text: str) -> dict[str, Any]:
    if not text.strip():
        return {}
    if len(text.encode()) > MAX_SPEC_JSON_BYTES:
        raise InvalidArgument("spec_json", f"is {len(text.encode())} bytes; the limit is {MAX_SPEC_JSON_BYTES}",
                              reason="TOO_LARGE")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise InvalidArgument("spec_json", f"is not valid JSON: {exc.msg} at line {exc.lineno} column "
                              f"{exc.colno}", reason="BAD_JSON") from None
    except ValueError as exc:
        raise InvalidArgument("spec_json", str(exc), reason="BAD_JSON") from None
    if not isinstance(body, dict):
        raise InvalidArgument("spec_json", f"must be a JSON object, got {type(body).__name__}", reason="BAD_JSON")
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number k3 accepts (JSON has no NaN or Infinity)")


def _resolve_checkpoint(value: str, resolve_job: Callable[[str], tuple[str, Path]] | None) -> str:
    from k3.model import checkpoint as ckpt

    if value.startswith(JOB_REF_PREFIX):
        job_id = value[len(JOB_REF_PREFIX):]
        if resolve_job is None:
            raise InvalidArgument("checkpoint", "job references are not available here", reason="UNKNOWN_JOB")
        state, run_dir = resolve_job(job_id)
        if state != "SUCCEEDED":
            raise FailedPrecondition(f"job {job_id} is {state}; only a SUCCEEDED job's output can be a checkpoint",
                                     field="checkpoint")
        path = run_dir
    else:
        path = Path(value)
    try:
        return str(ckpt.resolve_checkpoint(path).resolve())
    except ckpt.CheckpointError as exc:
        raise InvalidArgument("checkpoint", str(exc), reason="BAD_CHECKPOINT") from None
    except OSError as exc:
        raise InvalidArgument("checkpoint", f"cannot read {value!r}: {exc.strerror}", reason="BAD_CHECKPOINT") from None


def _flatten(body: Mapping[str, Any], table: Mapping[str, str], kind: str) -> dict[str, Any]:
    """``spec_json`` -> ``{config field: value}`` through ``table``; unknown keys name themselves."""
    known_top = sorted({path.split(".")[0] for path in table})
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key in SECTIONS and any(path.startswith(key + ".") for path in table):
            if not isinstance(value, dict):
                raise InvalidArgument(f"spec_json.{key}", f"must be an object, got {type(value).__name__}",
                                      reason="BAD_TYPE")
            for sub, sub_value in value.items():
                path = f"{key}.{sub}"
                if path not in table:
                    known = sorted(p.split(".", 1)[1] for p in table if p.startswith(key + "."))
                    raise InvalidArgument(f"spec_json.{path}", f"is not a {kind} job field (known in {key}: "
                                          f"{', '.join(known)})", reason="UNKNOWN_FIELD")
                out[table[path]] = sub_value
            continue
        if key not in table:
            raise InvalidArgument(f"spec_json.{key}", f"is not a {kind} job field (known: {', '.join(known_top)})",
                                  reason="UNKNOWN_FIELD")
        out[table[key]] = value
    return out


def _config_error(exc: Exception, table: Mapping[str, str], fallback: str) -> InvalidArgument:
    """A config's error as INVALID_ARGUMENT on the spec path of the field it names."""
    text = str(exc)
    match = _CONFIG_ERROR.match(text)
    if match:
        reverse = {config_field: path for path, config_field in table.items()}
        path = reverse.get(match.group(1))
        if path is not None:
            return InvalidArgument(f"spec_json.{path}", match.group(2), reason="BAD_VALUE")
        if match.group(1) == "preset":
            return InvalidArgument("preset", match.group(2), reason="BAD_VALUE")
    return InvalidArgument(fallback, text, reason="BAD_VALUE")


def _build(config_type: type, values: dict[str, Any], table: Mapping[str, str], fallback: str) -> Any:
    try:
        return config_type(**values)
    except (TypeError, ValueError) as exc:
        raise _config_error(exc, table, fallback) from None


def _check_stages(stages: Any) -> None:
    ok = isinstance(stages, list) and stages and all(
        isinstance(s, list) and len(s) == 2 and all(isinstance(v, int | float) and not isinstance(v, bool)
                                                    and math.isfinite(v) for v in s)
        and float(s[1]).is_integer() for s in stages)
    if not ok:
        raise InvalidArgument("spec_json.stages", f"must be a non-empty list of [fraction, seq_len] pairs, got "
                              f"{stages!r}", reason="BAD_VALUE")


def _check_size(model_config: Any, limits: SpecLimits, field_name: str) -> None:
    from k3.model.params import count_params

    total = count_params(model_config)["total"]
    if total > limits.max_parameters:
        raise InvalidArgument(field_name, f"the model has {total:,} parameters; this trainer accepts at most "
                              f"{limits.max_parameters:,} (trainer config jobs.max_parameters)", reason="TOO_LARGE")


def _pretrain(preset: str, body: dict[str, Any], limits: SpecLimits) -> dict[str, Any]:
    from k3.model.config import K3Config
    from k3.model.presets import get_preset
    from k3.model.train import TrainConfig

    values = _flatten(body, PRETRAIN_FIELDS, "pretrain")
    if "stages" in values:
        _check_stages(values["stages"])
    values.setdefault("threads", limits.default_threads)
    cfg = _build(TrainConfig, {**values, "out_dir": "job", "preset": preset, "progress": False},
                 PRETRAIN_FIELDS, "spec_json")
    try:
        model_config = get_preset(preset)
    except ValueError as exc:
        raise InvalidArgument("preset", str(exc), reason="UNKNOWN_PRESET") from None
    if cfg.model_overrides:
        try:
            model_config = K3Config.from_dict({**model_config.to_dict(), **cfg.model_overrides})
        except (TypeError, ValueError) as exc:
            raise InvalidArgument("spec_json.model_overrides", str(exc), reason="BAD_VALUE") from None
    longest = max(cfg.stages[-1][1], cfg.resolved_eval_seq_len)
    if longest > model_config.max_seq_len:
        raise InvalidArgument("spec_json.stages", f"reaches {longest} tokens, beyond the model's max_seq_len "
                              f"{model_config.max_seq_len}", reason="BAD_VALUE")
    _check_size(model_config, limits, "spec_json.model_overrides" if cfg.model_overrides else "preset")
    params = cfg.to_dict()
    for runtime in ("out_dir", "progress", "resume", "cache_dir", "max_minutes", "stop_at"):
        params.pop(runtime)
    return params


def _sft(checkpoint: str, body: dict[str, Any], limits: SpecLimits) -> dict[str, Any]:
    from k3.model.sft import SFTConfig, SFTError, load_base

    values = _flatten(body, SFT_FIELDS, "sft")
    values.setdefault("threads", limits.default_threads)
    cfg = _build(SFTConfig, {**values, "out_dir": "job", "checkpoint": checkpoint, "progress": False},
                 SFT_FIELDS, "spec_json")
    try:
        _, model_config, _ = load_base(checkpoint)
    except SFTError as exc:
        raise InvalidArgument("checkpoint", str(exc), reason="BAD_CHECKPOINT") from None
    _check_size(model_config, limits, "checkpoint")
    params = dataclasses.asdict(cfg)
    for runtime in ("out_dir", "progress", "resume", "max_minutes", "stop_at"):
        params.pop(runtime)
    return params


def _rl(preset: str, checkpoint: str, body: dict[str, Any], limits: SpecLimits,
        rl_available: Callable[[], Any] | None) -> dict[str, Any]:
    if rl_available is None:
        raise FailedPrecondition("RL jobs need k3.services.trainer.rl_job", field="kind")
    rl_job = rl_available()
    if preset and checkpoint:
        raise InvalidArgument("checkpoint", "set either preset or checkpoint for an rl job, not both",
                              reason="CONFLICTING_FIELDS")
    if not preset and not checkpoint:
        raise InvalidArgument("preset", "an rl job needs preset or checkpoint (the starting policy)",
                              reason="MISSING_FIELD")
    for key in ("preset", "checkpoint"):
        if key in body:
            raise InvalidArgument(f"spec_json.{key}", f"set {key} on the JobSpec itself, not in spec_json",
                                  reason="UNEXPECTED_FIELD")
    for key in RL_TRAINER_FIELDS:
        if key in body:
            raise InvalidArgument(f"spec_json.{key}", "is set by the trainer (where the job writes, its name on "
                                  "the bus, which bus)", reason="UNEXPECTED_FIELD")
    values = dict(body)
    if preset:
        values["preset"] = preset
    if checkpoint:
        values["checkpoint"] = checkpoint
    try:
        config = rl_job.RLJobConfig.from_dict(values)
    except (TypeError, ValueError) as exc:
        raise _rl_error(exc, values) from None
    return _as_dict(config)


def _rl_error(exc: Exception, values: Mapping[str, Any]) -> InvalidArgument:
    """``RLJobConfig.from_dict``'s errors start with the field's name (``lr: must be a number > 0, got 0``)."""
    text = str(exc)
    match = re.match(r"^(\w+): (.*)$", text, re.DOTALL)
    if match is None:
        return InvalidArgument("spec_json", text, reason="BAD_VALUE")
    name, message = match.groups()
    if name in ("preset", "checkpoint"):
        return InvalidArgument(name, message, reason="BAD_VALUE")
    if message.startswith("unknown field"):
        reason = "UNKNOWN_FIELD"
    elif message.startswith("unknown environment"):
        reason = "UNKNOWN_ENVIRONMENT"
    else:
        reason = "BAD_VALUE"
    return InvalidArgument(f"spec_json.{name}", message, reason=reason)


def _as_dict(config: Any) -> dict[str, Any]:
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    return dict(config)
