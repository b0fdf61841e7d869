"""k3: train, RL-post-train and serve Kimi K3 architecture models as gRPC services."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("k3")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+local"
