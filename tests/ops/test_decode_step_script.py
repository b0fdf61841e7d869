"""``ops/bench/decode_step.py`` on the CPU: both decode APIs compute the same logits and the rows are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "ops/bench/decode_step.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_times_both_paths_on_the_same_computation(tmp_path):
    out = tmp_path / "rows.json"
    proc = run("--preset", "tiny", "--batch", "1", "3", "--context", "40", "--iters", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 40), (3, 40)]
    for r in rows:
        assert r["decode_ms"] > 0 and r["paged_ms"] > 0
        assert r["max_rel_diff"] < 1e-4  # the two APIs computed the same logits
    assert "speed-up" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--batch", "0"], "positive"),
    (["--preset", "huge"], "huge"),
    (["--preset", "tiny", "--context", "5000"], "max_seq_len"),
    (["--device", "tpu"], "cpu or cuda"),
    (["--graph"], "--graph needs --device cuda"),
])
def test_bad_arguments_are_refused(args, message):
    proc = run(*args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
