"""Prefix-cache keys of prompts with images: the image's content hash enters the block hashes.

An image reaches the language model as a run of identical placeholder ids, so two prompts with the same text
and different images have the same token ids; keying the prefix cache on token ids alone would let one
image's cached state answer a prompt about another. The cache keys are therefore computed over *key ids*:
the token ids with every visual-token position replaced by a value derived from the image's content hash.
Everything that hashes blocks (``k3.services.cache.hashing``: the router's affinity lookups, prefill's
checkpoint saves and restores, decode's end-of-turn checkpoint) takes the key ids instead of the token ids
and is otherwise unchanged; prefixes before the first image keep their text keys and stay shared.

Layout (``image_key_ids``): position ``j`` of an image with 32-byte content hash ``h`` gets

    d_k  = BLAKE2b-256(DOMAIN || h || k as uint32 little-endian),  k = j // 8
    id_j = 0x80000000 | (d_k[4 (j mod 8) : 4 (j mod 8) + 4] as uint32 little-endian)

Token ids are below 2^31 (they are int32 on the wire), so a key id can never equal a text token's id. The
first 8 positions of an image carry 8 x 31 = 248 bits of its hash, and since block keys are chained, every
block from the image's first token on depends on them: two different images of 8 or more visual tokens
collide with probability about 2^-248. A smaller image carries 31 bits per visual token (the smallest
possible image, one 28 x 28 token, 31 bits), which is still far from an accidental collision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

DOMAIN = b"k3-image-key-v1"
KEY_ID_BIT = 0x80000000
WORDS_PER_DIGEST = 8


def image_key_ids(content_hash: bytes, length: int) -> list[int]:
    """The ``length`` key ids of an image's visual tokens (module docstring)."""
    if len(content_hash) != 32:
        raise ValueError(f"content_hash must be 32 bytes, got {len(content_hash)}")
    out: list[int] = []
    for k in range(-(-length // WORDS_PER_DIGEST)):
        digest = hashlib.blake2b(DOMAIN + content_hash + k.to_bytes(4, "little"), digest_size=32).digest()
        out += [KEY_ID_BIT | int.from_bytes(digest[4 * w:4 * w + 4], "little") for w in range(WORDS_PER_DIGEST)]
    return out[:length]


def media_key_ids(token_ids: Sequence[int], images: Sequence[tuple[int, int, bytes]]) -> list[int]:
    """``token_ids`` with each image's positions ``[start, start + length)`` replaced by its key ids.

    ``images`` are ``(start, length, content_hash)``; with none the result equals ``token_ids``.
    """
    ids = [int(t) for t in token_ids]
    for start, length, content_hash in images:
        if start < 0 or length < 1 or start + length > len(ids):
            raise ValueError(f"image span [{start}, {start + length}) is outside the {len(ids)} prompt tokens")
        ids[start:start + length] = image_key_ids(content_hash, length)
    return ids
