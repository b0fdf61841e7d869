"""Committed consumer-group offsets of the embedded log: one small JSON file per group.

Design decisions:
- The file is replaced atomically (write a temporary file in the same directory, fsync, rename, fsync the
  directory), so a crash leaves either the old or the new offsets, never a half-written file.
- A commit is a read-modify-write of the whole file under an exclusive ``flock`` on a companion lock
  file; consumers of the same group in other processes commit other topics without losing each other's
  offsets. The lock file, not the JSON file, carries the lock because the JSON file's inode changes with
  every rename.
- Group ids may contain any characters, so a group's directory is named by a hash of the id; the id
  itself is stored inside the offsets file for people reading the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path


class GroupOffsets:
    """The committed offsets of one consumer group: ``{topic: next offset to read}``.

    Files, in ``<groups directory>/<hash of the group id>/``: ``offsets.json`` (the offsets),
    ``commit.lock`` (serialises commits) and ``<topic>.owner`` (see ``member_path``).
    """

    def __init__(self, groups_directory: Path, group: str):
        self.group = group
        digest = hashlib.sha256(group.encode("utf-8")).hexdigest()[:32]
        self.directory = groups_directory / digest
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "offsets.json"
        self._lock_path = self.directory / "commit.lock"

    def member_path(self, topic: str) -> Path:
        """The file whose ``flock`` marks the group member that owns ``topic`` (see embedded.py)."""
        # A 249-character topic (Kafka's maximum) plus ".owner" still fits the usual 255-byte name limit.
        return self.directory / f"{topic}.owner"

    def load(self) -> dict[str, int]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"committed offsets file {self.path} is not valid JSON: {exc}") from exc
        offsets = data.get("offsets") if isinstance(data, dict) else None
        if not isinstance(offsets, dict) or not all(
            isinstance(t, str) and isinstance(o, int) and o >= 0 for t, o in offsets.items()
        ):
            raise ValueError(f"committed offsets file {self.path} has no valid 'offsets' mapping")
        return dict(offsets)

    def commit(self, offsets: dict[str, int]) -> None:
        """Merges ``offsets`` into the group's committed offsets (other topics are kept)."""
        if not offsets:
            return
        with self._locked():
            merged = self.load()
            merged.update(offsets)
            self._write({"group": self.group, "offsets": dict(sorted(merged.items()))})

    @contextlib.contextmanager
    def _locked(self):
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def _write(self, data: dict) -> None:
        directory = self.path.parent
        fd, tmp = tempfile.mkstemp(prefix=".offsets-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
