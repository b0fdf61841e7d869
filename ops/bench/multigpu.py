"""Multi-GPU checks and timings in one call: KDA context parallelism, MoonEP over NCCL, the dist hand-off.

    python ops/bench/multigpu.py                                   # every GPU of the machine, NCCL
    python ops/bench/multigpu.py --backend gloo --device cpu       # the same code on CPU at small shapes (CI)

Parts (``--parts``, default all), run in turn by one process per device (one ``torch.multiprocessing`` spawn,
one default process group of all of them):

- ``cp``: :func:`k3.model.context_parallel.kda_context_parallel` on N devices against the single-device chunked
  KDA (``kda_chunk``) on the whole sequence: forward outputs and the gradients of q, k, v, g, beta equal (max
  abs error), forward and forward+backward times and the single/N ratio.
- ``ep``: :class:`k3.model.expert_parallel.ExpertParallelLatentMoE` on min(N, 4) devices against the
  single-device ``LatentMoE`` on all tokens (outputs and input gradients), and its forward+backward step time
  with the MoonEP planner against plain expert parallelism (``home``: no replication) on skewed routing (one
  expert picked by ``--hot-fraction`` of the tokens); rank loads (entries per rank, max/mean).
- ``handoff``: a real decode service (``decode.handoff: dist``, gRPC on loopback) on device 1 and the prefill
  side's sender on device 0: the state of a prompt (4096 tokens of ``bench-1b`` in bf16 at full scale; computed
  by the model) handed over by the ``torch.distributed`` path (``k3.services.engine.handoff_dist``, its own pair
  group) and by the gRPC byte path (``engine.handoff`` chunks); latency until the state is parked, GB/s of state,
  and the greedy tokens served after each path are equal.

Design decisions: NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``,
``NVSHMEM_DISABLE_NVLS=1`` are set in ``os.environ`` before any child is spawned, so every child inherits them,
and each child records what it saw). Times are medians over ``--steps`` after warm-up, taken as the slowest
rank's wall time with the device synchronised. Results go to a table on stdout and to ``--json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Settings:
    """Everything a child needs (picklable: children are spawned)."""

    backend: str
    device: str
    """``cuda`` or ``cpu``."""
    steps: int
    cp_tokens: int
    cp_heads: int
    cp_dim: int
    ep_tokens: int
    ep_hidden: int
    hot_fraction: float
    preset: str
    prompt: int
    dtype: str


SCALES = {
    "small": dict(steps=2, cp_tokens=256, cp_heads=2, cp_dim=16, ep_tokens=64, ep_hidden=64, preset="tiny",
                  prompt=200, dtype="float32"),
    "full": dict(steps=10, cp_tokens=16384, cp_heads=8, cp_dim=128, ep_tokens=8192, ep_hidden=2048,
                 preset="bench-1b", prompt=4096, dtype="bfloat16"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(settings: Settings, rank: int) -> torch.device:
    if settings.device == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _init(settings: Settings, rank: int, world: int, port: int) -> torch.device:
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = _device(settings, rank)
    dist.init_process_group(settings.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    return device


def _largest(value: float, device: torch.device, group=None) -> float:
    """The largest ``value`` over the ranks of ``group`` (every rank of it calls this)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _max_error(a: torch.Tensor, b: torch.Tensor, device: torch.device, group=None) -> float:
    """Largest |a - b| over the ranks of ``group``."""
    return _largest((a.double() - b.double()).abs().max().item() if a.numel() else 0.0, device, group)


def _timed(fn, device: torch.device, steps: int, group=None) -> float:
    """Median seconds of ``fn()`` over ``steps`` after one warm-up, the slowest rank's each time."""
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(steps):
        dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(_largest(time.perf_counter() - start, device, group))
    return statistics.median(times)


def _environment() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in NO_MULTICAST}


# -- part cp: KDA context parallelism -------------------------------------------------------------------------------
def _cp_part(rank: int, world: int, settings: Settings, device: torch.device) -> dict:
    import torch.nn.functional as F

    from k3.kernels.kda.reference import kda_chunk, kda_gate
    from k3.model.context_parallel import kda_context_parallel

    T, H, D = settings.cp_tokens, settings.cp_heads, settings.cp_dim
    gen = torch.Generator().manual_seed(0)
    full = {
        "q": F.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1),
        "k": F.normalize(torch.randn(1, T, H, D, generator=gen), dim=-1),
        "v": torch.randn(1, T, H, D, generator=gen),
        "g": kda_gate(torch.randn(1, T, H, D, generator=gen), torch.rand(H, generator=gen) * 2,
                      torch.randn(H * D, generator=gen)),
        "beta": torch.rand(1, T, H, generator=gen),
    }
    d_o = torch.randn(1, T, H, D, generator=gen).to(device)
    full = {name: x.to(device) for name, x in full.items()}
    bounds = [T * r // world for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]

    def leaves(part: bool) -> dict[str, torch.Tensor]:
        return {n: (x[:, lo:hi] if part else x).detach().clone().requires_grad_() for n, x in full.items()}

    ref_in = leaves(False)
    o_ref, _ = kda_chunk(**ref_in)
    (o_ref * d_o).sum().backward()
    cp_in = leaves(True)
    o_cp, _ = kda_context_parallel(**cp_in)
    (o_cp * d_o[:, lo:hi]).sum().backward()
    errors = {"o": _max_error(o_cp, o_ref[:, lo:hi], device)}
    for name in full:
        errors[f"d{name}"] = _max_error(cp_in[name].grad, ref_in[name].grad[:, lo:hi], device)

    def run(fn, inputs, backward: bool, d):
        def step():
            x = {n: t.detach().requires_grad_(backward) for n, t in inputs.items()}
            with torch.set_grad_enabled(backward):
                o, _ = fn(**x)
                if backward:
                    (o * d).sum().backward()
        return step

    single_in = {n: x.detach() for n, x in full.items()}
    part_in = {n: x[:, lo:hi].detach().contiguous() for n, x in full.items()}
    result = {"world": world, "tokens": T, "heads": H, "dim": D, "max_abs_error": errors,
              "environment": _environment()}
    for name, backward in (("forward", False), ("forward_backward", True)):
        single = _timed(run(kda_chunk, single_in, backward, d_o), device, settings.steps)
        parallel = _timed(run(kda_context_parallel, part_in, backward, d_o[:, lo:hi]), device, settings.steps)
        result[name] = {"single_ms": 1e3 * single, "parallel_ms": 1e3 * parallel, "speedup": single / parallel}
    return result


# -- part ep: MoonEP over the process group -------------------------------------------------------------------------
def _ep_part(rank: int, world: int, settings: Settings, device: torch.device, group) -> dict:
    """``world`` ranks of ``group`` (the first ones) run the layer; the others do not call this."""
    from k3.model.expert_parallel import ExpertParallelLatentMoE
    from k3.model.moe import LatentMoE
    from k3.model.presets import get_preset

    hidden = settings.ep_hidden
    cfg = replace(get_preset("small"), hidden_size=hidden, latent_size=hidden // 2,
                  expert_intermediate_size=hidden, num_experts=4 * world, top_k=2, num_shared_experts=0)
    torch.manual_seed(0)
    moe = LatentMoE(cfg, layer_idx=1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(world, settings.ep_tokens, hidden, generator=gen)
    d_out = torch.randn(world, settings.ep_tokens, hidden, generator=gen).to(device)
    with torch.no_grad():  # bias expert 1 so that hot_fraction of the tokens pick it
        scores = torch.sigmoid(moe.router(x.reshape(-1, hidden)))
        others = torch.cat([scores[:, :1], scores[:, 2:]], dim=1)
        cutoff = others.topk(cfg.top_k, dim=-1).values[:, -1]
        moe.expert_bias[1] = torch.quantile(cutoff - scores[:, 1], settings.hot_fraction)
    moe = moe.to(device)
    x = x.to(device)

    x_all = x.reshape(-1, hidden).clone().requires_grad_()
    y_ref = moe(x_all)
    (y_ref * d_out.reshape(-1, hidden)).sum().backward()
    y_ref, g_ref = y_ref.reshape(x.shape)[rank].detach(), x_all.grad.reshape(x.shape)[rank]

    result = {"world": world, "tokens_per_rank": settings.ep_tokens, "hidden": hidden,
              "experts": cfg.num_experts, "top_k": cfg.top_k, "hot_fraction": settings.hot_fraction,
              "environment": _environment()}
    for planner in ("home", "moonep"):
        layer = ExpertParallelLatentMoE(moe, group=group, planner=planner)
        xr = x[rank].clone().requires_grad_()
        y = layer(xr)
        (y * d_out[rank]).sum().backward()
        errors = {"out": _max_error(y, y_ref, device, group), "dx": _max_error(xr.grad, g_ref, device, group)}

        def step(layer=layer):
            xs = x[rank].clone().requires_grad_()
            (layer(xs) * d_out[rank]).sum().backward()

        seconds = _timed(step, device, settings.steps, group)
        cap = layer.last_plan.cap.double()
        result[planner] = {"max_abs_error": errors, "step_ms": 1e3 * seconds,
                           "entries_per_rank": layer.last_plan.cap.tolist(),
                           "max_over_mean": float(cap.max() / cap.mean()),
                           "replicas_per_rank": [len(r) for r in layer.last_plan.replicas]}
    result["speedup_moonep_over_home"] = result["home"]["step_ms"] / result["moonep"]["step_ms"]
    return result


# -- part handoff: prefill -> decode over torch.distributed vs gRPC -------------------------------------------------
def _handoff_part(rank: int, settings: Settings, device: torch.device, tmp: str) -> dict | None:
    """Rank 1 serves decode (handoff: dist); rank 0 computes a prompt's state and hands it over both ways."""
    import grpc

    from k3.protos.v1 import engine_pb2, engine_pb2_grpc, inference_pb2
    from k3.services.common.config import ServerConfig
    from k3.services.common.server import start_server
    from k3.services.decode.config import DecodeServiceConfig, DecodeSettings
    from k3.services.decode.service import DecodeService
    from k3.services.engine.config import EngineConfig
    from k3.services.engine.handoff import handoff_chunks
    from k3.services.engine.handoff_dist import DistHandoffConfig, DistHandoffSender
    from k3.services.engine.model_source import ModelSourceConfig

    source = ModelSourceConfig(preset=settings.preset, seed=0, dtype=settings.dtype, device=str(device))
    model, _ = source.load()
    dist_config = DistHandoffConfig(backend=settings.backend, timeout_s=120)
    address_file, done_file = Path(tmp, "decode-address"), Path(tmp, "done")
    if rank == 1:
        context = settings.prompt + 16
        config = DecodeServiceConfig(
            server=ServerConfig(port=0, grace_seconds=0.5, max_workers=8), model=source,
            engine=EngineConfig(max_batch=1, max_slots=2, page_size=64, num_pages=2 * (-(-context // 64)),
                                max_context=context),
            decode=DecodeSettings(handoff="dist", dist=dist_config))
        handle = start_server(DecodeService(config, model=model), config.server)
        # written whole, then renamed: the other rank polls for the file and must never read it half-written
        partial = address_file.with_suffix(".tmp")
        partial.write_text(handle.address)
        partial.rename(address_file)
        while not done_file.exists():
            time.sleep(0.05)
        handle.stop(grace=0)
        return None

    while not address_file.exists():
        time.sleep(0.05)
    address = address_file.read_text()
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20),
                                                      ("grpc.max_receive_message_length", 64 << 20)])
    stub = engine_pb2_grpc.DecodeStub(channel)
    try:
        ids = torch.randint(8, min(model.cfg.vocab_size, 30000), (settings.prompt,),
                            generator=torch.Generator().manual_seed(3)).tolist()
        with torch.no_grad():
            logits, state = model.prefill(torch.tensor(ids, device=device))
        last = logits[-1]
        state_bytes = sum(t.numel() * t.element_size() for t in state.tensors().values())
        sender = DistHandoffSender(dist_config, device)

        def via_dist(request_id: str) -> None:
            sender.hand_off(address, channel, request_id, state, last, ids, 0, 120.0, lambda: False)

        def via_grpc(request_id: str) -> None:
            stub.Handoff(handoff_chunks(request_id, state.to_bytes(), last, ids, 0), timeout=120)

        def tokens(request_id: str) -> list[int]:
            stream = stub.Stream(engine_pb2.StreamRequest(
                request_id=request_id, sampling=inference_pb2.SamplingParams(temperature=0.0, max_tokens=4)))
            return [t for r in stream for t in r.token_ids]

        result = {"preset": settings.preset, "dtype": settings.dtype, "prompt_tokens": settings.prompt,
                  "state_bytes": state_bytes, "backend": settings.backend, "environment": _environment()}
        served = {}
        for name, path in (("dist", via_dist), ("grpc", via_grpc)):
            path(f"{name}-check")
            served[name] = tokens(f"{name}-check")
            times = []
            for i in range(settings.steps + 1):
                request_id = f"{name}-{i}"
                _sync(device)
                start = time.perf_counter()
                path(request_id)
                _sync(device)
                if i:  # the first is warm-up
                    times.append(time.perf_counter() - start)
                stub.CancelDecode(engine_pb2.CancelRequestById(request_id=request_id))  # frees the slot
            seconds = statistics.median(times)
            result[name] = {"latency_ms": 1e3 * seconds, "gb_per_s": state_bytes / seconds / 1e9}
        result["tokens_equal"] = served["dist"] == served["grpc"]
        result["tokens"] = served["dist"]
        result["speedup_dist_over_grpc"] = result["grpc"]["latency_ms"] / result["dist"]["latency_ms"]
        sender.close()
        return result
    finally:
        channel.close()
        done_file.write_text("done")


# -- driver ---------------------------------------------------------------------------------------------------------
def _worker(rank: int, settings: Settings, world: int, port: int, parts: list[str], tmp: str) -> None:
    """One process per device runs every part in turn (one spawn, one default group); rank 0 writes results."""
    import torch.distributed as dist

    device = _init(settings, rank, world, port)
    try:
        results: dict = {}
        for part in parts:
            start = time.perf_counter()
            if part == "cp":
                results[part] = _cp_part(rank, world, settings, device)
            elif part == "ep":
                ep_world = min(world, 4)
                group = dist.new_group(list(range(ep_world)))  # a collective of every rank
                if rank < ep_world:
                    results[part] = _ep_part(rank, ep_world, settings, device, group)
            elif rank < 2:
                results[part] = _handoff_part(rank, settings, device, os.path.join(tmp, part))
            dist.barrier()
            if rank == 0:
                results[part]["wall_s"] = time.perf_counter() - start
        if rank == 0:
            Path(tmp, "results.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run(settings: Settings, world: int, parts: list[str]) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        if "handoff" in parts:
            os.makedirs(os.path.join(tmp, "handoff"))
        mp.start_processes(_worker, args=(settings, world, _free_port(), parts, tmp), nprocs=world, join=True,
                           start_method="spawn")
        return json.loads(Path(tmp, "results.json").read_text())


def _table(report: dict) -> list[str]:
    rows = [f"{'part':<34} {'check':<30} {'single/ref':>12} {'parallel':>12} {'ratio':>7}"]
    cp = report.get("cp")
    if cp:
        err = max(cp["max_abs_error"].values())
        for name in ("forward", "forward_backward"):
            r = cp[name]
            label, check = f"cp {name} N={cp['world']}", f"max |err| {err:.2e}"
            rows.append(f"{label:<34} {check:<30} "
                        f"{r['single_ms']:>10.2f}ms {r['parallel_ms']:>10.2f}ms {r['speedup']:>6.2f}x")
    ep = report.get("ep")
    if ep:
        err = max(max(ep[p]["max_abs_error"].values()) for p in ("home", "moonep"))
        label, check = f"ep step N={ep['world']} (home vs moonep)", f"max |err| {err:.2e}"
        rows.append(f"{label:<34} {check:<30} "
                    f"{ep['home']['step_ms']:>10.2f}ms {ep['moonep']['step_ms']:>10.2f}ms "
                    f"{ep['speedup_moonep_over_home']:>6.2f}x")
        rows.append(f"{'ep rank loads max/mean':<34} {'entries per rank':<30} "
                    f"{ep['home']['max_over_mean']:>12.3f} {ep['moonep']['max_over_mean']:>12.3f}")
    ho = report.get("handoff")
    if ho:
        check = f"tokens equal: {ho['tokens_equal']}"
        label = f"handoff {ho['state_bytes'] / 1e6:.1f} MB (grpc vs dist)"
        rows.append(f"{label:<34} {check:<30} "
                    f"{ho['grpc']['latency_ms']:>10.2f}ms {ho['dist']['latency_ms']:>10.2f}ms "
                    f"{ho['speedup_dist_over_grpc']:>6.2f}x")
        rows.append(f"{'handoff GB/s (grpc vs dist)':<34} {'':<30} {ho['grpc']['gb_per_s']:>12.3f} "
                    f"{ho['dist']['gb_per_s']:>12.3f}")
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--gpus", type=int, default=0, help="devices for cp (0 = all GPUs; on CPU: 2 processes)")
    parser.add_argument("--parts", default="cp,ep,handoff", help="comma-separated subset of cp,ep,handoff")
    parser.add_argument("--scale", choices=tuple(SCALES), help="shapes (default: full on cuda, small on cpu)")
    parser.add_argument("--steps", type=int, help="timed steps per measurement (default by scale)")
    parser.add_argument("--hot-fraction", type=float, default=0.6, help="share of tokens picking the hot expert")
    parser.add_argument("--json", type=Path, default=Path("multigpu.json"), help="where to write the results")
    args = parser.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if not parts or any(p not in ("cp", "ep", "handoff") for p in parts):
        parser.error(f"--parts must name some of cp, ep, handoff, got {args.parts!r}")
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda")
    if not 0 < args.hot_fraction < 1:
        parser.error("--hot-fraction must lie in (0, 1)")
    os.environ.update(NO_MULTICAST)  # before any child exists: spawned children inherit the environment
    if args.device == "cuda":
        available = torch.cuda.device_count()
        world = args.gpus or available
        if available < 2 or not 2 <= world <= available:
            parser.error(f"needs 2 or more GPUs, {available} visible (--gpus {args.gpus})")
    else:
        world = args.gpus or 2
        if world < 2:
            parser.error("--gpus must be >= 2")
    scale = SCALES[args.scale or ("full" if args.device == "cuda" else "small")]
    settings = Settings(backend=args.backend, device=args.device, hot_fraction=args.hot_fraction,
                        **{**scale, **({"steps": args.steps} if args.steps else {})})
    report: dict = {
        "date": datetime.date.today().isoformat(), "host": platform.node(), "python": sys.version.split()[0],
        "torch": torch.__version__, "settings": asdict(settings), "world": world,
        "devices": ([torch.cuda.get_device_name(i) for i in range(world)] if args.device == "cuda" else ["cpu"]),
    }
    report.update(run(settings, world, parts))
    print("\n".join(_table(report)))
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
