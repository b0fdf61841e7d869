"""Expert pools (``k3 serve experts --shard i/n``): routed experts served over gRPC, with MoonEP placement.

``service`` (the pool), ``client`` (the LatentMoE hook used by prefill/decode), ``placement`` (shards,
MoonEP shares, row splits), ``weights`` (reading only the experts a pool hosts), ``stats`` (imbalance and
the cluster report of ``k3 experts stats``). Import the submodules directly.
"""
