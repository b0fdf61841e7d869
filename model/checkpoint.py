"""Training checkpoints: model, optimizer and trainer state in safetensors and JSON — never pickle.

A run directory holds ``checkpoint-STEP/`` folders and a ``latest`` file naming the newest complete one::

    checkpoint-STEP/
        model.safetensors      weights (shared tensors stored once)
        optimizer.safetensors  every state tensor; the structure, scalars and param groups as JSON metadata
        trainer.json           step, sampler state, RNG states (lists of ints), training config
        config.json            the K3Config
        tokenizer/             the tokenizer's own saved files

Design decisions:

- Nothing is ever unpickled: a checkpoint may come from anywhere, and safetensors + JSON cannot run code.
  ``torch.save``/``torch.load`` are not used for that reason.
- A checkpoint is written into a hidden temporary folder and renamed into place, then ``latest`` is replaced
  atomically. A crash at any moment leaves either the previous checkpoint or the new one, never half of one.
- The optimizer codec is generic over ``torch.optim.Optimizer.state_dict()``: tensors go into the safetensors
  body under ``state/<param id>/<name>``, everything else into one JSON document. Tuples (e.g. AdamW betas) are
  tagged so that the loaded state dict equals the saved one exactly, and Python floats survive JSON exactly
  because ``json`` writes the shortest repr that reads back to the same double.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_model as _load_weights
from safetensors.torch import save_file
from safetensors.torch import save_model as _save_weights

from k3.model.config import K3Config

FORMAT_VERSION = 1
LATEST = "latest"
CHECKPOINT_PREFIX = "checkpoint-"
_OPTIMIZER_META_KEY = "k3.optimizer"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not match what it is loaded into."""


# ---- JSON with exact tuples ------------------------------------------------------------------------------------
def _to_json_value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [_to_json_value(v, where) for v in value]}
    if isinstance(value, list):
        return [_to_json_value(v, where) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise CheckpointError(f"{where}: only string keys can be saved, got {sorted(map(repr, value))}")
        if "__tuple__" in value:
            raise CheckpointError(f"{where}: the key '__tuple__' is reserved")
        return {k: _to_json_value(v, f"{where}.{k}") for k, v in value.items()}
    raise CheckpointError(f"{where}: cannot save a value of type {type(value).__name__} without pickle")


def _from_json_value(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json_value(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_from_json_value(v) for v in value["__tuple__"])
        return {k: _from_json_value(v) for k, v in value.items()}
    return value


# ---- optimizer state -------------------------------------------------------------------------------------------
def optimizer_state_to_safetensors(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """Split an optimizer ``state_dict`` into named tensors and a JSON document describing the rest."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    tensor_keys: dict[str, list[str]] = {}
    for param_id, entry in state_dict["state"].items():
        pid = str(int(param_id))
        tensor_keys[pid] = []
        scalars[pid] = {}
        for name, value in entry.items():
            if "/" in name:
                raise CheckpointError(f"optimizer state name {name!r} of param {pid} must not contain '/'")
            if isinstance(value, torch.Tensor):
                tensors[f"state/{pid}/{name}"] = value.detach().to("cpu").contiguous()
                tensor_keys[pid].append(name)
            else:
                scalars[pid][name] = _to_json_value(value, f"optimizer state {pid}.{name}")
    structure = {
        "format": FORMAT_VERSION,
        "tensor_keys": tensor_keys,
        "scalars": scalars,
        "param_groups": [_to_json_value(g, f"param_groups[{i}]") for i, g in enumerate(state_dict["param_groups"])],
    }
    return tensors, json.dumps(structure)


def optimizer_state_from_safetensors(tensors: dict[str, torch.Tensor], structure_json: str) -> dict[str, Any]:
    """Inverse of ``optimizer_state_to_safetensors``."""
    structure = json.loads(structure_json)
    if structure.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"optimizer state format {structure.get('format')!r} is not {FORMAT_VERSION}")
    state: dict[int, dict[str, Any]] = {}
    for pid, names in structure["tensor_keys"].items():
        entry: dict[str, Any] = {}
        for name in names:
            key = f"state/{pid}/{name}"
            if key not in tensors:
                raise CheckpointError(f"optimizer checkpoint lacks tensor {key!r}")
            entry[name] = tensors[key]
        for name, value in structure["scalars"][pid].items():
            entry[name] = _from_json_value(value)
        state[int(pid)] = entry
    return {"state": state, "param_groups": [_from_json_value(g) for g in structure["param_groups"]]}


def save_optimizer(optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    tensors, structure = optimizer_state_to_safetensors(optimizer.state_dict())
    save_file(tensors, str(path), metadata={_OPTIMIZER_META_KEY: structure})


def load_optimizer(optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = f.metadata() or {}
        if _OPTIMIZER_META_KEY not in metadata:
            raise CheckpointError(f"{path} is not an optimizer checkpoint (no {_OPTIMIZER_META_KEY} metadata)")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    optimizer.load_state_dict(optimizer_state_from_safetensors(tensors, metadata[_OPTIMIZER_META_KEY]))


# ---- RNG states ------------------------------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """Python, NumPy (global legacy generator) and torch RNG states as JSON-compatible lists of ints."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state``."""
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np.asarray(np_keys, dtype=np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"]:
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


# ---- checkpoint folders ----------------------------------------------------------------------------------------
def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step}"


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoint folders of a run, oldest first."""
    found = []
    for path in Path(run_dir).glob(f"{CHECKPOINT_PREFIX}*"):
        suffix = path.name[len(CHECKPOINT_PREFIX):]
        if path.is_dir() and suffix.isdigit():
            found.append((int(suffix), path))
    return sorted(found)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_config: K3Config,
    tokenizer: Any,
    trainer_state: dict[str, Any],
    keep_last: int = 0,
    extra: Any = None,
) -> Path:
    """Write ``run_dir/checkpoint-STEP`` atomically, point ``latest`` at it, keep the newest ``keep_last``.

    ``trainer_state`` must be JSON-compatible (the loop's step, sampler and RNG states, its config).
    ``keep_last=0`` keeps every checkpoint. ``extra``, if given, is called with the temporary folder before it
    is renamed into place, to write more parts of the checkpoint atomically with it (e.g. ``vision/``).
    """
    # Encode first: a state that cannot be saved must fail before anything is written.
    trainer_doc = {"format": FORMAT_VERSION, "step": int(step), **_to_json_value(trainer_state, "trainer_state")}
    run_dir = Path(run_dir)
    final = run_dir / checkpoint_name(step)
    tmp = run_dir / f".{final.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)  # left over from a crash while writing this very step
    tmp.mkdir(parents=True)

    _save_weights(model, str(tmp / "model.safetensors"), metadata={"k3.format": str(FORMAT_VERSION)})
    save_optimizer(optimizer, tmp / "optimizer.safetensors")
    (tmp / "trainer.json").write_text(json.dumps(trainer_doc, indent=1), encoding="utf-8")
    (tmp / "config.json").write_text(json.dumps(model_config.to_dict(), indent=2, sort_keys=True), encoding="utf-8")
    tokenizer.save(tmp / "tokenizer")
    if extra is not None:
        extra(tmp)

    if final.exists():
        # A crash after the rename but before ``latest`` moved leaves an orphan of this step; replace it.
        trash = run_dir / f".{final.name}.old"
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(final, trash)
        os.replace(tmp, final)
        shutil.rmtree(trash)
    else:
        os.replace(tmp, final)
    _write_text_atomic(run_dir / LATEST, final.name + "\n")

    if keep_last > 0:
        for old_step, path in list_checkpoints(run_dir)[:-keep_last]:
            if old_step != step:
                shutil.rmtree(path)
    return final


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint ``run_dir/latest`` names, or ``None`` if the run has no checkpoint yet."""
    pointer = Path(run_dir) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    path = Path(run_dir) / name
    if not name.startswith(CHECKPOINT_PREFIX) or not (path / "trainer.json").is_file():
        raise CheckpointError(f"{pointer} names {name!r}, which is not a complete checkpoint")
    return path


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder itself, or the latest checkpoint of a run folder."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise CheckpointError(f"{str(path)!r} is neither a checkpoint nor a run folder with a checkpoint")
    return found


def read_trainer_state(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    doc = json.loads((Path(checkpoint_dir) / "trainer.json").read_text(encoding="utf-8"))
    if doc.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{checkpoint_dir}: trainer state format {doc.get('format')!r} is not {FORMAT_VERSION}")
    return _from_json_value(doc)


def read_model_config(checkpoint_dir: str | os.PathLike) -> K3Config:
    return K3Config.from_json((Path(checkpoint_dir) / "config.json").read_text(encoding="utf-8"))


def load_weights(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> None:
    """Load ``model.safetensors`` into ``model`` strictly (a missing or extra tensor is an error)."""
    missing, unexpected = _load_weights(model, str(Path(checkpoint_dir) / "model.safetensors"), strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"{checkpoint_dir}: weights do not match the model (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )


def load_training_state(
    checkpoint_dir: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore weights and optimizer in place; return the trainer state (RNG and sampler are the caller's)."""
    load_weights(model, checkpoint_dir)
    load_optimizer(optimizer, Path(checkpoint_dir) / "optimizer.safetensors")
    return read_trainer_state(checkpoint_dir)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, K3Config, Any]:
    """Load a trained model for inference: ``(model in eval mode, its K3Config, its tokenizer)``.

    ``path`` is a checkpoint folder or a run folder (its ``latest`` checkpoint is used).
    """
    from k3.model.tokenizer import load_tokenizer
    from k3.model.transformer import K3Model

    checkpoint_dir = resolve_checkpoint(path)
    config = read_model_config(checkpoint_dir)
    model = K3Model(config)
    load_weights(model, checkpoint_dir)
    tokenizer = load_tokenizer(checkpoint_dir / "tokenizer")
    return model.to(device).eval(), config, tokenizer
