"""``ops/bench/multigpu.py`` in its CPU mode (gloo, 2 processes, small shapes): every part runs and is correct.

The GPU run uses the same code paths with NCCL; this keeps the script known to work between GPU runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("multigpu") / "multigpu.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("K3_") and k not in MULTICAST_OFF}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ops/bench/multigpu.py"), "--backend", "gloo", "--device", "cpu",
         "--steps", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=280, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_every_part_ran_with_multicast_off_in_the_children(report):
    data, stdout = report
    for part in ("cp", "ep", "handoff"):
        assert data[part]["environment"] == MULTICAST_OFF  # seen inside the spawned children
    assert "cp forward_backward N=2" in stdout and "handoff" in stdout


def test_context_parallel_matches_one_device(report):
    cp = report[0]["cp"]
    assert cp["world"] == 2
    assert set(cp["max_abs_error"]) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
    assert max(cp["max_abs_error"].values()) < 1e-4
    assert all(cp[k]["single_ms"] > 0 and cp[k]["parallel_ms"] > 0 for k in ("forward", "forward_backward"))


def test_moonep_matches_one_device_and_balances_the_skewed_load(report):
    ep = report[0]["ep"]
    for planner in ("home", "moonep"):
        assert max(ep[planner]["max_abs_error"].values()) < 1e-4
    assert ep["moonep"]["max_over_mean"] == pytest.approx(1.0, abs=0.01)
    assert ep["home"]["max_over_mean"] > 1.1  # the hot expert's home rank carries more without replicas
    assert sum(ep["moonep"]["entries_per_rank"]) == sum(ep["home"]["entries_per_rank"])


def test_handoff_paths_serve_the_same_tokens(report):
    ho = report[0]["handoff"]
    assert ho["tokens_equal"] and len(ho["tokens"]) == 4
    assert ho["state_bytes"] > 0
    assert ho["dist"]["latency_ms"] > 0 and ho["grpc"]["latency_ms"] > 0
