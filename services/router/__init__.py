"""The router: k3's public inference API (``k3.v1.Inference``) in front of the prefill and decode workers.

Modules, one idea each:

- ``config``     the ``k3 serve router`` configuration (upstream addresses, model, budgets, prices, limits).
- ``validation`` checks of every request field at the edge (INVALID_ARGUMENT naming the field).
- ``chat``       ChatRequest -> XTML prompt ids, and model output -> think/response/tool-call deltas.
- ``admission``  separate concurrency and queued-token budgets for long and short prompts.
- ``routing``    prefix-affinity choice of the prefill worker, least-load choice of the decode worker.
- ``usage``      per-request token usage and cost at the configured prices, and their running totals.
- ``pipeline``   one request end to end: admit, route, prefill, decode stream, cancellation.
- ``service``    the gRPC servicer and the ``ServiceSpec`` registered as ``router``.
- ``trace``      Mooncake trace replay against a prefix-cache index (``k3 bench trace``).
- ``loadtest``   concurrent streaming load against a router (``k3 bench serve``).
"""
