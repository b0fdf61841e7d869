"""``ops/bench/mla_kernels.py`` off the GPU: it refuses to run, with its exit status and a reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "ops/bench/mla_kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the script for real")
def test_without_a_gpu_it_exits_2_and_says_why():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rows", "4x16"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr


def test_help_names_the_problem_arguments():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "--rows" in proc.stdout and "--length" in proc.stdout


@pytest.mark.parametrize("rows", ["4by16", "0x16", "4x"])
def test_malformed_rows_are_refused_with_the_expected_form(rows):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rows", rows], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "TqxH" in proc.stderr or "must be positive" in proc.stderr
    assert "Traceback" not in proc.stderr
