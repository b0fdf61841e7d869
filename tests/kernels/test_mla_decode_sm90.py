"""The sm90 (Gluon) split kernel of the absorbed MLA decode.

Gluon kernels have no CPU interpreter, so on a machine without a Hopper GPU the kernel is compiled for sm_90a
and its resources and warp layouts are checked; on a Hopper GPU it is run against the torch reference and
the portable Triton kernel (``TRITON_INTERPRET=0 python -m pytest tests/kernels/test_mla_decode_sm90.py``).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from utils import assert_close, fresh_generator, poisoned_empty

from k3.kernels.mla.decode import MLAConfig, mla_decode_attention, split_kernel
from k3.kernels.mla.reference import mla_decode_attention_reference

ROOT = Path(__file__).resolve().parents[2]

_COMPILE = """
import re, sys
sys.path.insert(0, "ops/bench")
import torch
from kda_resources import _Sm90Target, ptxas_report
from triton.runtime import driver
from k3.kernels.mla import decode_sm90 as g

driver.set_active(_Sm90Target())
B, Tq, H, R, E, page = 2, 4, 16, 512, 64, 64
ql, qe = torch.randn(B, Tq, H, R).bfloat16(), torch.randn(B, Tq, H, E).bfloat16()
kv = torch.randn(64, page, R + E).bfloat16()
table, lens = torch.arange(64, dtype=torch.int32).view(B, 32), torch.full((B,), 2000, dtype=torch.int32)
c_desc, e_desc = g.sm90_descriptors(kv, R, E)
partial, lse = torch.empty(B, 4, Tq * H, R), torch.empty(B, 4, Tq * H)
args = (ql, qe, kv, c_desc, e_desc, table, lens, partial, lse, *ql.stride()[:3], *qe.stride()[:3], *kv.stride()[:2],
        table.stride(0), *partial.stride()[:3], *lse.stride()[:2], H, Tq, 512, 0.1)
c = g.mla_split_kernel_sm90.warmup(*args, grid=(1, 4, B), **g.sm90_constexprs(R, E, page))
regs = ptxas_report(c.asm["ptx"])[0]
layouts = sorted(set(re.findall(r"warpsPerCTA = \\[(\\d+), (\\d+)\\], instrShape = \\[(\\d+), (\\d+), (\\d+)\\]",
                                c.asm["ttgir"])))
print("RESULT", c.metadata.num_warps, c.metadata.shared, regs, c.asm["ptx"].count("wgmma.mma_async"), layouts)
"""


def test_compiles_for_hopper_with_split_scores_and_one_program_per_sm():
    """The scores are on a [4, 2] warp grid with 32-key instructions (each warpgroup its own keys, nothing
    computed twice) and the output on [4, 2] with 128-wide ones; everything fits one SM's shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    warps, shared, regs, wgmma, layouts = line.split(" ", 5)[1:]
    assert int(warps) == 8 and int(wgmma) > 0 and 0 < int(regs) <= 255
    assert 2 * 64 * 576 * 2 < int(shared) <= 232448  # two key slots of 64 x 576 bf16, within the sm90 limit
    assert ast.literal_eval(layouts) == [("4", "2", "16", "128", "16"), ("4", "2", "16", "32", "16")]


def test_config_is_validated_and_refused_off_hopper():
    with pytest.raises(ValueError, match="MLAConfig.sm90 must be"):
        MLAConfig(sm90=1)
    gen = fresh_generator()
    ql, qe = torch.randn(1, 4, 16, 32, generator=gen), torch.randn(1, 4, 16, 16, generator=gen)
    kv = torch.randn(2, 64, 48, generator=gen)
    table, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([100])
    with pytest.raises(ValueError, match=r"sm90=True\) needs"):
        mla_decode_attention(ql, qe, kv, table, lens, config=MLAConfig(sm90=True))
    assert split_kernel(ql, kv) == "portable"


def _hopper() -> bool:
    compiled = os.environ.get("TRITON_INTERPRET", "0") == "0"  # utils sets 1 unless the caller chose
    return compiled and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU and TRITON_INTERPRET=0")
@pytest.mark.parametrize("Tq,heads,lengths,R,out_dtype", [
    (4, 16, (4, 63, 64, 1000, 4097), 512, torch.bfloat16), (1, 64, (1, 65, 700, 3000, 128), 512, torch.float32),
    (3, 16, (3, 200, 64, 1333, 9), 512, torch.bfloat16), (2, 24, (2, 90, 2048, 777, 300), 256, torch.float32),
    (1, 96, (1, 64, 999, 2500, 65), 512, torch.float32), (4, 24, (4, 130, 1024, 3001, 7), 512, torch.bfloat16),
])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_matches_the_reference_on_hopper(Tq, heads, lengths, R, out_dtype, num_splits):
    """Ragged lengths put slices before, across and past each sequence's end and the draft tokens at every
    offset of a tile; cache rows past each end are NaN, so a tail tile that read them would show. Latent widths
    512 (the released model) and 256 (``bench-1b``); bf16 and fp32 outputs (``mla_decode`` asks for fp32); 96
    query rows (the released model's heads, or Tq = 4 x 24) take two row blocks, the second one half padding."""
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, ()).item()))
    dev, E, page = torch.device("cuda"), 64, 64
    B = len(lengths)
    max_pages = -(-max(lengths) // page)
    kv = torch.randn(B * max_pages + 3, page, R + E, device=dev, generator=gen).bfloat16()
    table = torch.randperm(B * max_pages + 3, device=dev, generator=gen)[:B * max_pages].view(B, max_pages).int()
    for b, n in enumerate(lengths):
        if n % page:
            kv[table[b, n // page], n % page:] = float("nan")
    lens = torch.tensor(lengths, device=dev)
    ql = torch.randn(B, Tq, heads, R, device=dev, generator=gen).bfloat16()
    qe = torch.randn(B, Tq, heads, E, device=dev, generator=gen).bfloat16()
    ref = mla_decode_attention_reference(ql.float(), qe.float(), kv.float(), table, lens)
    out = poisoned_empty(B, Tq, heads, R, dtype=out_dtype, device=dev)
    assert split_kernel(ql, kv) == "sm90"
    ours = mla_decode_attention(ql, qe, kv, table, lens, out=out, config=MLAConfig(sm90=True, num_splits=num_splits))
    assert_close(ours, ref, torch.bfloat16)
    portable = mla_decode_attention(ql, qe, kv, table, lens, config=MLAConfig(sm90=False, num_splits=num_splits))
    assert_close(ours, portable.float(), torch.bfloat16, "against the portable kernel")
