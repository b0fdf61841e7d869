"""What every k3 gRPC service stands on.

``config`` (typed config from file + environment), ``errors`` (exceptions -> rich gRPC statuses),
``interceptors`` (auth, error mapping, telemetry), ``telemetry`` (tracer/meter providers), ``server``
(start, health, reflection, graceful shutdown), ``client`` (channels, error details) and ``tensors``
(``torch.Tensor`` <-> ``k3.v1.Tensor``). Import the submodules directly; this package imports nothing.
"""
