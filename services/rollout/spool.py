"""The rollout worker's durable to-do list: one ticket per admitted trajectory, plus paused sequence states.

A worker writes a ticket (the trajectory's id, group and problem) when it admits a trajectory, saves the
trajectory's progress when partial rollout pauses it (tokens, log-probs, versions, loss mask and the engine's
``SequenceState`` as safetensors bytes), and deletes the ticket once the trajectory is published. A worker that
starts with the same ``worker_id`` (the replacement of a dead one) adopts every ticket left in the spool: paused
trajectories resume from their saved state, the others are generated again. Nothing admitted is lost; a
trajectory published just before a crash may be published twice, and the learner drops the duplicate by id.

Every file is written to a temporary name and renamed, so a crash never leaves half a ticket. Nothing is
pickled: tickets and progress are JSON, states are safetensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from k3.model.state import SequenceState


@dataclass
class Ticket:
    trajectory_id: str
    group_id: str
    group_size: int
    environment: str
    split: str
    index: int
    effort: str
    group_seq: int
    """The worker's admission counter of the group (orders adoption)."""
    member: int
    """Position in the group."""


@dataclass
class Progress:
    """What a paused trajectory has produced so far (everything after the prompt)."""

    output_ids: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    generated: int = 0
    """Tokens the policy generated (loss_mask 1)."""
    turn_start: int = 0
    """Index in ``output_ids`` where the current model turn began."""
    pauses: int = 0


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class Spool:
    """The spool folder of one worker."""

    def __init__(self, root: str | os.PathLike, worker_id: str):
        self.dir = Path(root) / worker_id
        self.tickets = self.dir / "tickets"
        self.paused = self.dir / "paused"
        self.tickets.mkdir(parents=True, exist_ok=True)
        self.paused.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _name(trajectory_id: str) -> str:
        return trajectory_id.replace("/", "~")

    # -- counters ----------------------------------------------------------------------------------------------
    def load_counters(self) -> dict[str, int]:
        path = self.dir / "counters.json"
        if not path.is_file():
            return {"next_group": 0, "published": 0}
        return {k: int(v) for k, v in json.loads(path.read_text(encoding="utf-8")).items()}

    def save_counters(self, next_group: int, published: int) -> None:
        _write_atomic(self.dir / "counters.json",
                      json.dumps({"next_group": next_group, "published": published}).encode())

    # -- tickets -----------------------------------------------------------------------------------------------
    def admit(self, ticket: Ticket) -> None:
        _write_atomic(self.tickets / f"{self._name(ticket.trajectory_id)}.json", json.dumps(asdict(ticket)).encode())

    def done(self, trajectory_id: str) -> None:
        name = self._name(trajectory_id)
        for path in (self.paused / f"{name}.json", self.paused / f"{name}.state", self.tickets / f"{name}.json"):
            path.unlink(missing_ok=True)

    def pause(self, trajectory_id: str, progress: Progress, state: SequenceState | None) -> None:
        name = self._name(trajectory_id)
        if state is not None:
            _write_atomic(self.paused / f"{name}.state", state.to_bytes())
        else:
            (self.paused / f"{name}.state").unlink(missing_ok=True)
        _write_atomic(self.paused / f"{name}.json", json.dumps(asdict(progress)).encode())

    def pending(self) -> list[tuple[Ticket, Progress | None, SequenceState | None]]:
        """Every ticket left, with its saved progress and state when it was paused, in admission order."""
        out = []
        tickets = [Ticket(**json.loads(p.read_text(encoding="utf-8"))) for p in self.tickets.glob("*.json")]
        for ticket in sorted(tickets, key=lambda t: (t.group_seq, t.member)):
            name = self._name(ticket.trajectory_id)
            progress = state = None
            if (self.paused / f"{name}.json").is_file():
                progress = Progress(**json.loads((self.paused / f"{name}.json").read_text(encoding="utf-8")))
                if (self.paused / f"{name}.state").is_file():
                    state = SequenceState.from_bytes((self.paused / f"{name}.state").read_bytes())
            out.append((ticket, progress, state))
        return out
