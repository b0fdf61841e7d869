"""Chained block hashes: the pinned byte layout, prefix sharing, and what changes when a block changes."""

import hashlib
import struct

import numpy as np
import pytest

from k3.services.cache.hashing import BLOCK_TOKENS, DOMAIN, block_hash, chain_block_hashes

# Cross-checked with coreutils `b2sum -l 256` over the documented message bytes.
VECTOR_TOKENS = [1, 2, 3, 4, 5, 6, 7, 0xFFFFFFFF, 9]
VECTOR_KEYS = [
    "116167b56a0e4e5ba87b0d1b79adeb6f300dd12b37fdcf98e9ac8b59b1709ec4",
    "3e5e762a13ebfe5e5c61af5d92cc72730b0c6ba222a6155857ebdc3336a1c4bc",
]
# Default block size: tokens 0..1023 plus one token of a partial third block.
VECTOR_512_KEYS = [
    "f973445cdce5c64d5f2e9fa459c8e26d3e08272eb8c46a9a0a1582e982cea56e",
    "2c11f5a093683b993bb6a7d88688363925229046261041942c07e07574649569",
]


def test_test_vector_small_blocks():
    keys = chain_block_hashes(VECTOR_TOKENS, block_size=4)
    assert [k.hex() for k in keys] == VECTOR_KEYS


def test_test_vector_default_block_size():
    assert BLOCK_TOKENS == 512
    assert [k.hex() for k in chain_block_hashes(list(range(1025)))] == VECTOR_512_KEYS


def test_layout_matches_documentation():
    # Rebuild the message by hand from the module docstring's layout.
    first = hashlib.blake2b(DOMAIN + b"\x00" + struct.pack("<4I", 1, 2, 3, 4), digest_size=32).digest()
    second = hashlib.blake2b(
        DOMAIN + b"\x20" + first + struct.pack("<4I", 5, 6, 7, 0xFFFFFFFF), digest_size=32
    ).digest()
    assert DOMAIN == b"k3-block-hash-v1"
    assert block_hash(None, [1, 2, 3, 4]) == first
    assert block_hash(first, [5, 6, 7, 0xFFFFFFFF]) == second
    assert len(first) == 32


def test_same_prefix_gives_same_leading_keys():
    shared = list(range(2 * 8))
    a = chain_block_hashes(shared + [100] * 8, block_size=8)
    b = chain_block_hashes(shared + [200] * 8 + [1] * 8, block_size=8)
    assert a[:2] == b[:2]
    assert a[2] != b[2]
    assert len(a) == 3 and len(b) == 4


def test_changing_block_i_changes_keys_from_i_on_only():
    tokens = list(range(5 * 16))
    before = chain_block_hashes(tokens, block_size=16)
    tokens[2 * 16 + 7] += 1  # one token inside block 2
    after = chain_block_hashes(tokens, block_size=16)
    assert before[:2] == after[:2]
    assert all(x != y for x, y in zip(before[2:], after[2:], strict=True))


def test_key_depends_on_predecessor_not_only_own_tokens():
    block = list(range(8))
    keys = chain_block_hashes(block * 2, block_size=8)
    assert keys[0] != keys[1]  # same tokens, different position in the chain


def test_partial_trailing_block_is_not_hashed():
    tokens = list(range(2 * BLOCK_TOKENS + BLOCK_TOKENS - 1))
    keys = chain_block_hashes(tokens)
    assert len(keys) == 2
    assert chain_block_hashes(tokens + [0])[:2] == keys
    assert len(chain_block_hashes(tokens + [0])) == 3
    assert chain_block_hashes(list(range(BLOCK_TOKENS - 1))) == []
    assert chain_block_hashes([]) == []


def test_length_byte_separates_first_and_chained_blocks():
    # Without the length byte, a first block starting with a key's bytes would collide with a chained one.
    prev = block_hash(None, [1, 2, 3])
    spelled = list(struct.unpack("<8I", prev))
    assert block_hash(None, spelled + [4, 5]) != block_hash(prev, [4, 5])


def test_accepts_numpy_token_arrays():
    tokens = np.arange(40, dtype=np.int64)
    assert chain_block_hashes(tokens, block_size=8) == chain_block_hashes(list(range(40)), block_size=8)


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"prev must be None or a 32-byte key, got 31 bytes"):
        block_hash(b"x" * 31, [1])
    with pytest.raises(ValueError, match=r"token_ids\[1\] = -1 does not fit in an unsigned 32-bit integer"):
        block_hash(None, [0, -1])
    with pytest.raises(ValueError, match=r"token_ids\[0\] = 4294967296 does not fit"):
        block_hash(None, [1 << 32])
    with pytest.raises(ValueError, match=r"token_ids\[2\] = 1180591620717411303424 does not fit"):
        block_hash(None, [1, 2, 1 << 70])
    with pytest.raises(ValueError, match=r"token_ids\[1\] = 2.5 is not an integer"):
        block_hash(None, [1, 2.5])
    with pytest.raises(ValueError, match=r"token_ids\[3\] = -7 does not fit"):
        chain_block_hashes(np.array([1, 2, 3, -7], dtype=np.int32), block_size=2)
    with pytest.raises(ValueError, match=r"token_ids must be one-dimensional, got shape \(2, 2\)"):
        block_hash(None, np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match=r"block_size must be positive, got 0"):
        chain_block_hashes([1, 2, 3], block_size=0)
