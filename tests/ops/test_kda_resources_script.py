"""``ops/bench/kda_resources.py``: sm_90 compiles of the chunked KDA kernels on a machine without a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ops/bench/kda_resources.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, not interpreted
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)


def _table(stdout: str) -> dict[str, dict[str, list[int]]]:
    """``{"training": {kernel: [warps, shared, registers, spill stores, spill loads, wgmma, mma.sync]}, ...}``."""
    tables: dict[str, dict[str, list[int]]] = {}
    current = None
    for line in stdout.splitlines():
        if line in ("training", "inference"):
            current = tables.setdefault(line, {})
        elif current is not None and (m := re.match(r"(\w+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)/(\d+)\s+(\d+)\s+(\d+)$", line)):
            current[m.group(1)] = [int(x) for x in m.groups()[1:]]
    return tables


def test_each_pass_lists_the_kernels_it_launches_with_their_registers_and_products():
    # two WY-K tiles over K = 32: with one, WY-K forms dA_kk itself and the dA_kk kernel is not launched
    proc = _run("--only", "fwd_gate|bwd_dak", "--shape", "1", "64", "2", "32", "--config", "bwd_block_k=16")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("sm_90a, Triton ")
    tables = _table(proc.stdout)
    assert set(tables["training"]) == {"fwd_gate", "bwd_dak"}
    assert set(tables["inference"]) == {"fwd_gate"}  # no backward kernel without autograd
    warps, shared, registers, *_, wgmma, mma = tables["training"]["bwd_dak"]
    assert (warps, 0 < registers <= 255) == (4, True)
    assert wgmma > 0 and mma == 0  # dA_kk = -T^T (...): one [64, 64] product, a warp-group instruction on sm_90
    assert tables["training"]["fwd_gate"][5:] == [0, 0]  # the gate kernel has no matrix product


def test_the_dak_kernel_is_not_launched_when_one_wy_k_tile_covers_k():
    proc = _run("--only", "bwd_dak", "--shape", "1", "64", "2", "32")
    assert proc.returncode == 2
    assert "--only 'bwd_dak' matches none of the kernels chunk_kda launches" in proc.stderr


def test_a_launch_that_runs_out_of_registers_shows_its_spills():
    # The WY-K kernel's three [64, 128] fp32 accumulators: held on 8 warps, spilled by kilobytes on 4.
    spills = {}
    for warps in (4, 8):
        proc = _run("--only", "bwd_wy_k", "--shape", "1", "64", "2", "128", "--config", f"bwd_wy_k_num_warps={warps}")
        assert proc.returncode == 0, proc.stderr
        row = _table(proc.stdout)["training"]["bwd_wy_k"]
        assert row[0] == warps
        spills[warps] = row[3]
    assert spills[4] > 1000 and spills[4] > 4 * spills[8]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--only", "("], "--only is not a regular expression"),
        (["--only", "no_such_kernel"], "--only 'no_such_kernel' matches none of the kernels chunk_kda launches"),
        (["--config", "warps=8"], "bad config item 'warps=8'"),
        (["--source", "/nonexistent/chunk.py"], "bad source '/nonexistent/chunk.py'"),
        (["--shape", "1", "0", "2", "32"], "--shape needs four positive integers"),
    ],
)
def test_bad_arguments_are_refused_with_the_reason(args, message):
    proc = _run(*args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_a_copy_of_the_module_without_the_compile_only_hook_is_refused(tmp_path):
    source = (ROOT / "kernels/kda/chunk.py").read_text()
    old = source.replace("not (emu or _COMPILE_ONLY)", "not emu")
    assert old != source
    copy = tmp_path / "chunk_before_the_hook.py"
    copy.write_text(old)
    proc = _run("--source", str(copy), "--only", "bwd_dak")
    assert proc.returncode == 2
    assert "chunk_kda refused the compile-only run: chunk_kda needs CUDA tensors" in proc.stderr
