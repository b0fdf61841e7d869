"""The prefill -> decode state hand-off as a client stream of ``HandoffChunk``s, and its reassembly.

Design decisions:

- The state travels as ``SequenceState.to_bytes()`` (safetensors: tensors and a JSON header, never pickle),
  the last prompt token's logits as raw little-endian float32, the prompt's token ids as ints.
- Every serialised chunk stays within ``chunk_bytes`` (1 MiB by default), whatever the state size: bytes and
  repeated fields are cut into pieces and concatenated by the receiver in order; scalar fields ride on the
  first chunk. So a 1M-token state never meets a message-size limit, and the receiver can refuse an oversized
  hand-off after its first chunk (``total_bytes``) instead of after buffering it.
- ``HandoffAssembler`` validates as chunks arrive (request id only on the first chunk or repeated unchanged,
  no more state bytes than announced) and at the end (all announced bytes arrived); errors are
  ``InvalidArgument`` naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from k3.protos.v1 import engine_pb2
from k3.services.common.errors import InvalidArgument

MAX_CHUNK_BYTES = 1 << 20
_OVERHEAD = 64            # room for tags, lengths and the first chunk's scalar fields
_MAX_VARINT_BYTES = 5     # an int32 token id >= 0 takes at most 5 bytes as a varint
MAX_REQUEST_ID_CHARS = 256


def handoff_chunks(request_id: str, state: bytes, last_logits: torch.Tensor, token_ids: Sequence[int],
                   cached_tokens: int = 0, chunk_bytes: int = MAX_CHUNK_BYTES,
                   key_ids: Sequence[int] | None = None) -> Iterator[engine_pb2.HandoffChunk]:
    """The chunks of one hand-off, each at most ``chunk_bytes`` serialised. ``key_ids``: the prompt's cache-key
    ids when they differ from ``token_ids`` (a prompt with images)."""
    budget = chunk_bytes - _OVERHEAD - len(request_id.encode())
    if budget < 1024:
        raise ValueError(f"chunk_bytes {chunk_bytes} is too small for request id {request_id!r}")
    logits = last_logits.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    first = engine_pb2.HandoffChunk(request_id=request_id, total_bytes=len(state), cached_tokens=cached_tokens)
    pieces: list[engine_pb2.HandoffChunk] = []
    for name, data in (("last_logits", logits), ("state", state)):
        pieces += [engine_pb2.HandoffChunk(**{name: data[i:i + budget]}) for i in range(0, len(data), budget)]
    per_chunk = budget // _MAX_VARINT_BYTES
    ids = list(token_ids)
    pieces += [engine_pb2.HandoffChunk(token_ids=ids[i:i + per_chunk]) for i in range(0, len(ids), per_chunk)]
    keys = list(key_ids or ())
    pieces += [engine_pb2.HandoffChunk(key_ids=keys[i:i + per_chunk]) for i in range(0, len(keys), per_chunk)]
    first.MergeFrom(pieces[0])
    yield first
    yield from pieces[1:]


@dataclass
class Handoff:
    request_id: str
    state: bytes
    last_logits: torch.Tensor
    token_ids: list[int]
    cached_tokens: int
    key_ids: list[int] | None = None
    """The prompt's cache-key ids when they differ from ``token_ids`` (images), else None."""


class HandoffAssembler:
    """Collects the chunks of one hand-off; ``max_state_bytes`` bounds what a sender may announce."""

    def __init__(self, max_state_bytes: int):
        self.max_state_bytes = max_state_bytes
        self.request_id = ""
        self._total = -1
        self._cached = 0
        self._state = bytearray()
        self._logits = bytearray()
        self._tokens: list[int] = []
        self._keys: list[int] = []

    def add(self, chunk: engine_pb2.HandoffChunk) -> None:
        if self._total < 0:  # first chunk
            if not chunk.request_id:
                raise InvalidArgument("request_id", "must be set on the first chunk", reason="MISSING_FIELD")
            if len(chunk.request_id) > MAX_REQUEST_ID_CHARS:
                raise InvalidArgument("request_id", f"must be at most {MAX_REQUEST_ID_CHARS} characters")
            if not 0 < chunk.total_bytes <= self.max_state_bytes:
                raise InvalidArgument("total_bytes", f"must be in [1, {self.max_state_bytes}], got "
                                      f"{chunk.total_bytes}", reason="BAD_STATE_SIZE")
            if chunk.cached_tokens < 0:
                raise InvalidArgument("cached_tokens", f"must be >= 0, got {chunk.cached_tokens}")
            self.request_id, self._total, self._cached = chunk.request_id, chunk.total_bytes, chunk.cached_tokens
        elif chunk.request_id and chunk.request_id != self.request_id:
            raise InvalidArgument("request_id", f"changed from {self.request_id!r} to {chunk.request_id!r} "
                                  "within one hand-off")
        if len(self._state) + len(chunk.state) > self._total:
            raise InvalidArgument("state", f"more bytes than the announced total_bytes {self._total}",
                                  reason="BAD_STATE_SIZE")
        self._state += chunk.state
        self._logits += chunk.last_logits
        self._tokens += chunk.token_ids
        self._keys += chunk.key_ids

    def result(self, vocab_size: int) -> Handoff:
        if self._total < 0:
            raise InvalidArgument("request_id", "the hand-off stream held no chunk", reason="MISSING_FIELD")
        if len(self._state) != self._total:
            raise InvalidArgument("state", f"{len(self._state)} bytes arrived of the announced {self._total}",
                                  reason="BAD_STATE_SIZE")
        if len(self._logits) != 4 * vocab_size:
            raise InvalidArgument("last_logits", f"must be {vocab_size} float32 values ({4 * vocab_size} bytes), "
                                  f"got {len(self._logits)} bytes", reason="BAD_LOGITS")
        if self._keys and len(self._keys) != len(self._tokens):
            raise InvalidArgument("key_ids", f"has {len(self._keys)} ids for {len(self._tokens)} prompt tokens",
                                  reason="BAD_KEY_IDS")
        logits = torch.frombuffer(self._logits, dtype=torch.float32).clone()
        return Handoff(self.request_id, bytes(self._state), logits, self._tokens, self._cached,
                       self._keys or None)
