"""How sequence states are stored in the cache store: keys for any prefix length, and the two block kinds.

Keys. The cache store addresses full 512-token blocks by chained hashes (``k3.services.cache.hashing``):
``key_i = H(key_{i-1} || block i)``. A checkpoint may also sit at a message end inside a block, so the key of
the state after the first ``n`` tokens is defined for every ``n >= 1`` as

    b = (n - 1) // 512                                   # the block that token n-1 belongs to
    prefix_key(n) = block_hash(key_{b-1} (None for b = 0), tokens[512 b : n])

For ``n`` a multiple of 512 this *is* the chained block key, so full-block checkpoints are exactly where the
router's ``Lookup`` looks for them; for any other ``n`` it is the key the block would get if it ended at ``n``
(a partial block hashes fewer token ids, so it can never collide with a full one). A later turn, whose prompt
starts with the same ``n`` tokens, computes the same key: it only needs the candidate ``n`` (a message end).

Values, both ``k3.v1.Block``s with metadata ``format``, ``config_hash``, ``num_tokens`` (= n), ``partial``:

- ``kda_checkpoint`` at ``prefix_key(n)``: every KDA layer's conv and recurrent state after ``n`` tokens
  (tensors ``layers.{i}.kda.{conv_q|conv_k|conv_v|recurrent}``, batch 1). Small and fixed-size.
- ``mla_block`` at ``prefix_key(n)``: the MLA latent rows of tokens ``[512 b, n)`` of every MLA layer
  (``layers.{i}.mla.{c_kv|k_extra}``; metadata ``start`` = 512 b).

Restoring the state after ``n`` tokens = the KDA checkpoint at ``prefix_key(n)`` + the concatenation of the
``mla_block``s at ``key_0 .. key_{b-1}`` and at ``prefix_key(n)``. Blocks are checked against the model's
``config_hash`` and the expected shapes; a block that does not match is treated as a miss, never loaded.
Keys depend on tokens only, so one cache store (or Redis prefix) serves one model configuration; the
``config_hash`` check keeps a shared store from ever mixing states, at the price of overwriting.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from k3.model.config import K3Config
from k3.model.kda import KDAState
from k3.model.mla import MLACache
from k3.model.state import SequenceState
from k3.protos.v1 import cache_pb2
from k3.services.cache.hashing import BLOCK_TOKENS, block_hash
from k3.services.common import tensors
from k3.services.common.errors import InvalidArgument

KDA_KIND = "kda_checkpoint"
MLA_KIND = "mla_block"
BLOCK_FORMAT = "k3.state_block.v1"
_KDA_FIELDS = ("conv_q", "conv_k", "conv_v", "recurrent")


class BlockFormatError(ValueError):
    """A stored block does not hold what its key promises for this model."""


def block_start(n: int) -> int:
    """First token of the block that the state after ``n`` tokens ends in."""
    return (n - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def prefix_key(token_ids: Sequence[int], n: int, chain_keys: Sequence[bytes]) -> bytes:
    """Key of the state after the first ``n`` tokens; ``chain_keys`` are the full-block keys of
    ``token_ids`` (at least the first ``(n - 1) // 512``)."""
    if not 1 <= n <= len(token_ids):
        raise ValueError(f"n must be in [1, {len(token_ids)}], got {n}")
    b = (n - 1) // BLOCK_TOKENS
    return block_hash(chain_keys[b - 1] if b else None, token_ids[b * BLOCK_TOKENS: n])


def _metadata(config_hash: str, n: int, **extra) -> dict[str, str]:
    return {"format": BLOCK_FORMAT, "config_hash": config_hash, "num_tokens": str(n),
            "partial": "false" if n % BLOCK_TOKENS == 0 else "true", **{k: str(v) for k, v in extra.items()}}


def encode_kda(key: bytes, state: SequenceState) -> cache_pb2.Block:
    """The ``kda_checkpoint`` block of ``state`` (after ``state.num_tokens`` tokens)."""
    names, values = [], []
    for i, kda in sorted(state.kda.items()):
        for name in _KDA_FIELDS:
            names.append(f"layers.{i}.kda.{name}")
            values.append(tensors.to_proto(getattr(kda, name)))
    return cache_pb2.Block(key=key, kind=KDA_KIND, names=names, tensors=values,
                           metadata=_metadata(state.config_hash, state.num_tokens))


def encode_mla(key: bytes, state: SequenceState, start: int, end: int) -> cache_pb2.Block:
    """The ``mla_block`` holding rows ``[start, end)`` of every MLA layer of ``state``."""
    names, values = [], []
    for i, cache in sorted(state.mla.items()):
        names += [f"layers.{i}.mla.c_kv", f"layers.{i}.mla.k_extra"]
        values += [tensors.to_proto(cache.c_kv[start:end]), tensors.to_proto(cache.k_extra[start:end])]
    return cache_pb2.Block(key=key, kind=MLA_KIND, names=names, tensors=values,
                           metadata=_metadata(state.config_hash, end, start=start))


def _check_meta(block: cache_pb2.Block, kind: str, config_hash: str, n: int) -> dict[str, torch.Tensor]:
    meta = block.metadata
    if block.kind != kind or meta.get("format") != BLOCK_FORMAT:
        raise BlockFormatError(f"expected a {kind} block of format {BLOCK_FORMAT}, got kind {block.kind!r} "
                               f"format {meta.get('format')!r}")
    if meta.get("config_hash") != config_hash:
        raise BlockFormatError(f"block belongs to model config {meta.get('config_hash')!r}, not {config_hash!r}")
    if meta.get("num_tokens") != str(n):
        raise BlockFormatError(f"block holds the state after {meta.get('num_tokens')} tokens, expected {n}")
    try:
        return {name: tensors.from_proto(t, name) for name, t in zip(block.names, block.tensors, strict=True)}
    except (ValueError, InvalidArgument) as exc:
        raise BlockFormatError(f"malformed tensors: {exc}") from None


def decode_kda(block: cache_pb2.Block, cfg: K3Config, n: int) -> dict[int, KDAState]:
    """The KDA states stored in a ``kda_checkpoint`` block for the state after ``n`` tokens."""
    values = _check_meta(block, KDA_KIND, cfg.config_hash(), n)
    layers = [i for i in range(cfg.num_layers) if cfg.layer_kind(i) == "kda"]
    expected = {f"layers.{i}.kda.{f}" for i in layers for f in _KDA_FIELDS}
    if set(values) != expected:
        raise BlockFormatError(f"kda_checkpoint has tensors {sorted(values)}, expected {sorted(expected)}")
    out = {}
    for i in layers:
        try:
            state = KDAState.from_dict({f: values[f"layers.{i}.kda.{f}"] for f in _KDA_FIELDS})
            state.check(1, cfg)
        except ValueError as exc:
            raise BlockFormatError(f"layer {i}: {exc}") from None
        out[i] = state
    return out


def decode_mla(block: cache_pb2.Block, cfg: K3Config, start: int, end: int) -> dict[int, MLACache]:
    """The latent rows ``[start, end)`` of every MLA layer stored in an ``mla_block``."""
    values = _check_meta(block, MLA_KIND, cfg.config_hash(), end)
    if block.metadata.get("start") != str(start):
        raise BlockFormatError(f"mla_block starts at token {block.metadata.get('start')}, expected {start}")
    layers = [i for i in range(cfg.num_layers) if cfg.layer_kind(i) == "mla"]
    expected = {f"layers.{i}.mla.{f}" for i in layers for f in ("c_kv", "k_extra")}
    if set(values) != expected:
        raise BlockFormatError(f"mla_block has tensors {sorted(values)}, expected {sorted(expected)}")
    out = {}
    for i in layers:
        c, e = values[f"layers.{i}.mla.c_kv"], values[f"layers.{i}.mla.k_extra"]
        if tuple(c.shape) != (end - start, cfg.kv_lora_rank) or tuple(e.shape) != (end - start, cfg.qk_extra_dim):
            raise BlockFormatError(f"layer {i}: latent shapes {tuple(c.shape)} / {tuple(e.shape)} do not hold "
                                   f"tokens [{start}, {end})")
        out[i] = MLACache(c, e)
    return out


def assemble(cfg: K3Config, n: int, kda: dict[int, KDAState], mla_parts: list[dict[int, MLACache]],
             device: torch.device | str = "cpu") -> SequenceState:
    """The state after ``n`` tokens from its KDA checkpoint and its MLA blocks in token order."""
    mla = {}
    for i in mla_parts[0]:
        mla[i] = MLACache(torch.cat([p[i].c_kv for p in mla_parts]).to(device),
                          torch.cat([p[i].k_extra for p in mla_parts]).to(device))
        if len(mla[i]) != n:
            raise BlockFormatError(f"MLA blocks of layer {i} hold {len(mla[i])} tokens, expected {n}")
    kda = {i: KDAState.from_dict({k: v.to(device) for k, v in s.to_dict().items()}) for i, s in kda.items()}
    return SequenceState(cfg.config_hash(), n, kda, mla)
