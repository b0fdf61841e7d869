"""KDA context parallelism over gloo (2 and 4 ranks): outputs, final state and every gradient equal the
single-device chunked KDA on the whole sequence; bad inputs raise the same error on every rank, no hang.

Each world is started once (fork, rendezvous on a free TCP port of 127.0.0.1) and runs every case; results
come back as safetensors and JSON files and are compared here against single-process runs.
"""

from __future__ import annotations

import datetime
import json
import math
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from k3.kernels.kda.reference import kda_chunk, kda_gate, kda_recurrent
from k3.model.context_parallel import kda_context_parallel

CASES = {
    # name: batch, heads, K, V, segment lengths per world size, dtype, initial state, chunk size, gradients,
    # the rank whose loss includes the final state (None: no loss uses it)
    "init": dict(B=2, H=2, K=8, V=6, lens={2: [37, 70], 4: [37, 70, 0, 5]}, dtype="float64", init=True,
                 chunk=16, grads=True, final_rank=-1),
    "zero_init": dict(B=1, H=2, K=8, V=8, lens={2: [5, 67], 4: [20, 1, 90, 33]}, dtype="float64", init=False,
                      chunk=64, grads=True, final_rank=0),
    # training-like: no initial state and no use of the final state, so rank 0's outputs need no other rank
    "outputs_only": dict(B=1, H=1, K=8, V=4, lens={2: [30, 41], 4: [10, 0, 43, 14]}, dtype="float64",
                         init=False, chunk=16, grads=True, final_rank=None),
    "fp32": dict(B=2, H=1, K=16, V=8, lens={2: [50, 43], 4: [3, 60, 29, 10]}, dtype="float32", init=True,
                 chunk=64, grads=False, final_rank=None),
}


def _inputs(case: dict, world_size: int) -> dict[str, torch.Tensor]:
    """The whole sequence, its initial state and upstream gradients, identical in every process."""
    B, H, K, V = case["B"], case["H"], case["K"], case["V"]
    T = sum(case["lens"][world_size])
    gen = torch.Generator().manual_seed(7 * world_size + K)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    A_log = torch.empty(H, dtype=torch.float64).uniform_(0.0, math.log(16.0), generator=gen)
    x = {
        "q": F.normalize(randn(B, T, H, K), dim=-1),
        "k": F.normalize(randn(B, T, H, K), dim=-1),
        "v": randn(B, T, H, V),
        "g": kda_gate(randn(B, T, H, K), A_log, randn(H * K)),
        "beta": torch.rand(B, T, H, generator=gen, dtype=torch.float64),
        "h0": randn(B, H, K, V),
        "d_o": randn(B, T, H, V),
        "d_final": randn(B, H, K, V),
    }
    return {name: t.to(getattr(torch, case["dtype"])) for name, t in x.items()}


_NAMES = ("q", "k", "v", "g", "beta")


def _expect_error(fn) -> str:
    try:
        fn()
    except ValueError as error:
        return str(error)
    return "no error"


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        tensors: dict[str, torch.Tensor] = {}
        for name, case in CASES.items():
            x = _inputs(case, world_size)
            lens = case["lens"][world_size]
            mine = slice(sum(lens[:rank]), sum(lens[: rank + 1]))
            grads = case["grads"]
            local = {n: x[n][:, mine].clone().requires_grad_(grads) for n in _NAMES}
            h0 = x["h0"].clone().requires_grad_(grads) if case["init"] else None
            o, final = kda_context_parallel(*(local[n] for n in _NAMES), initial_state=h0,
                                            chunk_size=case["chunk"])
            tensors[f"{name}.o"], tensors[f"{name}.final"] = o.detach(), final.detach()
            if grads:
                loss = (o * x["d_o"][:, mine]).sum()
                if case["final_rank"] is not None and rank == case["final_rank"] % world_size:
                    loss = loss + (final * x["d_final"]).sum()
                loss.backward()
                for n in _NAMES:  # an empty segment's inputs are not in the graph: their gradient is None
                    grad = local[n].grad
                    tensors[f"{name}.grad.{n}"] = torch.zeros_like(local[n]) if grad is None else grad
                if h0 is not None:
                    tensors[f"{name}.grad.h0"] = h0.grad
            else:
                assert not o.requires_grad and not final.requires_grad

        # Bad inputs: each raises on every rank; a good call afterwards shows that no rank fell out of step.
        x = _inputs(CASES["init"], world_size)
        T = 6
        q, k, v, g, beta = (x[n][:, T * rank : T * (rank + 1)] for n in _NAMES)
        h0 = x["h0"]
        last = world_size - 1

        def other_heads():  # rank 1 holds one head fewer
            if rank == 1:
                kda_context_parallel(q[:, :, :1], k[:, :, :1], v[:, :, :1], g[:, :, :1], beta[:, :, :1])
            else:
                kda_context_parallel(q, k, v, g, beta)

        def other_key_dim():  # the last rank's keys are narrower
            if rank == last:
                kda_context_parallel(q[..., :4], k[..., :4], v, g[..., :4], beta)
            else:
                kda_context_parallel(q, k, v, g, beta)

        errors = {
            "heads": _expect_error(other_heads),
            "key_dim": _expect_error(other_key_dim),
            "local": _expect_error(
                lambda: kda_context_parallel(q, k, v, g, beta[:, :-1] if rank == 0 else beta)),
            "init_some": _expect_error(
                lambda: kda_context_parallel(q, k, v, g, beta, initial_state=h0 if rank == 0 else None)),
            "init_values": _expect_error(
                lambda: kda_context_parallel(q, k, v, g, beta, initial_state=h0 + (rank == last))),
            "dtype": _expect_error(
                lambda: kda_context_parallel(*((t.float() for t in (q, k, v, g, beta)) if rank == 1
                                               else (q, k, v, g, beta)))),
            "scale": _expect_error(
                lambda: kda_context_parallel(q, k, v, g, beta, scale=0.5 + 0.1 * (rank == 1))),
            "differentiable": _expect_error(
                lambda: kda_context_parallel(q.clone(), k.clone().requires_grad_(rank == 0), v, g, beta)),
        }
        o, _ = kda_context_parallel(q, k, v, g, beta, initial_state=h0)
        tensors["after_errors.o"] = o
        save_file({key: t.contiguous() for key, t in tensors.items()},
                  str(Path(out_dir, f"rank{rank}.safetensors")))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(errors))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


def _single_device(case: dict, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Single-process outputs, final state and gradients (fp64 arithmetic on the case's inputs)."""
    grads = case["grads"]
    leaves = {n: x[n].double().clone().requires_grad_(grads) for n in (*_NAMES, "h0")}
    h0 = leaves["h0"] if case["init"] else None
    o, final = kda_chunk(*(leaves[n] for n in _NAMES), initial_state=h0, output_final_state=True)
    o_rec, final_rec = kda_recurrent(*(x[n].double() for n in _NAMES), initial_state=None if h0 is None
                                     else h0.detach(), output_final_state=True)
    assert _rel(o, o_rec) <= 1e-10 and _rel(final, final_rec) <= 1e-10  # the chunked reference itself
    out = {"o": o.detach(), "final": final.detach()}
    if grads:
        loss = (o * x["d_o"].double()).sum()
        if case["final_rank"] is not None:
            loss = loss + (final * x["d_final"].double()).sum()
        loss.backward()
        out.update({f"grad.{n}": leaves[n].grad for n in _NAMES})
        if h0 is not None:
            out["grad.h0"] = h0.grad
    return out


def _check_world(world_size: int, tmp_path: Path) -> None:
    mp.start_processes(_worker, args=(world_size, _free_port(), str(tmp_path)), nprocs=world_size, join=True,
                       start_method="fork")
    tensors = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(world_size)]
    errors = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]

    for name, case in CASES.items():
        x = _inputs(case, world_size)
        expected = _single_device(case, x)
        tol = 1e-8 if case["dtype"] == "float64" else 1e-4
        lens = case["lens"][world_size]
        o = torch.cat([t[f"{name}.o"] for t in tensors], dim=1)
        assert o.dtype == getattr(torch, case["dtype"]) and o.shape == expected["o"].shape
        assert _rel(o, expected["o"]) <= tol, name
        for rank, t in enumerate(tensors):  # the final state on every rank
            assert _rel(t[f"{name}.final"], expected["final"]) <= tol, (name, rank)
        if not case["grads"]:
            assert not any(key.startswith(f"{name}.grad") for key in tensors[0])
            continue
        for n in _NAMES:
            grad = torch.cat([t[f"{name}.grad.{n}"] for t in tensors], dim=1)
            assert grad.shape[1] == sum(lens)
            assert _rel(grad, expected[f"grad.{n}"]) <= tol, (name, n)
        if case["init"]:
            for rank, t in enumerate(tensors):  # the replicated initial state: the full gradient everywhere
                assert _rel(t[f"{name}.grad.h0"], expected["grad.h0"]) <= tol, (name, rank)

    x = _inputs(CASES["init"], world_size)
    T = 6 * world_size
    o, _ = kda_chunk(*(x[n][:, :T] for n in _NAMES), initial_state=x["h0"])
    assert _rel(torch.cat([t["after_errors.o"] for t in tensors], dim=1), o) <= 1e-8

    last = world_size - 1
    only_rank0 = [1] + [0] * last
    expected_errors = {
        "heads": "kda_context_parallel: H must be the same on every rank, got "
                 f"{[2, 1] + [2] * (world_size - 2)} (by rank)",
        "key_dim": "kda_context_parallel: K must be the same on every rank, got "
                   f"{[8] * last + [4]} (by rank)",
        "local": "kda_context_parallel: rank 0: beta must be [B, T, H] = (2, 6, 2), got (2, 5, 2)",
        "init_some": "kda_context_parallel: has_initial_state must be the same on every rank, got "
                     f"{only_rank0} (by rank)",
        "init_values": "kda_context_parallel: initial_state must be identical on every rank; "
                       f"ranks [{last}] differ from rank 0",
        "dtype": "kda_context_parallel: dtype must be the same on every rank, got "
                 f"{['torch.float64', 'torch.float32'] + ['torch.float64'] * (world_size - 2)} (by rank)",
        "scale": "kda_context_parallel: scale must be the same on every rank, got "
                 f"{[0.5, 0.6] + [0.5] * (world_size - 2)} (by rank)",
        "differentiable": "kda_context_parallel: differentiable must be the same on every rank, got "
                          f"{only_rank0} (by rank)",
    }
    for rank, report in enumerate(errors):
        assert report == expected_errors, rank


@pytest.mark.timeout(300)
def test_two_gloo_ranks_match_single_device(tmp_path):
    _check_world(2, tmp_path)


@pytest.mark.timeout(300)
def test_four_gloo_ranks_match_single_device(tmp_path):
    _check_world(4, tmp_path)


def test_needs_a_process_group():
    assert not dist.is_initialized()
    q = torch.zeros(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        kda_context_parallel(q, q, q, q, torch.zeros(1, 4, 1))
