"""Expert-parallel LatentMoE over gloo: forward and every gradient equal the single-process layer (2 and 4
ranks, MoonEP and plain home placement), bad inputs raise the same error on every rank without hanging.

Each world is started once (fork, so the children inherit the imported modules) and runs several checks;
results come back as safetensors and JSON files and are compared here against one single-process run.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from k3.model.expert_parallel import ExpertParallelLatentMoE, all_to_all, expert_parallel_experts
from k3.model.moe import LatentMoE
from k3.model.presets import get_preset

TOKENS = 24  # per rank
HOT, HOT_BIAS, COLD_BIAS = 1, 0.6, -20.0


def _config(world_size: int):
    cfg = get_preset("tiny")  # 8 experts top-2, latent 64, one shared expert
    if world_size == 2:
        cfg = dataclasses.replace(cfg, num_experts=12, top_k=3)  # 6 experts per rank
    return cfg


def _setup(world_size: int) -> tuple[LatentMoE, torch.Tensor, torch.Tensor]:
    """The same layer, tokens and upstream gradient in every process. Expert HOT is popular (so MoonEP must
    replicate it) and the last rank's experts are never chosen (the home plan leaves that rank idle)."""
    cfg = _config(world_size)
    torch.manual_seed(1234)
    moe = LatentMoE(cfg, layer_idx=1)
    with torch.no_grad():
        moe.expert_bias[HOT] = HOT_BIAS
        moe.expert_bias[-cfg.num_experts // world_size:] = COLD_BIAS
    x = torch.randn(world_size * TOKENS, cfg.hidden_size)
    grad = torch.randn(world_size * TOKENS, cfg.hidden_size)
    return moe, x, grad


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for name, p in module.named_parameters()}


def _expect_error(fn) -> str:
    try:
        fn()
    except ValueError as error:
        return str(error)
    return "no error"


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        moe, x, grad = _setup(world_size)
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
        tensors: dict[str, torch.Tensor] = {}
        report: dict[str, object] = {}
        for planner in ("moonep", "home"):
            layer = ExpertParallelLatentMoE(moe, planner=planner)
            layer.zero_grad(set_to_none=True)
            xr = x[mine].clone().requires_grad_()
            y = layer(xr)
            (y * grad[mine]).sum().backward()
            layer.all_reduce_replicated_grads()
            plan = layer.last_plan
            tensors[f"{planner}.y"] = y.detach()
            tensors[f"{planner}.x_grad"] = xr.grad
            tensors[f"{planner}.tokens_per_expert"] = layer.tokens_per_expert.clone()
            tensors.update({f"{planner}.grad.{k}": v for k, v in _grads(layer).items()})
            report[planner] = {
                "cap": plan.cap.tolist(), "processed": int(plan.alloc[:, rank].sum()),
                "replicas": [list(r) for r in plan.replicas], "expert_range": list(layer.expert_range),
            }

        # Bad inputs, each raised on every rank, then a normal step to show that no rank is left behind.
        layer = ExpertParallelLatentMoE(moe)
        with torch.no_grad():
            weights, ids, _ = layer.route(x[mine])
            z = layer.w_down(x[mine])

            def bad_ids():
                wrong = ids.clone()
                if rank == 1:
                    wrong[5, 0] = moe.num_experts + 3
                expert_parallel_experts(z, wrong, weights, layer.w_in, layer.w_out, num_experts=moe.num_experts)

            def bad_shapes():
                layer(x[mine][: TOKENS - 2] if rank == 0 else x[mine])

            def bad_shard():
                w_in = layer.w_in[:-1] if rank == world_size - 1 else layer.w_in
                expert_parallel_experts(z, ids, weights, w_in, layer.w_out, num_experts=moe.num_experts)

            report["errors"] = {"ids": _expect_error(bad_ids), "shapes": _expect_error(bad_shapes),
                                "shard": _expect_error(bad_shard)}
            tensors["after_errors.y"] = layer(x[mine])
        small = dataclasses.replace(_config(world_size), num_experts=world_size * 2 + 1, top_k=2)
        report["errors"]["divisible"] = _expect_error(lambda: ExpertParallelLatentMoE(LatentMoE(small, 1)))

        # The differentiable all_to_all: rank r sends r + d + 1 rows to rank d; the gradient comes back.
        send = [rank + d + 1 for d in range(world_size)]
        recv = [r + rank + 1 for r in range(world_size)]
        rows = torch.arange(sum(send), dtype=torch.float32).unsqueeze(1).repeat(1, 2) + 100 * rank
        rows.requires_grad_()
        out = all_to_all(rows, send, recv)
        (out * (rank + 1)).sum().backward()
        tensors["a2a.out"], tensors["a2a.grad"] = out.detach(), rows.grad

        save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(out_dir, f"rank{rank}.safetensors")))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _run_world(world_size: int, tmp_path: Path) -> tuple[list[dict], list[dict]]:
    mp.start_processes(_worker, args=(world_size, str(tmp_path / "rendezvous"), str(tmp_path)),
                       nprocs=world_size, join=True, start_method="fork")
    tensors = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(world_size)]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]
    return tensors, reports


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    # fp32, summation order differs (per-expert groups, all-reduce): 1e-5 relative to the tensor's scale.
    scale = float(expected.abs().max()) or 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


def _check_world(world_size: int, tmp_path: Path) -> None:
    tensors, reports = _run_world(world_size, tmp_path)
    moe, x, grad = _setup(world_size)
    x = x.clone().requires_grad_()
    y = moe(x)
    (y * grad).sum().backward()
    expected = _grads(moe)
    epr = moe.num_experts // world_size
    cap = world_size * TOKENS * moe.top_k // world_size

    moonep = reports[0]["moonep"]
    assert moonep["cap"] == [cap] * world_size  # exactly S*K entries on every rank
    assert [r["moonep"]["processed"] for r in reports] == [cap] * world_size
    assert any(HOT in replicas for replicas in moonep["replicas"])  # the hot expert was replicated
    home = reports[0]["home"]
    assert home["cap"][-1] == 0 and max(home["cap"]) > cap  # home placement: one rank idle, one overloaded
    assert all(r == [] for r in home["replicas"])

    for planner in ("moonep", "home"):
        total_counts = sum(t[f"{planner}.tokens_per_expert"] for t in tensors)
        assert torch.equal(total_counts, moe.tokens_per_expert)
        for rank, t in enumerate(tensors):
            mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
            shard = slice(rank * epr, (rank + 1) * epr)
            assert reports[rank][planner]["expert_range"] == list(range(shard.start, shard.stop))
            _close(t[f"{planner}.y"], y.detach()[mine], f"{planner} rank {rank} output")
            _close(t[f"{planner}.x_grad"], x.grad[mine], f"{planner} rank {rank} input grad")
            _close(t[f"{planner}.grad.w_in"], expected["w_in"][shard], f"{planner} rank {rank} w_in grad")
            _close(t[f"{planner}.grad.w_out"], expected["w_out"][shard], f"{planner} rank {rank} w_out grad")
            replicated = [k for k in expected if k not in ("w_in", "w_out")]
            assert {"router.weight", "w_down.weight", "w_up.weight", "latent_norm.weight"} <= set(replicated)
            assert any(k.startswith("shared_experts.") for k in replicated)
            for name in replicated:
                _close(t[f"{planner}.grad.{name}"], expected[name], f"{planner} rank {rank} {name} grad")
        # A real check: the gradients are not all zero.
        assert float(expected["w_in"].abs().sum()) > 0 and float(expected["router.weight"].abs().sum()) > 0

    for rank, (t, report) in enumerate(zip(tensors, reports, strict=True)):
        errors = report["errors"]
        assert errors["ids"] == f"expert ids must be in [0, {moe.num_experts}): rank 1 routes to expert " \
                                f"{moe.num_experts + 3}"
        assert errors["shapes"] == (
            f"expert-parallel inputs must agree on every rank, but tokens differs (rank 0: {TOKENS - 2}, "
            + ", ".join(f"rank {r}: {TOKENS}" for r in range(1, world_size)) + ")"
        )
        assert errors["shard"].startswith(f"rank {world_size - 1}: expert shards must be w_in [experts_per_rank")
        assert errors["divisible"] == (
            f"LatentMoE.num_experts E={2 * world_size + 1} is not divisible by the expert-parallel world "
            f"size R={world_size}"
        )
        _close(t["after_errors.y"], y.detach()[rank * TOKENS:(rank + 1) * TOKENS], "output after the errors")
        # all_to_all: rank d's block from rank r holds rows [Σ_{d'<d} (r+d'+1), ...) + 100 r of r's input;
        # the gradient of rank r's rows sent to d is d + 1.
        blocks = [torch.arange(sum(r + e + 1 for e in range(rank)), sum(r + e + 1 for e in range(rank + 1)))
                  + 100.0 * r for r in range(world_size)]
        assert torch.equal(t["a2a.out"][:, 0], torch.cat(blocks))
        expected_grad = torch.cat([torch.full((rank + d + 1,), d + 1.0) for d in range(world_size)])
        assert torch.equal(t["a2a.grad"][:, 1], expected_grad)


@pytest.mark.timeout(300)
def test_two_gloo_ranks_match_single_process(tmp_path):
    _check_world(2, tmp_path)


@pytest.mark.timeout(300)
def test_four_gloo_ranks_match_single_process(tmp_path):
    _check_world(4, tmp_path)


def test_needs_a_process_group():
    assert not dist.is_initialized()
    moe = LatentMoE(get_preset("tiny"), 1)
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        ExpertParallelLatentMoE(moe)
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        expert_parallel_experts(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 2),
                                moe.w_in, moe.w_out, num_experts=8)
    with pytest.raises(ValueError, match=r"planner must be one of \['home', 'moonep'\], got 'eplb'"):
        ExpertParallelLatentMoE(moe, planner="eplb")
