"""Chained block hashes: the addresses of cached prefix blocks.

A prompt is cut into blocks of ``BLOCK_TOKENS`` tokens and block ``i`` is addressed by

    key_i = H(key_{i-1} || token ids of block i),    key_0's predecessor is empty,

so a key names the whole prefix up to the end of its block, not just the block's own tokens: two prompts
share leading keys exactly as long as they share leading blocks, and changing a token in block ``i``
changes keys ``i, i+1, ...`` but none before it. Only full blocks are hashed; a partial trailing block has
no key because its cached state would be overwritten as soon as the block fills up.

Exact byte layout (other languages must reproduce it bit for bit; ``tests/cache/test_hashing.py`` pins a
test vector):

    H       = BLAKE2b, 32-byte digest, unkeyed, no salt, no personalisation (Go: ``blake2b.Sum256``,
              Rust: ``Blake2b<U32>``, libsodium: ``crypto_generichash`` with a 32-byte output)
    message = DOMAIN                    16 bytes, ASCII ``k3-block-hash-v1``
              len(prev)                 1 byte, 0 for the first block, 32 otherwise
              prev                      0 or 32 bytes, the previous key
              token ids                 4 bytes each, unsigned little-endian (uint32), in order
    key     = H(message)

Why this layout: domain separation by a message prefix rather than BLAKE2's personalisation parameter
keeps the hash reproducible with libraries that only expose the plain digest (Go's standard
``x/crypto/blake2b`` has no personalisation). The length byte makes the message unambiguous: without
it, a first block whose leading 8 token ids happen to spell a key would collide with a chained block.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence

import numpy as np

BLOCK_TOKENS = 512
"""Tokens per cache block (the granularity of prefix caching)."""

KEY_BYTES = 32
"""Length of a block key in bytes."""

DOMAIN = b"k3-block-hash-v1"
"""Prefix of every hashed message; bump the version suffix if the layout ever changes."""

_MAX_TOKEN_ID = 0xFFFFFFFF


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as consecutive little-endian uint32s, validated (one numpy pass for a whole prompt)."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        # Not a plain integer array (floats, huge Python ints, mixed objects): check one by one for a
        # precise message; operator.index refuses floats instead of silently truncating them.
        for i, t in enumerate(token_ids):
            try:
                value = operator.index(t)
            except TypeError:
                raise ValueError(f"token_ids[{i}] = {t!r} is not an integer") from None
            if not 0 <= value <= _MAX_TOKEN_ID:
                raise ValueError(f"token_ids[{i}] = {value} does not fit in an unsigned 32-bit integer")
        arr = np.array([operator.index(t) for t in token_ids], dtype=np.int64)
    bad = np.flatnonzero((arr < 0) | (arr > _MAX_TOKEN_ID))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"token_ids[{i}] = {int(arr[i])} does not fit in an unsigned 32-bit integer")
    return arr.astype("<u4", copy=False).tobytes()


def _hash(prev: bytes, block: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(DOMAIN)
    h.update(bytes((len(prev),)))
    h.update(prev)
    h.update(block)
    return h.digest()


def block_hash(prev: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Key of one block given the previous block's key (``None`` for the first block of a prompt).

    Raises ``ValueError`` if ``prev`` is not 32 bytes or a token id is not an integer that fits in an
    unsigned 32-bit int.
    """
    if prev is None:
        prev = b""
    elif len(prev) != KEY_BYTES:
        raise ValueError(f"prev must be None or a {KEY_BYTES}-byte key, got {len(prev)} bytes")
    return _hash(bytes(prev), _token_bytes(token_ids))


def chain_block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_TOKENS) -> list[bytes]:
    """Keys of every full ``block_size``-token block of ``token_ids``, in order.

    A trailing partial block is not hashed, so ``len(result) == len(token_ids) // block_size``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_blocks = len(token_ids) // block_size
    data = _token_bytes(token_ids[: n_blocks * block_size])
    stride = 4 * block_size
    keys: list[bytes] = []
    prev = b""
    for b in range(n_blocks):
        prev = _hash(prev, data[b * stride : (b + 1) * stride])
        keys.append(prev)
    return keys
