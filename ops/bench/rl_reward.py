"""End-to-end RL demonstration: held-out verifier reward of a tiny model before and after an RL job.

Steps (fixed seeds; CPU):

1. a starting policy: ``k3 train --preset tiny`` (60 steps) then ``k3 sft`` on reasoning-gym conversations,
   stopped at step 42 of a 150-step schedule (skipped with ``--base DIR``);
2. ``run_rl_job``: rollout-worker and learner actors on a local Ray, joined by the embedded event log (or
   ``--bus kafka://host:port``), GRPO + decoupled PPO + Per-Head Muon on ``reasoning_gym/letter_counting`` at low
   effort with partial rollout;
3. the mean greedy verifier score on held-out problems (never trained on, neither in SFT nor in RL) at every
   evaluation, written to ``--out``/rl_reward.json and plotted to ``--plot``.

    python ops/bench/rl_reward.py --work runs/rl-demo --plot docs/rl_reward.png
"""

from __future__ import annotations

import argparse
import json
import os
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


def plot(evals: list[list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    ax.plot([e[0] for e in evals], [e[1] for e in evals], marker="o")
    ax.set_xlabel("learner update (weight version)")
    ax.set_ylabel("held-out mean verifier reward")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="runs/rl-demo", help="working folder (base policy, job dir)")
    p.add_argument("--base", help="starting checkpoint (skips pretraining + SFT)")
    p.add_argument("--steps", type=int, default=16, help="learner updates (default 16)")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.002)
    p.add_argument("--eval-size", type=int, default=48)
    p.add_argument("--eval-interval", type=int, default=4)
    p.add_argument("--environment", default="reasoning_gym/letter_counting")
    p.add_argument("--bus", help="bus URL (default: the embedded log in the job folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default="docs/rl_reward.png")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from k3.services.trainer.rl_job import RLJobConfig, run_rl_job

    work = Path(args.work)
    base = Path(args.base) if args.base else base_policy(work)
    job_dir = work / f"rl-seed{args.seed}"
    config = RLJobConfig.from_dict({
        "checkpoint": str(base), "environments": [args.environment], "steps": args.steps,
        "prompts_per_step": args.prompts_per_step, "group_size": args.group_size, "lr": args.lr,
        "eval_size": args.eval_size, "eval_interval": args.eval_interval, "seed": args.seed,
        "job_dir": str(job_dir.resolve()), "bus_url": args.bus, "max_staleness": 1,
        "partial_rollout_threshold": 0.75, "temperature": 1.0,
    })
    started = time.monotonic()

    def report(event: dict) -> None:
        if event["kind"] in ("train", "eval", "worker_restarted", "learner_restarted"):
            keep = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in event.items()
                    if k in ("kind", "step", "reward", "verifier_score", "eval_reward", "staleness_max", "loss",
                             "trajectories", "step_s", "error")}
            print(json.dumps(keep), flush=True)

    result = run_rl_job(config, report=report, cancelled=lambda: False)
    evals = result["eval_rewards"]
    summary = {"first_eval": evals[0], "last_eval": evals[-1], "evals": evals, "wall_s": time.monotonic() - started,
               "config": config.to_dict()}
    (job_dir / "rl_reward.json").write_text(json.dumps(summary, indent=1))
    plot(evals, Path(args.plot), f"{args.environment}, tiny, seed {args.seed}: "
         f"{evals[0][1]:.3f} -> {evals[-1][1]:.3f}")
    print(json.dumps({"first_eval": evals[0], "last_eval": evals[-1], "wall_s": round(summary["wall_s"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
