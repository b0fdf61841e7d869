"""Multi-teacher on-policy distillation: a per-token reverse-KL advantage against the matching teacher.

The student samples its own trajectory (on-policy); a teacher scores the same tokens. The per-token reverse
KL, KL(π_student ‖ π_teacher), estimated on the sampled token, is ``log π_s(y_t) − log π_t(y_t)``; its negative

    A_t = log π_teacher(y_t | y_<t) − log π_student(y_t | y_<t)

is an advantage: tokens the teacher likes more than the student are pushed up, the others down. Used with a
policy-gradient loss (the decoupled-PPO loss here), it minimises the reverse KL, which is mode-seeking: the
student commits to what the teacher does best instead of averaging over it.

Several teachers (DESIGN.md: 3 domains × 3 efforts) are merged by routing each trajectory to the teacher of its
(domain, effort); ``TeacherSet`` does that lookup and says precisely when no teacher matches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Generic, NamedTuple, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


class TeacherKey(NamedTuple):
    domain: str
    effort: str


def reverse_kl_advantage(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-token advantage ``teacher_logp − student_logp`` (0 where ``mask`` is 0); no gradient flows."""
    if student_logp.shape != teacher_logp.shape:
        raise ValueError(f"student and teacher log-probs differ in shape: {tuple(student_logp.shape)} vs "
                         f"{tuple(teacher_logp.shape)}")
    adv = (teacher_logp - student_logp).detach()
    if mask is not None:
        adv = adv * mask.to(adv.dtype)
    return adv


class TeacherSet(Generic[T]):
    """Teachers keyed by (domain, effort); ``for_trajectory`` picks one, with an optional per-domain fallback
    (``effort="*"``) for domains that have a single teacher."""

    def __init__(self, teachers: Mapping[tuple[str, str], T]):
        self._teachers = {TeacherKey(*k): v for k, v in teachers.items()}

    def __len__(self) -> int:
        return len(self._teachers)

    def keys(self) -> list[TeacherKey]:
        return sorted(self._teachers)

    def has(self, domain: str, effort: str) -> bool:
        """Whether ``for_trajectory(domain, effort)`` finds a teacher."""
        return TeacherKey(domain, effort) in self._teachers or TeacherKey(domain, "*") in self._teachers

    def for_trajectory(self, domain: str, effort: str) -> T:
        for key in (TeacherKey(domain, effort), TeacherKey(domain, "*")):
            if key in self._teachers:
                return self._teachers[key]
        known = ", ".join(f"{k.domain}/{k.effort}" for k in self.keys()) or "none"
        raise KeyError(f"no teacher for domain {domain!r} and effort {effort!r} (teachers: {known})")


def sequence_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log-softmax of ``logits`` [..., V] at ``targets`` [...] (float32)."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
