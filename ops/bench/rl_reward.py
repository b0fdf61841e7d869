"""End-to-end RL demonstration: held-out verifier reward of a tiny model before and after an RL job.

Steps (fixed seeds; CPU):

1. a starting policy: ``k3 train --preset tiny`` (60 steps) then ``k3 sft`` on reasoning-gym conversations,
   stopped at step 42 of a 150-step schedule (skipped with ``--base DIR``);
2. an RL job submitted over gRPC to ``k3 serve trainer`` (started here on a free port, with its own local Ray):
   rollout-worker and learner actors joined by the trainer's event log (the embedded one, or Kafka with
   ``--kafka host:port``), GRPO + decoupled PPO + Per-Head Muon on ``reasoning_gym/letter_counting`` at low
   effort with partial rollout, followed through the Jobs API's Watch stream;
3. the mean greedy verifier score on held-out problems (never trained on, neither in SFT nor in RL) at every
   evaluation (the job's ``eval_reward`` metric), written to ``--work``/rl_reward-seedN.json and plotted to
   ``--plot``.

    python ops/bench/rl_reward.py --work runs/rl-demo --kafka 127.0.0.1:19092 --seed 0 --plot /tmp/seed0.png
    python ops/bench/rl_reward.py --combine runs/rl-demo/rl_reward-seed*.json --plot docs/rl_reward.png

Rollouts are timing-dependent (which weight version a round samples under depends on when the learner
publishes), so runs with one seed differ; compare several seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _k3(*args: str) -> None:
    cmd = [sys.executable, "-m", "k3", *args]
    print("+", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)


def base_policy(work: Path) -> Path:
    pre, sft = work / "pretrain", work / "sft"
    if not (pre / "latest").is_file():
        _k3("train", "--preset", "tiny", "--steps", "60", "--out", str(pre), "--threads", "1", "--no-progress")
    if not (sft / "latest").is_file():
        _k3("sft", "--checkpoint", str(pre), "--out", str(sft), "--steps", "150", "--stop-at", "42",
            "--mix", "reasoning=1", "--batch-tokens", "2048", "--threads", "1", "--no-progress")
    return sft


def plot(series: dict[str, list[list[float]]], path: Path, title: str) -> None:
    """One line per run (label -> [[update, held-out reward], ...])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    for label, evals in series.items():
        ax.plot([e[0] for e in evals], [e[1] for e in evals], marker="o", label=label)
    ax.set_xlabel("learner update (weight version)")
    ax.set_ylabel("held-out mean verifier reward")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def combine(paths: list[str], out: Path) -> int:
    """Plot several runs' summaries (``rl_reward-seedN.json``) together and print their mean first/last."""
    runs = {p: json.loads(Path(p).read_text()) for p in paths}
    series = {f"seed {r['spec']['seed']}": r["evals"] for r in runs.values()}
    first = sum(r["first_eval"][1] for r in runs.values()) / len(runs)
    last = sum(r["last_eval"][1] for r in runs.values()) / len(runs)
    env = next(iter(runs.values()))["spec"]["environments"][0]
    plot(series, out, f"{env}, tiny, {len(runs)} seeds: mean {first:.3f} -> {last:.3f}")
    print(json.dumps({"runs": len(runs), "mean_first_eval": first, "mean_last_eval": last}))
    return 0


def serve_trainer(work: Path, kafka: str | None) -> tuple[subprocess.Popen, str]:
    """``k3 serve trainer`` on a free loopback port (its own local Ray); returns the process and its address."""
    config: dict = {"trainer": {"jobs_dir": str((work / "jobs").resolve())},
                    "server": {"metrics": False, "tracing": False}}
    if kafka:
        config["kafka_bootstrap"] = kafka
    path = work / "trainer.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "k3", "serve", "trainer", "--config", str(path), "--port", "0"]
    print("+", " ".join(cmd[2:]), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"the trainer did not start: {line!r}")
    return proc, line.rsplit(" ", 1)[1].strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="runs/rl-demo", help="working folder (base policy, the trainer's jobs)")
    p.add_argument("--base", help="starting checkpoint (skips pretraining + SFT)")
    p.add_argument("--steps", type=int, default=16, help="learner updates (default 16)")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--eval-size", type=int, default=48)
    p.add_argument("--eval-interval", type=int, default=4)
    p.add_argument("--environment", default="reasoning_gym/letter_counting")
    p.add_argument("--kafka", metavar="HOST:PORT", help="Kafka bootstrap for the job's topics (default: the "
                   "trainer's embedded event log)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="docs/rl_reward.png")
    p.add_argument("--combine", nargs="+", metavar="JSON", help="only plot these runs' summaries together")
    args = p.parse_args(argv)
    if args.combine:
        return combine(args.combine, Path(args.plot))
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from k3.protos.v1 import jobs_pb2, jobs_pb2_grpc
    from k3.services.common.client import make_channel

    work = Path(args.work)
    base = Path(args.base) if args.base else base_policy(work)
    spec = {"environments": [args.environment], "steps": args.steps, "prompts_per_step": args.prompts_per_step,
            "group_size": args.group_size, "lr": args.lr, "eval_size": args.eval_size,
            "eval_interval": args.eval_interval, "seed": args.seed, "max_staleness": 1,
            "partial_rollout_threshold": 0.75, "temperature": 1.0}
    proc, address = serve_trainer(work, args.kafka)
    started = time.monotonic()
    try:
        stub = jobs_pb2_grpc.JobsStub(make_channel(address))
        job = stub.Submit(jobs_pb2.JobSpec(kind="rl", name=f"rl-reward-seed{args.seed}",
                                           checkpoint=str(base.resolve()), spec_json=json.dumps(spec)))
        print(f"submitted {job.id} to {address}", flush=True)
        evals: list[list[float]] = []
        last = None
        for event in stub.Watch(jobs_pb2.WatchRequest(id=job.id)):
            last = event
            shown = {k: round(v, 4) for k, v in event.metrics.items()
                     if k in ("reward", "eval_reward", "staleness_max", "loss", "step_s")}
            print(json.dumps({"step": event.step, "state": event.state, **shown,
                              **({"message": event.message} if event.message else {}),
                              **({"checkpoint": event.checkpoint} if event.checkpoint else {})}), flush=True)
            if "eval_reward" in event.metrics:
                evals.append([event.step, event.metrics["eval_reward"]])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    if last is None or last.state != "SUCCEEDED" or len(evals) < 2:
        raise SystemExit(f"the job did not finish with two evaluations: {last}")
    summary = {"job": job.id, "first_eval": evals[0], "last_eval": evals[-1], "evals": evals,
               "wall_s": time.monotonic() - started, "spec": spec, "checkpoint": str(base),
               "bus": f"kafka://{args.kafka}" if args.kafka else "embedded"}
    (work / f"rl_reward-seed{args.seed}.json").write_text(json.dumps(summary, indent=1))
    plot({f"seed {args.seed}": evals}, Path(args.plot), f"{args.environment}, tiny, seed {args.seed}: "
         f"{evals[0][1]:.3f} -> {evals[-1][1]:.3f}")
    print(json.dumps({"first_eval": evals[0], "last_eval": evals[-1], "wall_s": round(summary["wall_s"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
