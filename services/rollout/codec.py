"""Trajectories and weight versions on the bus: protobuf in, validated protobuf out.

``decode_trajectory`` is the learner's edge: every record of ``k3.trajectories`` is untrusted bytes, so it
checks the message parses and is self-consistent (lengths agree, versions non-negative, token ids in the
vocabulary, a reward that is a finite number) and raises ``MalformedTrajectory`` with a precise reason
otherwise; the learner dead-letters such records with that reason.
"""

from __future__ import annotations

import math

from google.protobuf.message import DecodeError

from k3.protos.v1 import rollout_pb2

TRAJECTORIES_TOPIC = "k3.trajectories"
WEIGHTS_TOPIC = "k3.weights"
DEAD_LETTER_TOPIC = "k3.trajectories.dlq"


class MalformedTrajectory(ValueError):
    """A ``k3.trajectories`` record the learner cannot use (the message says why)."""


def parse_trajectory(value: bytes) -> rollout_pb2.Trajectory:
    """The record as a ``k3.v1.Trajectory``, not yet checked; ``MalformedTrajectory`` if it does not parse.

    The topic is shared by every job on the bus, so a consumer parses first and asks whose record it is:
    another job's record is skipped (not judged), and only an unreadable one, which names no job, is
    everyone's to report.
    """
    try:
        return rollout_pb2.Trajectory.FromString(value)
    except (DecodeError, ValueError) as exc:
        raise MalformedTrajectory(f"not a k3.v1.Trajectory: {exc}") from None


def validate_trajectory(t: rollout_pb2.Trajectory, vocab_size: int | None = None) -> rollout_pb2.Trajectory:
    """``t`` itself when it is self-consistent (module docstring); ``MalformedTrajectory`` saying why otherwise."""
    if not t.id:
        raise MalformedTrajectory("id is empty")
    if not t.group_id:
        raise MalformedTrajectory("group_id is empty")
    if t.group_size < 1:
        raise MalformedTrajectory(f"group_size must be >= 1, got {t.group_size}")
    if not t.prompt_ids:
        raise MalformedTrajectory("prompt_ids is empty")
    n = len(t.output_ids)
    if n == 0:
        raise MalformedTrajectory("output_ids is empty")
    for name in ("behaviour_logprobs", "versions", "loss_mask"):
        if len(getattr(t, name)) != n:
            raise MalformedTrajectory(f"{name} has {len(getattr(t, name))} entries for {n} output tokens")
    if any(v < 0 for v in t.versions):
        raise MalformedTrajectory("versions must be >= 0")
    if any(m not in (0, 1) for m in t.loss_mask):
        raise MalformedTrajectory("loss_mask entries must be 0 or 1")
    if not any(t.loss_mask):
        raise MalformedTrajectory("loss_mask selects no token")
    if any(not math.isfinite(lp) or lp > 0 for lp in t.behaviour_logprobs):
        raise MalformedTrajectory("behaviour_logprobs must be finite and <= 0")
    if not math.isfinite(t.reward):
        raise MalformedTrajectory(f"reward must be finite, got {t.reward}")
    if vocab_size is not None:
        for name in ("prompt_ids", "output_ids"):
            bad = next((x for x in getattr(t, name) if not 0 <= x < vocab_size), None)
            if bad is not None:
                raise MalformedTrajectory(f"{name} holds {bad}, outside the vocabulary [0, {vocab_size})")
    return t


def decode_trajectory(value: bytes, vocab_size: int | None = None) -> rollout_pb2.Trajectory:
    """``parse_trajectory`` then ``validate_trajectory``."""
    return validate_trajectory(parse_trajectory(value), vocab_size)


def encode_weights(job_id: str, version: int, path: str, accepted: int, final: bool = False) -> bytes:
    return rollout_pb2.WeightVersion(job_id=job_id, version=version, path=path, accepted=accepted,
                                     final=final).SerializeToString()


def decode_weights(value: bytes) -> rollout_pb2.WeightVersion | None:
    """The weight event, or None for bytes that are not one (ignored by workers)."""
    try:
        w = rollout_pb2.WeightVersion.FromString(value)
    except (DecodeError, ValueError):
        return None
    return w if w.job_id and w.version >= 0 else None
