"""Registers, spills and matrix instructions of the chunked KDA kernels as Triton compiles them for an H100 / H200
(sm_90a), on a machine without a GPU.

Registers decide these kernels' speed (module notes of ``kernels/kda/chunk.py``): a kernel that runs out of its
255 registers spills to local memory and runs several times slower, and fewer registers per thread let more
programs share an SM. The script runs one forward + backward and one inference forward of ``chunk_kda`` on CPU
tensors with every kernel launch replaced by a compile for the target, then prints, per kernel, the warps, shared
memory, registers and spill bytes that ``ptxas -v`` reports and how many warp-group (``wgmma``) and warp-level
(``mma.sync``) matrix instructions the PTX holds. Nothing runs; screen a variant here, then time it on a GPU with
``kda_stages.py``.

The numbers are those of the installed Triton. To match a GPU machine, install its version beside the project
(``pip install --target DIR triton==X`` and ``PYTHONPATH=DIR``): with the H200 image's Triton 3.6.0 the register
counts equalled those ``ncu`` measured there (docs/BENCHMARKS.md, sixth pass).

    python ops/bench/kda_resources.py
    python ops/bench/kda_resources.py --config bwd_block_k=64,bwd_wy_k_num_warps=4 --only wy_k
    python ops/bench/kda_resources.py --source /tmp/chunk_variant.py --shape 1 64 16 64
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kda_stages import load_source, parse_config  # noqa: E402

ARCH = 90


@dataclass
class Resources:
    """What one compiled kernel uses per program."""

    kernel: str
    num_warps: int
    shared_bytes: int
    registers: int
    spill_stores: int
    spill_loads: int
    wgmma: int
    mma_sync: int

    def row(self) -> str:
        return (
            f"{self.kernel:20s} {self.num_warps:5d} {self.shared_bytes:9d} {self.registers:9d} "
            f"{self.spill_stores:6d}/{self.spill_loads:<6d} {self.wgmma:6d} {self.mma_sync:8d}"
        )


HEADER = f"{'kernel':20s} {'warps':>5s} {'shared B':>9s} {'registers':>9s} {'spill st/ld':>13s} {'wgmma':>6s} {'mma.sync':>8s}"


class _Sm90Target:
    """Triton's active driver, as far as compiling needs one: an sm_90 CUDA target, no device behind it."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", ARCH, 32)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def ptxas_report(ptx: str) -> tuple[int, int, int]:
    """``(registers, spill store bytes, spill load bytes)`` of one kernel's PTX, from the ptxas Triton ships."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [get_ptxas(ARCH).path, "-v", "--gpu-name", f"sm_{ARCH}a", str(src), "-o", str(Path(tmp) / "kernel.o")],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    text = proc.stdout + proc.stderr
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if proc.returncode != 0 or registers is None or spills is None:
        raise RuntimeError(f"ptxas could not assemble the kernel: {text.strip()[-500:]}")
    return int(registers.group(1)), int(spills.group(1)), int(spills.group(2))


class _CompileOnly:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` compiles for the target and records."""

    def __init__(self, name: str, fn, only: re.Pattern, sink: dict[str, Resources]):
        self.name, self.fn, self.only, self.sink = name, fn, only, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if not self.only.search(self.name):
                return
            compiled = self.fn.run(*args, grid=grid, warmup=True, **kwargs)
            ptx = compiled.asm["ptx"]
            registers, stores, loads = ptxas_report(ptx)
            short = self.name.strip("_").removesuffix("_kernel")
            self.sink[short] = Resources(
                short, compiled.metadata.num_warps, compiled.metadata.shared, registers, stores, loads,
                ptx.count("wgmma.mma_async"), ptx.count("mma.sync"),
            )  # fmt: skip

        return launch


def compile_report(module, cfg, shape: tuple[int, int, int, int], only: str = "") -> dict[str, dict[str, Resources]]:
    """``{"training": {...}, "inference": {...}}``: the resources of every kernel ``module.chunk_kda`` launches in a
    forward + backward and in an inference forward at ``shape`` (B, T, H, D) under ``cfg``; ``only`` (a regular
    expression) restricts the compiles to the kernels whose names match."""
    import torch
    from triton.runtime import driver

    pattern = re.compile(only)
    sink: dict[str, Resources] = {}
    kernels = {name: getattr(module, name) for name in dir(module) if name.endswith("_kernel")}
    B, T, H, D = shape
    gen = torch.Generator().manual_seed(0)

    def leaf(*size):
        return torch.randn(*size, generator=gen).to(torch.bfloat16).requires_grad_()

    q, k, v, g_raw, beta = leaf(B, T, H, D), leaf(B, T, H, D), leaf(B, T, H, D), leaf(B, T, H, D), leaf(B, T, H)
    A_log = torch.zeros(H, requires_grad=True)
    dt_bias = torch.zeros(H * D, requires_grad=True)
    report: dict[str, dict[str, Resources]] = {}
    # put back afterwards what was active (reset_active would look for a GPU driver, and fail without one)
    previous = getattr(driver, "_active", None)
    driver.set_active(_Sm90Target())
    try:
        for name, fn in kernels.items():
            setattr(module, name, _CompileOnly(name, fn, pattern, sink))
        module._COMPILE_ONLY = True
        o, _ = module.chunk_kda(q, k, v, g_raw, beta, A_log, dt_bias, config=cfg)
        o.backward(torch.ones_like(o))
        report["training"] = dict(sink)
        sink.clear()
        with torch.no_grad():
            module.chunk_kda(q, k, v, g_raw, beta, A_log, dt_bias, config=cfg)
        report["inference"] = dict(sink)
    finally:
        module._COMPILE_ONLY = False
        for name, fn in kernels.items():
            setattr(module, name, fn)
        driver.set_active(previous)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=4, default=[2, 128, 32, 128], metavar=("B", "T", "H", "D"),
                   help="the kernels specialise on H and D and the state kernels launch by B·H, while T only needs to cover "
                        "a chunk: the default 2 128 32 128 compiles the launches of 2·8192·32·128")
    p.add_argument("--config", default="", help="ChunkKDAConfig fields, e.g. bwd_block_k=64,bwd_wy_k_num_warps=4")
    p.add_argument("--source", metavar="FILE", help="an edited copy of kernels/kda/chunk.py instead of the installed one")
    p.add_argument("--only", default="", metavar="REGEX", help="compile only the kernels whose names match")
    args = p.parse_args(argv)
    if any(n <= 0 for n in args.shape):
        p.error(f"--shape needs four positive integers, got {args.shape}")
    try:
        re.compile(args.only)
    except re.error as exc:
        p.error(f"--only is not a regular expression: {exc}")
    try:
        if args.source:
            module = load_source(args.source)
        else:
            import k3.kernels.kda.chunk as module
        cfg = parse_config(args.config, module.ChunkKDAConfig)
    except ValueError as exc:
        p.error(str(exc))
    import triton

    try:
        report = compile_report(module, cfg, tuple(args.shape), args.only)
    except ValueError as exc:  # a copy of chunk.py older than the compile-only hook refuses CPU tensors
        p.error(f"chunk_kda refused the compile-only run: {exc}")
    if not any(report.values()):
        p.error(f"--only {args.only!r} matches none of the kernels chunk_kda launches")
    print(f"sm_{ARCH}a, Triton {triton.__version__}, shape B{args.shape[0]} T{args.shape[1]} H{args.shape[2]} "
          f"D{args.shape[3]}, {cfg}")
    for title, kernels in report.items():
        if kernels:
            print(f"\n{title}\n{HEADER}")
            for res in kernels.values():
                print(res.row())
    return 0


if __name__ == "__main__":
    sys.exit(main())
