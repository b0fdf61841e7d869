"""RL rollout: environments and verifiers, the partial-rollout worker, its Ray actor and ``k3 serve rollout``.

- ``environment``: the interface (problem -> episode -> verifier score) and the registry of environments;
- ``reasoning``: reasoning-gym tasks scored by reasoning-gym's own scorers (offline);
- ``tools``: a multi-turn tool-use environment over the SFT tool dialogues;
- ``genrm``: a generative reward model (a judge model writes a rubric and scores candidates) for tasks with no
  checker;
- ``codec``: the ``k3.v1.Trajectory`` / ``WeightVersion`` messages on the bus, validated on the way in;
- ``spool``: the on-disk record of every admitted trajectory (and of paused ones' sequence state), so a dead
  worker's trajectories are re-queued, not lost;
- ``worker``: generation with the shared engine, partial rollout, version tags, publishing;
- ``actor`` and ``service``: the worker as a Ray actor and as a gRPC service.
"""
