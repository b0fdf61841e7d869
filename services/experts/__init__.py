"""Expert pools (``k3 serve experts --shard i/n``): routed experts served over gRPC, with MoonEP placement.

``service`` (the pool), ``client`` (the LatentMoE hook used by prefill/decode), ``placement`` (shards,
MoonEP shares, row splits), ``weights`` (reading only the experts a pool hosts), ``stats`` (imbalance, the
load gauge and the cluster report of ``k3 experts stats``), ``pool_set`` (the pool set file workers follow).
Import the submodules directly.
"""
