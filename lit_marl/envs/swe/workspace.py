"""One repository copy per rollout, in a folder of its own, and never left behind.

A workspace is ``<root>/ws-<random>`` beside an owner file ``ws-<random>.owner`` (the creating
process's pid and start time), written first. It is removed when its episode ends, when its
environment is garbage-collected or at interpreter exit (``weakref.finalize``), and, after a
SIGKILL, by the next process's ``sweep``: every workspace whose owner is no longer running goes
(a folder without an owner file once it is a minute old).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path

OWNER = ".owner"


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / "lit_marl_swe"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(owner_file: Path) -> bool:
    try:
        pid, started = owner_file.read_text().split()
    except (OSError, ValueError):
        return False
    return _start_time(int(pid)) == started


def sweep(root: Path, min_age_s: float = 60.0) -> int:
    """Remove the workspaces under ``root`` whose owner process is gone; how many were removed."""
    if not root.is_dir():
        return 0
    removed = 0
    now = time.time()
    for entry in root.iterdir():
        if not entry.name.startswith("ws-") or entry.name.endswith(OWNER):
            continue
        owner = root / (entry.name + OWNER)
        if owner.exists() and _alive(owner):
            continue
        if not owner.exists() and now - entry.stat().st_mtime < min_age_s:
            continue  # being created: its owner file comes first, but give the clock some slack
        shutil.rmtree(entry, ignore_errors=True)
        owner.unlink(missing_ok=True)
        removed += 1
    for owner in root.glob(f"ws-*{OWNER}"):  # owner files whose folder is gone
        if not (root / owner.name[: -len(OWNER)]).exists() and not _alive(owner):
            owner.unlink(missing_ok=True)
    return removed


def _remove(path: str, owner: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.unlink(owner)
    except FileNotFoundError:
        pass


class Workspace:
    """A folder holding one copy of a repository, writable by the sandboxed programs."""

    def __init__(self, root: Path, files: dict[str, tuple[bytes, int]]):
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o1777)
        self._claim(root)
        self.path.mkdir(mode=0o777)
        os.chmod(self.path, 0o777)  # the sandboxed programs run as another user
        for rel, (data, mode) in files.items():
            self.write(rel, data, mode)

    def _claim(self, root: Path) -> None:
        """A new name under ``root``, its owner file written first, and the clean-up registered."""
        name = "ws-" + os.urandom(6).hex()
        self.owner = root / (name + OWNER)
        self.owner.write_text(f"{os.getpid()} {_start_time(os.getpid())}")
        self.path = root / name
        self._finalizer = weakref.finalize(self, _remove, str(self.path), str(self.owner))

    def write(self, rel: str, data: bytes, mode: int = 0o644) -> None:
        target = self.path / rel
        for parent in reversed(target.relative_to(self.path).parents[:-1]):
            folder = self.path / parent
            if not folder.is_dir():
                folder.mkdir()
                os.chmod(folder, 0o777)
        target.write_bytes(data)
        os.chmod(target, 0o777 if mode & 0o111 else 0o666)

    def resolve(self, rel: str) -> Path:
        """``rel`` inside the workspace, links resolved; ValueError when it leads outside."""
        if not rel or "\0" in rel:
            raise ValueError("give a file path relative to the repository root")
        target = (self.path / rel).resolve()
        root = self.path.resolve()
        if target != root and root not in target.parents:
            raise ValueError(f"{rel!r} is outside the repository")
        return target

    def files(self) -> dict[str, bytes]:
        """The workspace's regular files (links and ``.git`` skipped): relative path -> bytes."""
        out = {}
        for folder, dirs, names in os.walk(self.path):
            dirs[:] = [d for d in dirs if d != ".git" and not os.path.islink(os.path.join(folder, d))]
            for name in names:
                full = os.path.join(folder, name)
                if os.path.isfile(full) and not os.path.islink(full):
                    with open(full, "rb") as handle:
                        out[os.path.relpath(full, self.path)] = handle.read()
        return out

    def size_bytes(self) -> int:
        total = 0
        for folder, _, names in os.walk(self.path):
            for name in names:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_size
                except OSError:
                    pass
        return total

    def copy(self) -> "Workspace":
        """An independent copy (for branching a tree mid-episode)."""
        twin = Workspace.__new__(Workspace)
        twin._claim(self.path.parent)
        shutil.copytree(self.path, twin.path, symlinks=True)
        return twin

    def remove(self) -> None:
        self._finalizer()

    @property
    def removed(self) -> bool:
        return not self._finalizer.alive
