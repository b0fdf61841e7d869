"""``k3 bench trace``: replay of Mooncake-format traces against a prefix cache index, checked by brute force."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from k3.cli import main
from k3.services.router.trace import PrefixCacheIndex, TraceError, parse_line, read_trace, replay

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
SYNTH = REPO / "ops" / "traces" / "synth.py"


def _synth(tmp_path: Path, *args: str) -> Path:
    out = tmp_path / "trace.jsonl"
    subprocess.run([sys.executable, str(SYNTH), "--out", str(out), *args], check=True, timeout=60)
    return out


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def brute_force_hits(records: list[dict], capacity: int | None) -> tuple[list[int], list[int]]:
    """Per request: (hit blocks, hit tokens), from the access history rather than a cache structure.

    A block is cached before request i if it was accessed by an earlier request and, with a capacity C,
    fewer than C distinct other blocks were accessed after its last access (the LRU stack property).
    """
    history: list[int] = []  # every block access of the earlier requests, in order
    hits, tokens = [], []
    for record in records:
        ids = record["hash_ids"]

        def cached(block: int) -> bool:
            if block not in history:
                return False
            if capacity is None:
                return True
            last = len(history) - 1 - history[::-1].index(block)
            return len(set(history[last + 1:]) - {block}) < capacity

        k = 0
        while k < len(ids) and cached(ids[k]):
            k += 1
        n = len(ids)
        hits.append(k)
        tokens.append(sum(512 if j < n - 1 else record["input_length"] - 512 * (n - 1) for j in range(k)))
        history.extend(ids)
    return hits, tokens


def _run_cli(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["bench", "trace", *args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize("capacity", [None, 40, 7])
def test_replay_matches_brute_force(tmp_path, capsys, capacity):
    path = _synth(tmp_path, "--conversations", "40", "--seed", "3", "--system-tokens", "600-2600",
                  "--user-tokens", "10-900", "--output-tokens", "10-600")
    records = _records(path)
    hits, tokens = brute_force_hits(records, capacity)
    args = ["--trace", str(path)] + (["--capacity-blocks", str(capacity)] if capacity else [])
    status, out, _ = _run_cli(capsys, *args)
    assert status == 0
    report = json.loads(out)
    blocks = sum(len(r["hash_ids"]) for r in records)
    input_tokens = sum(r["input_length"] for r in records)
    assert report["requests"] == len(records)
    assert report["blocks"] == blocks
    assert report["hit_blocks"] == sum(hits)
    assert report["hit_ratio"] == pytest.approx(sum(hits) / blocks)
    assert report["hit_tokens"] == sum(tokens)
    hit_tokens = sum(tokens)
    assert report["input_cost_usd"] == pytest.approx((hit_tokens * 0.30 + (input_tokens - hit_tokens) * 3.00) / 1e6)
    assert report["input_cost_without_cache_usd"] == pytest.approx(input_tokens * 3.00 / 1e6)
    if capacity is None:
        assert report["evictions"] == 0 and sum(hits) > 0
    else:
        assert report["evictions"] > 0


def test_unbounded_beats_small_capacity_and_synth_shares_prefixes(tmp_path):
    path = _synth(tmp_path, "--conversations", "60", "--seed", "1")
    records = _records(path)
    unbounded = replay(read_trace(path.read_text().splitlines()))
    small = replay(read_trace(path.read_text().splitlines()), capacity_blocks=5)
    assert unbounded.hit_blocks > small.hit_blocks
    # Multi-turn: some request's prompt extends an earlier one's by at least one whole shared block.
    firsts = [r["hash_ids"][0] for r in records]
    assert len(set(firsts)) < len(firsts)  # shared system prompts give equal first blocks
    assert unbounded.hit_blocks / unbounded.blocks > 0.3


def test_random_traces_against_brute_force():
    rng = random.Random(7)
    for capacity in (None, 1, 3, 6):
        records = []
        for _ in range(60):
            n = rng.randint(1, 6)
            # a small id alphabet with shared prefixes: ids depend on the position and a few choices
            ids = [rng.choice([0, 1]) * 10 + j for j in range(n)]
            records.append({"timestamp": 0, "input_length": 512 * (n - 1) + rng.randint(1, 512),
                            "output_length": 1, "hash_ids": ids})
        lines = [json.dumps(r) for r in records]
        result = replay(read_trace(lines), capacity)
        hits, tokens = brute_force_hits(records, capacity)
        assert (result.hit_blocks, result.hit_tokens) == (sum(hits), sum(tokens)), capacity


def test_lookup_stops_at_first_miss():
    index = PrefixCacheIndex()
    index.insert((1, 2, 3))
    index.insert((9,))
    assert index.lookup((1, 2, 3, 4)) == 3
    assert index.lookup((1, 7, 3)) == 1  # block 3 is cached but unusable after the miss
    assert index.lookup((5, 1)) == 0
    lru = PrefixCacheIndex(capacity_blocks=2)
    lru.insert((1, 2))
    lru.insert((1,))  # touch 1: 2 is now the least recent
    lru.insert((3,))
    assert lru.lookup((1,)) == 1 and lru.lookup((2,)) == 0 and lru.evictions == 1


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not valid JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [1]}', "line 2: missing field(s) output_length"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "line 2: timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "line 2: input_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": -3, "hash_ids": [1]}', "line 2: output_length"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "1"}', "line 2: hash_ids must be"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1.5]}', "line 2: hash_ids[0]"),
        ('{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}',
         "line 2: 2 hash_ids for input_length 1025; blocks of 512 tokens need exactly 3"),
    ],
)
def test_bad_lines_are_reported_with_their_number(tmp_path, capsys, line, message):
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + line + "\n")
    status, out, err = _run_cli(capsys, "--trace", str(path))
    assert status == 2 and out == ""
    assert message in err and str(path) in err
    with pytest.raises(TraceError, match=r"^line 2: "):
        list(read_trace([good, line]))


def test_cli_errors(tmp_path, capsys):
    status, _, err = _run_cli(capsys, "--trace", str(tmp_path / "missing.jsonl"))
    assert status == 2 and "cannot read trace" in err
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 5, "hash_ids": [1]}\n')
    status, _, err = _run_cli(capsys, "--trace", str(path), "--capacity-blocks", "0")
    assert status == 2 and "--capacity-blocks must be >= 1" in err
    status, _, err = _run_cli(capsys, "--trace", str(path), "--price-hit", "-1")
    assert status == 2 and "--price-hit: must be >= 0, got -1.0" in err
    assert parse_line('{"timestamp": 1.5, "input_length": 512, "output_length": 0, "hash_ids": [4]}', 1).hash_ids == (4,)
