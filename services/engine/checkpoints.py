"""``CheckpointStore``: saving sequence states to the cache store and restoring the longest cached prefix.

The format and keys are in ``blocks``. This module decides what to write and where to look:

- ``save(tokens, state, mla_from)``: the state after ``n = state.num_tokens`` tokens goes in as the
  ``mla_block``s of full blocks ending in ``(mla_from, n)`` (rows the store does not have yet), the ``mla_block``
  of ``n``'s own (possibly partial) block, and last the ``kda_checkpoint``: a reader that finds the KDA
  checkpoint can count on the MLA blocks before it.
- ``restore(tokens, message_ends)``: candidates are the longest run of full blocks whose KDA checkpoints and MLA
  blocks are both present (two ``Lookup``s) and every message end beyond it (partial-block checkpoints are only
  ever written at message ends and turn ends, which are message ends of the next turn's prompt). They are
  tried longest first; a candidate whose blocks turn out missing or malformed (evicted in between, another
  model's) is skipped. At least one prompt token is always left to compute, since the last token's logits are
  not stored.
- The cache is an accelerator, never a dependency: a failing or unreachable cache store is logged and counted
  (``errors``) and the work goes on as a miss (restore) or without the checkpoint (save).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import grpc
import torch

from k3.model.config import K3Config
from k3.model.state import SequenceState
from k3.protos.v1 import cache_pb2, cache_pb2_grpc
from k3.services.cache.hashing import BLOCK_TOKENS, chain_block_hashes
from k3.services.engine.blocks import (
    KDA_KIND,
    MLA_KIND,
    BlockFormatError,
    assemble,
    block_start,
    decode_kda,
    decode_mla,
    encode_kda,
    encode_mla,
    prefix_key,
)

log = logging.getLogger(__name__)


class _Miss(Exception):
    """A candidate prefix cannot be restored."""


class CheckpointStore:
    """Checkpoint writes and prefix restores for one model over a ``k3.v1.CacheStore`` channel."""

    def __init__(self, channel: grpc.Channel, cfg: K3Config, timeout_s: float = 10.0,
                 device: torch.device | str = "cpu"):
        self.stub = cache_pb2_grpc.CacheStoreStub(channel)
        self.cfg = cfg
        self.timeout_s = timeout_s
        self.device = device
        self._lock = threading.Lock()
        self.errors = 0
        """Cache store calls that failed (the request went on without them)."""

    def _failed(self, what: str, exc: grpc.RpcError) -> None:
        with self._lock:
            self.errors += 1
        log.warning("cache store %s failed: %s %s", what, exc.code(), exc.details())

    # -- save -------------------------------------------------------------------------------------------------
    def save(self, token_ids: Sequence[int], state: SequenceState, mla_from: int) -> bool:
        """Store the state after ``state.num_tokens`` tokens of ``token_ids``; True if it was stored."""
        n = state.num_tokens
        chain = chain_block_hashes(token_ids[:n])
        key = prefix_key(token_ids, n, chain)
        first_full = (mla_from // BLOCK_TOKENS + 1) * BLOCK_TOKENS
        blocks = [encode_mla(chain[end // BLOCK_TOKENS - 1], state, end - BLOCK_TOKENS, end)
                  for end in range(first_full, n, BLOCK_TOKENS)]
        blocks += [encode_mla(key, state, block_start(n), n), encode_kda(key, state)]
        try:
            for block in blocks:
                self.stub.Put(cache_pb2.PutRequest(block=block), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self._failed(f"put of the checkpoint after {n} tokens", exc)
            return False
        return True

    # -- restore ----------------------------------------------------------------------------------------------
    def restore(self, token_ids: Sequence[int], message_ends: Sequence[int],
                check: Callable[[], None] = lambda: None) -> SequenceState | None:
        """The state after the longest restorable prefix of ``token_ids`` (shorter than the whole), or None.
        ``check`` runs between cache calls and may raise to stop (cancellation)."""
        n = len(token_ids)
        keys = chain_block_hashes(token_ids)
        try:
            hk = self._lookup(KDA_KIND, keys)
            hm = self._lookup(MLA_KIND, keys)
        except grpc.RpcError as exc:
            self._failed("lookup", exc)
            return None
        limit = n - 1
        full = min(hk, hm, limit // BLOCK_TOKENS) * BLOCK_TOKENS
        candidates = {full} if full else set()
        candidates |= {m for m in message_ends if full < m <= limit and (m - 1) // BLOCK_TOKENS <= hm}
        mla_prefix: list[cache_pb2.Block] | None = None
        for m in sorted(candidates, reverse=True):
            check()
            b = (m - 1) // BLOCK_TOKENS
            try:
                if mla_prefix is None:  # one streamed fetch serves every candidate
                    mla_prefix = self._get_many(MLA_KIND, keys[: (max(candidates) - 1) // BLOCK_TOKENS])
                    check()
                return self._restore_at(token_ids, m, keys, mla_prefix[:b], b)
            except _Miss as exc:
                log.info("cached prefix of %d tokens not usable: %s", m, exc)
            except grpc.RpcError as exc:
                self._failed(f"restore of a {m}-token prefix", exc)
                return None
        return None

    def _restore_at(self, token_ids: Sequence[int], m: int, keys: list[bytes], full_blocks: list, b: int):
        if len(full_blocks) < b:
            raise _Miss(f"only {len(full_blocks)} of its {b} full MLA blocks are stored")
        key = prefix_key(token_ids, m, keys)
        kda_block, last_block = self._get(KDA_KIND, key), self._get(MLA_KIND, key)
        if kda_block is None or last_block is None:
            raise _Miss("its KDA checkpoint or last MLA block is not stored")
        try:
            kda = decode_kda(kda_block, self.cfg, m)
            parts = [decode_mla(blk, self.cfg, j * BLOCK_TOKENS, (j + 1) * BLOCK_TOKENS)
                     for j, blk in enumerate(full_blocks)]
            parts.append(decode_mla(last_block, self.cfg, block_start(m), m))
            return assemble(self.cfg, m, kda, parts, self.device)
        except BlockFormatError as exc:
            raise _Miss(str(exc)) from None

    def _lookup(self, kind: str, keys: list[bytes]) -> int:
        if not keys:
            return 0
        return self.stub.Lookup(cache_pb2.LookupRequest(keys=keys, kind=kind), timeout=self.timeout_s).hit_blocks

    def _get(self, kind: str, key: bytes) -> cache_pb2.Block | None:
        response = self.stub.Get(cache_pb2.GetRequest(key=key, kind=kind), timeout=self.timeout_s)
        return response.block if response.found else None

    def _get_many(self, kind: str, keys: list[bytes]) -> list[cache_pb2.Block]:
        if not keys:
            return []
        stream = self.stub.GetMany(cache_pb2.GetManyRequest(keys=keys, kind=kind), timeout=self.timeout_s)
        return [r.block for r in stream if r.found]
