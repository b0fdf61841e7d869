"""The pool set file: which expert pools the prefill and decode workers use, changeable while they serve.

The file is JSON, ``{"pools": ["host:port", ...]}``. Workers name it in ``model.expert_pools_file``; their
``ExpertPoolClient`` reads it at start and then every ``watch_interval_s``, and applies a changed list with
``set_pools`` (new pools are probed and join, missing ones take no new work and are closed once their calls
return). ``k3 up --expert-pools N`` writes it for the pools it starts; ``k3 experts pools --file F --add A
--remove B`` edits it; in a cluster the same file can be a mounted ConfigMap.

Design decisions:

- A watched file rather than a control RPC on every worker: one edit reconfigures every worker of the
  machine (or, as a ConfigMap, of the cluster), the file is the record of the current set, and a worker that
  restarts reads the same set.
- Writers replace the file atomically (a temporary file in the same folder, then ``os.replace``), so a reader
  sees the old or the new list, never half of one. A file that cannot be read or parsed is reported and the
  current set is kept: a bad edit never empties the pool set.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path


class PoolSetError(ValueError):
    """The pool set file is missing, unreadable or malformed (the message says which and where)."""


def read_pool_set(path: str | os.PathLike) -> list[str]:
    """The pool addresses in ``path`` (duplicates removed, order kept); ``PoolSetError`` explains a bad file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PoolSetError(f"cannot read the pool set file {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PoolSetError(f"pool set file {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("pools"), list):
        raise PoolSetError(f'pool set file {path} must hold {{"pools": ["host:port", ...]}}')
    return check_addresses(data["pools"], str(path))


def check_addresses(addresses: Sequence[object], where: str = "pools") -> list[str]:
    """``addresses`` as a list of distinct non-blank strings; ``PoolSetError`` names the bad entry."""
    out: list[str] = []
    for i, address in enumerate(addresses):
        if not isinstance(address, str) or not address.strip() or any(c.isspace() for c in address):
            raise PoolSetError(f"{where}: entry [{i}] must be a host:port, got {address!r}")
        if address not in out:
            out.append(address)
    return out


def write_pool_set(path: str | os.PathLike, addresses: Sequence[str]) -> list[str]:
    """Replace the pool set in ``path`` atomically with ``addresses``; returns the list written."""
    path = Path(path)
    pools = check_addresses(addresses)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"pools": pools}, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return pools
