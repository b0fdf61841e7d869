"""Partial rollout against waiting for the slowest trajectory: rollout round time with a few long trajectories.

A rollout worker (tiny random policy, CPU, its own engine and embedded bus) generates rounds of trajectories of
which a few are deliberately long: every ``--long-every``-th problem has a budget of ``--long`` tokens, the others
``--short`` (a random policy never stops early, so every trajectory runs exactly to its budget). Two modes run in
the same process, one after the other, from the same weights:

- ``wait``: ``partial_threshold = 1.0``; a round ends when its slowest trajectory is done;
- ``partial``: ``partial_threshold = --threshold``; once that share has finished, the rest are paused (their
  sequence state kept) and resumed in the next round.

Printed (JSON): per mode the mean and max round time, finished trajectories per second, and the pauses; and the
ratio of mean round times. Both modes publish the same kind of trajectories; only the scheduling differs.

    python ops/bench/partial_rollout.py --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--short", type=int, default=8, help="tokens of an ordinary trajectory")
    p.add_argument("--long", type=int, default=96, help="tokens of a deliberately long trajectory")
    p.add_argument("--long-every", type=int, default=4, help="every N-th problem is long")
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--groups", type=int, default=8, help="groups per learner batch (the gate's batch)")
    p.add_argument("--threshold", type=float, default=0.75)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import torch

    from k3.model.presets import get_preset
    from k3.model.rl.effort import EffortBudgets
    from k3.model.tokenizer import ByteTokenizer
    from k3.model.transformer import K3Model
    from k3.services.bus import open_bus
    from k3.services.engine.config import EngineConfig
    from k3.services.rollout.codec import WEIGHTS_TOPIC, encode_weights
    from k3.services.rollout.environment import Environment, Problem, Score, SingleTurn
    from k3.services.rollout.worker import RolloutWorker, WorkerConfig

    torch.set_num_threads(args.threads)
    exact = EffortBudgets(low=1, high=1, max=1, allowed_multiple=1.0, penalty=0.0)

    class LengthEnvironment(Environment):
        name, domain = "length", "bench"

        def _problem(self, index: int, split: str, effort: str) -> Problem:
            budget = args.long if index % args.long_every == args.long_every - 1 else args.short
            return Problem(self.name, split, index, effort, self.domain,
                           tuple(self.tokenizer.encode_text(f"problem {index}:")), budget)

        def episode(self, problem: Problem):
            return SingleTurn(lambda ids: Score(1.0, "any"))

    def run(threshold: float) -> dict:
        torch.manual_seed(0)
        model, tok = K3Model(get_preset("tiny")).eval(), ByteTokenizer()
        with tempfile.TemporaryDirectory() as tmp:
            bus = open_bus(f"embedded://{tmp}/bus")
            worker = RolloutWorker(
                WorkerConfig(job_id="bench", environments=("length",), group_size=args.group_size,
                             groups_per_step=args.groups, max_staleness=1, partial_threshold=threshold,
                             budgets=exact, temperature=1.0,
                             engine=EngineConfig(max_batch=64, max_slots=96, num_pages=2048, max_queue=256,
                                                 max_context=512)),
                model, tok, bus, f"{tmp}/rollout", environments={"length": LengthEnvironment(tok, exact)})
            from safetensors.torch import save_model

            weights = f"{tmp}/weights.safetensors"
            save_model(model, weights)
            times, finished, version = [], 0, 0
            try:
                for _ in range(args.rounds):
                    started = time.perf_counter()
                    published = worker.step()
                    times.append(time.perf_counter() - started)
                    finished += len(published)
                    # stand-in for the learner: one new version per round (same weights, really loaded by the
                    # worker) keeps the staleness gate open in both modes alike
                    version += 1
                    bus.publish(WEIGHTS_TOPIC, encode_weights("bench", version, weights, worker.published))
            finally:
                worker.close()
                bus.close()
        return {"threshold": threshold, "round_s_mean": statistics.mean(times), "round_s_max": max(times),
                "finished": finished, "trajectories_per_s": finished / sum(times),
                "paused_total": worker.stats["paused_total"]}

    wait = run(1.0)
    partial = run(args.threshold)
    print(json.dumps({"wait_for_slowest": wait, "partial_rollout": partial,
                      "round_time_ratio_wait_over_partial": wait["round_s_mean"] / partial["round_s_mean"],
                      "throughput_ratio_partial_over_wait": partial["trajectories_per_s"] / wait["trajectories_per_s"],
                      "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
