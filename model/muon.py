"""Per-Head Muon: Muon's orthogonalised momentum, applied to each attention head's block separately.

Muon replaces a matrix's momentum M by the nearest semi-orthogonal matrix (U Vᵀ of M = U S Vᵀ), computed
approximately by a Newton–Schulz iteration. On a q/k/v/o (or KDA) projection the rows (or columns) of one
head form one block; orthogonalising the whole matrix lets a head with a large gradient take the whole
spectrum and starve the others. Per-Head Muon orthogonalises every head's block on its own (DESIGN.md §1.8).

Parameter groups say how each tensor is treated (the model builds them):

* ``{"params": [...], "kind": "muon_per_head", "num_heads": H, "head_axis": 0 | 1}`` — 2-D weights split
  into H equal blocks along ``head_axis``. For ``nn.Linear`` weights [out, in]: q/k/v (heads on the output)
  use axis 0, the output projection (heads on the input) axis 1.
* ``{"params": [...], "kind": "muon"}`` — whole-matrix Muon on 2-D weights; with ``"batched": True`` a 3-D
  weight [E, a, b] is E independent matrices (the routed experts).
* ``{"params": [...], "kind": "adamw"}`` — everything else (embeddings, norms, gate vectors, biases).

Design decisions:

* Newton–Schulz: divide by the Frobenius norm (+eps) so every singular value is ≤ 1, transpose tall
  matrices so X Xᵀ is the small Gram matrix, then five steps of X ← aX + (bA + cA²)X with A = X Xᵀ and the
  quintic coefficients (a, b, c) = (3.4445, −4.7750, 2.0315). These drive every not-too-small singular value
  into ≈ [0.7, 1.16] rather than exactly 1: speed over precision, as in Muon. Blocks of one tensor are
  stacked into a batch and orthogonalised by one batched matmul chain. fp32 by default (``ns_dtype``);
  bf16 is allowed for speed on GPUs.
* Scale: an orthogonalised A×B block has RMS ≈ 1/√max(A, B); multiplying by 0.2·√max(A, B) gives RMS 0.2,
  the typical RMS of an AdamW step, so Muon and AdamW groups can share one learning rate schedule
  (``adamw_lr`` defaults to ``lr``).
* Momentum: SGD-style buffer B ← μB + G with Nesterov look-ahead G + μB; its overall scale is irrelevant
  because Newton–Schulz normalises it away.
* Weight decay is decoupled (p ← p·(1 − lr·wd)) for every kind.
* State is kept in fp32 whatever the parameter dtype, and :meth:`PerHeadMuon.load_state_dict` restores it
  bit for bit (the base class would cast it to the parameter dtype), so resuming from a checkpoint gives the
  same next steps as never stopping.
* Every group has a single ``"lr"``: AdamW groups take ``adamw_lr`` unless they set ``"lr"`` themselves, so
  learning-rate schedulers scale all groups alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["NS_COEFFICIENTS", "PerHeadMuon", "newton_schulz", "split_heads", "merge_heads"]

#: Quintic Newton–Schulz coefficients (a, b, c): X ← aX + b(XXᵀ)X + c(XXᵀ)²X.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

_KINDS = ("muon_per_head", "muon", "adamw")
_MUON_KINDS = ("muon_per_head", "muon")
# Keys that only make sense for one kind; finding them elsewhere means the group was built wrongly.
_KIND_ONLY_KEYS = {"num_heads": "muon_per_head", "head_axis": "muon_per_head", "batched": "muon"}


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype = torch.float32):
    """Approximate orthogonalisation U Vᵀ of each matrix in ``g`` [..., A, B] (returned in ``dtype``).

    Leading dimensions are a batch of independent matrices; each is normalised by its own Frobenius norm.
    """
    if g.dim() < 2:
        raise ValueError(f"newton_schulz needs matrices [..., A, B], got shape {tuple(g.shape)}")
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, ord="fro", keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if tall else x


def split_heads(w: torch.Tensor, num_heads: int, head_axis: int) -> torch.Tensor:
    """[R, C] → [H, R/H, C] (axis 0) or [H, R, C/H] (axis 1): one block per head."""
    rows, cols = w.shape
    if head_axis == 0:
        return w.reshape(num_heads, rows // num_heads, cols)
    return w.reshape(rows, num_heads, cols // num_heads).permute(1, 0, 2)


def merge_heads(blocks: torch.Tensor, head_axis: int) -> torch.Tensor:
    """Inverse of :func:`split_heads`."""
    h, r, c = blocks.shape
    if head_axis == 0:
        return blocks.reshape(h * r, c)
    return blocks.permute(1, 0, 2).reshape(r, h * c)


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class PerHeadMuon(Optimizer):
    """Muon / Per-Head Muon for matrices, AdamW for the rest, selected by each group's ``"kind"``.

    Args:
        params: parameter groups (dicts with ``"kind"``; see the module docstring).
        lr: learning rate of the Muon groups (and of AdamW groups when ``adamw_lr`` is None).
        momentum: Muon momentum μ in [0, 1).
        nesterov: use the Nesterov look-ahead G + μB instead of B.
        weight_decay: decoupled weight decay, all kinds (a group may set its own).
        adamw_lr: learning rate of AdamW groups; None means ``lr`` (the Muon scale matches AdamW's RMS).
        adamw_betas: AdamW (β1, β2).
        adamw_eps: AdamW ε.
        ns_steps: Newton–Schulz steps.
        ns_dtype: dtype of the Newton–Schulz iteration: torch.float32 (default) or torch.bfloat16.
        ns_eps: added to the Frobenius norm before dividing.

    Any of ``lr``, ``weight_decay``, ``momentum``, ``nesterov``, ``betas``, ``eps``, ``ns_steps`` may be
    overridden per group; an optional ``"name"`` key names the group in error messages.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
        ns_eps: float = 1e-7,
    ) -> None:
        if ns_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"ns_dtype must be torch.float32 or torch.bfloat16, got {ns_dtype}")
        if not (isinstance(ns_eps, (int, float)) and ns_eps > 0):
            raise ValueError(f"ns_eps must be positive, got {ns_eps!r}")
        self._adamw_lr = lr if adamw_lr is None else adamw_lr
        self._ns_dtype = ns_dtype
        self._ns_eps = float(ns_eps)
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "betas": tuple(adamw_betas),
            "eps": adamw_eps,
            "ns_steps": ns_steps,
        }
        # Validate the defaults through the same checks as a group's own values.
        self._check_hyper(defaults, "defaults")
        self._check_hyper({"lr": self._adamw_lr}, "adamw_lr")
        if isinstance(params, torch.Tensor):
            raise TypeError("params must be an iterable of parameter-group dicts, not a tensor")
        groups = list(params)
        if not groups:
            raise ValueError("PerHeadMuon got an empty parameter list")
        super().__init__(groups, defaults)

    # ----------------------------------------------------------------------------------------- groups

    @staticmethod
    def _check_hyper(group: dict[str, Any], where: str) -> None:
        checks: dict[str, tuple[Callable[[Any], bool], str]] = {
            "lr": (lambda v: isinstance(v, (int, float)) and v >= 0, "a number >= 0"),
            "momentum": (lambda v: isinstance(v, (int, float)) and 0 <= v < 1, "in [0, 1)"),
            "nesterov": (lambda v: isinstance(v, bool), "a bool"),
            "weight_decay": (lambda v: isinstance(v, (int, float)) and v >= 0, "a number >= 0"),
            "betas": (
                lambda v: isinstance(v, (tuple, list))
                and len(v) == 2
                and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in v),
                "a pair of numbers in [0, 1)",
            ),
            "eps": (lambda v: isinstance(v, (int, float)) and v > 0, "a number > 0"),
            "ns_steps": (_is_positive_int, "a positive int"),
        }
        for key, (ok, what) in checks.items():
            if key in group and not ok(group[key]):
                raise ValueError(f"{where}: {key} must be {what}, got {group[key]!r}")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"each parameter group must be a dict with a 'kind', got {type(param_group)}")
        index = len(self.param_groups)
        where = f"param group {param_group.get('name', index)!r}"
        group = dict(param_group)
        kind = group.get("kind")
        if kind is None:
            raise ValueError(f"{where} has no 'kind' (one of {', '.join(_KINDS)})")
        if kind not in _KINDS:
            raise ValueError(f"{where} has unknown kind {kind!r} (expected one of {', '.join(_KINDS)})")
        for key, owner in _KIND_ONLY_KEYS.items():
            if key in group and kind != owner:
                raise ValueError(f"{where}: {key!r} only applies to kind {owner!r}, not {kind!r}")
        self._check_hyper(group, where)
        params = group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        params = list(params) if params is not None else []
        if not params:
            raise ValueError(f"{where} has no params")

        if kind == "muon_per_head":
            heads, axis = group.get("num_heads"), group.get("head_axis")
            if not _is_positive_int(heads):
                raise ValueError(f"{where}: num_heads must be a positive int, got {heads!r}")
            if axis not in (0, 1) or isinstance(axis, bool):
                raise ValueError(f"{where}: head_axis must be 0 or 1, got {axis!r}")
        if kind == "muon":
            group.setdefault("batched", False)
            if not isinstance(group["batched"], bool):
                raise ValueError(f"{where}: batched must be a bool, got {group['batched']!r}")
        if kind == "adamw":
            group.setdefault("lr", self._adamw_lr)

        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{where}: params[{i}] is a {type(p).__name__}, not a tensor")
            if not p.is_floating_point():
                raise ValueError(f"{where}: params[{i}] must be floating point, got {p.dtype}")
            shape = tuple(p.shape)
            if kind == "muon_per_head":
                if p.dim() != 2:
                    raise ValueError(f"{where}: params[{i}] must be 2-D for kind 'muon_per_head', got {shape}")
                if shape[axis] % heads != 0:
                    raise ValueError(
                        f"{where}: params[{i}] of shape {shape} has {shape[axis]} along head_axis={axis}, "
                        f"not divisible by num_heads={heads}"
                    )
            elif kind == "muon":
                want = 3 if group["batched"] else 2
                if p.dim() != want:
                    what = "3-D [E, a, b] for a batched" if group["batched"] else "2-D for a"
                    raise ValueError(f"{where}: params[{i}] must be {what} 'muon' group, got {shape}")
        group["params"] = params
        super().add_param_group(group)

    # ------------------------------------------------------------------------------------------- step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("PerHeadMuon does not support sparse gradients")
                if group["kind"] == "adamw":
                    self._adamw_step(p, group)
                else:
                    self._muon_step(p, group)
        return loss

    def _muon_update(self, m: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Orthogonalised, RMS-scaled update of the same shape as ``m`` (fp32)."""
        steps, dtype, eps = group["ns_steps"], self._ns_dtype, self._ns_eps
        if group["kind"] == "muon_per_head":
            blocks = split_heads(m, group["num_heads"], group["head_axis"])
            scale = 0.2 * math.sqrt(max(blocks.shape[-2:]))
            out = newton_schulz(blocks, steps, eps, dtype).float() * scale
            return merge_heads(out, group["head_axis"])
        # 'muon': a 2-D matrix, or [E, a, b] batched; newton_schulz treats leading dims as a batch.
        scale = 0.2 * math.sqrt(max(m.shape[-2:]))
        return newton_schulz(m, steps, eps, dtype).float() * scale

    def _muon_step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        grad = p.grad.float()
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
        buf = state["momentum_buffer"]
        mu = group["momentum"]
        buf.mul_(mu).add_(grad)
        m = grad.add(buf, alpha=mu) if group["nesterov"] else buf
        self._apply(p, self._muon_update(m, group), group["lr"], group)

    def _adamw_step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        grad = p.grad.float()
        state = self.state[p]
        if "step" not in state:
            # The step count lives on the CPU as an int64 tensor: exact, and saved like any other state.
            state["step"] = torch.zeros((), dtype=torch.int64)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        state["step"] += 1
        t = int(state["step"])
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**t
        bias_correction2_sqrt = math.sqrt(1 - beta2**t)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        self._apply(p, exp_avg / denom, group["lr"] / bias_correction1, group)

    @staticmethod
    def _apply(p: torch.Tensor, update: torch.Tensor, step_size: float, group: dict[str, Any]) -> None:
        """p ← p·(1 − lr·wd) − step_size·update (decoupled weight decay, then the step)."""
        decay = 1 - group["lr"] * group["weight_decay"]
        if p.dtype == torch.float32:
            p.mul_(decay).add_(update, alpha=-step_size)
        else:
            # Low-precision parameters: do the arithmetic in fp32 and round once.
            p.copy_(p.float().mul_(decay).add_(update, alpha=-step_size))

    # ------------------------------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`, keeping the saved state's dtypes (fp32 buffers stay fp32).

        The groups must match this optimizer's: same count, sizes, kinds and head layouts.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}"
            )
        for i, (saved, current) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            for key in ("kind", "num_heads", "head_axis", "batched"):
                if saved.get(key) != current.get(key):
                    raise ValueError(
                        f"param group {i}: state_dict has {key}={saved.get(key)!r}, "
                        f"this optimizer {key}={current.get(key)!r}"
                    )
        super().load_state_dict(state_dict)
        # The base class casts floating state to each parameter's dtype; put back the saved tensors.
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in self.param_groups),
                strict=True,
            )
        )
        for param_id, saved_state in state_dict["state"].items():
            p = id_map[param_id]
            for key, value in saved_state.items():
                if isinstance(value, torch.Tensor):
                    device = value.device if key == "step" else p.device
                    self.state[p][key] = value.detach().clone().to(device=device)
