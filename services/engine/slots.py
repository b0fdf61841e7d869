"""``SlotPool``: the fixed pool of per-sequence KDA + short-convolution states.

A KDA layer's memory of a sequence has the same size after ten tokens or a million (three conv states of
``kernel - 1`` inputs and one fp32 ``H x K x V`` matrix), so the engine preallocates ``max_slots`` rows of each
and a resident sequence owns one row index, its *slot*, for its whole life.

Design decisions:

- One tensor per (layer, field) with the slot as the batch dimension: ``views(slot)`` hands the model batch-1
  views of a row (no copy) and ``write`` stores the model's new state into the row in place, so the pool's
  memory never moves.
- A slot is zeroed when it is acquired: a fresh prompt starts from the zero state and a handed-off state
  overwrites every field anyway.
- The pool only hands out and takes back indices; who may use how many (queueing, exhaustion errors) is the
  scheduler's decision.
"""

from __future__ import annotations

import torch

from k3.model.config import K3Config
from k3.model.kda import KDAState

_FIELDS = ("conv_q", "conv_k", "conv_v", "recurrent")


class SlotPool:
    """``num_slots`` KDA state rows for every KDA layer of ``cfg``."""

    def __init__(self, cfg: K3Config, num_slots: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32):
        self.cfg = cfg
        self.num_slots = num_slots
        self.layers = [i for i in range(cfg.num_layers) if cfg.layer_kind(i) == "kda"]
        self._states = {i: KDAState.zeros(num_slots, cfg, device, dtype) for i in self.layers}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def states(self) -> dict[int, KDAState]:
        """Layer -> the whole pool (``num_slots`` rows of every field), what ``K3Model.decode_paged`` advances."""
        return self._states

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot over every KDA layer and field (the same for every sequence, at any length)."""
        return sum(getattr(state, name)[0].numel() * getattr(state, name).element_size()
                   for state in self._states.values() for name in _FIELDS)

    def acquire(self) -> int | None:
        """A zeroed slot, or None when every slot is taken."""
        if not self._free:
            return None
        slot = self._free.pop()
        for state in self._states.values():
            for name in _FIELDS:
                getattr(state, name)[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free.append(slot)

    def views(self, slot: int) -> dict[int, KDAState]:
        """Layer -> batch-1 ``KDAState`` viewing the slot's rows (writes through to the pool)."""
        return {
            i: KDAState(**{name: getattr(state, name)[slot:slot + 1] for name in _FIELDS})
            for i, state in self._states.items()
        }

    def write(self, slot: int, states: dict[int, KDAState]) -> None:
        """Store batch-1 states (one per KDA layer) into the slot's rows."""
        for i, pool in self._states.items():
            new = states[i]
            for name in _FIELDS:
                getattr(pool, name)[slot].copy_(getattr(new, name)[0])

    def snapshot(self, slot: int) -> dict[int, KDAState]:
        """Independent copies of the slot's states (for checkpoints that outlive the slot)."""
        return {
            i: KDAState(**{name: getattr(state, name)[slot:slot + 1].clone() for name in _FIELDS})
            for i, state in self._states.items()
        }
