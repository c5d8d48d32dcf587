"""A node's copies of a store's objects (MANYFOLD_CACHE_DIR): each fetched once per node, checked once, evicted
least recently used by bytes.

    <root>/objects/<sha256>          an object's bytes, verified against its digest on the way in
    <root>/entries/<name>/...        an entry's files as hard links to its objects, made once per name
    <root>/locks/...                 one lock file per object and per entry

Replicas on one node share the directory: the first to need an object downloads it under that object's lock and
the others wait for it, then read the file; a replica starting where the cache holds its base reads nothing from
the store and hashes nothing (the digest was checked when the object came in). An entry's name must change with
its content (the store names it by its revision), so a directory, once complete, is never rewritten. Eviction
takes the least recently used entry directories first, then objects no entry links; a process that has a file
open (or mapped) keeps reading it after its links are gone.
"""

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from serve.store.manifest import FileEntry
from serve.store.objects import Objects
from serve.store.progress import Progress

COMPLETE = ".complete"


@dataclass
class CacheStats:
    hits: int = 0
    """Objects found on the node (an entry's directory found complete, the first time a process asks for it: each
    of its files)."""
    fetches: int = 0
    """Objects downloaded from the store."""


class NodeCache:
    def __init__(self, root: str | Path, budget_bytes: int):
        self.root = Path(root)
        self.budget = budget_bytes
        for sub in ("objects", "entries", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.stats = CacheStats()
        self._seen: set[str] = set()
        """Entries this process has found complete (their hits counted once)."""

    def object(self, objects: Objects, sha256: str, size: int, progress: Progress | None = None) -> Path:
        """The object's file on this node, downloaded and checked if it was not here (progress: its bytes as they
        come, or all at once when it was here)."""
        path = self.root / "objects" / sha256
        if self._touch(path):
            return self._hit(path, size, progress)
        with self._lock(f"object-{sha256}"):
            if self._touch(path):  # fetched by another replica while this one waited
                return self._hit(path, size, progress)
            self._make_room(size)
            objects.download(f"objects/{sha256}", path, sha256, progress)
            self.stats.fetches += 1
        return path

    def _hit(self, path: Path, size: int, progress: Progress | None) -> Path:
        self.stats.hits += 1
        if progress is not None:
            progress.found(size)
        return path

    def directory(self, objects: Objects, name: str, files: list[FileEntry], progress: Progress | None = None
                  ) -> Path:
        """A directory holding files[i] at files[i].path (relative), each a link to its cached object; progress
        (over the files' bytes) hears of each object as it comes, and nothing when the directory is here already."""
        if "/" in name or name.startswith("."):
            raise ValueError(f"cache entry name {name!r}: expected one path component")
        final = self.root / "entries" / name
        if self._touch(final / COMPLETE):
            return self._found(name, files, final)
        with self._lock(f"entry-{name}"):
            if self._touch(final / COMPLETE):
                return self._found(name, files, final)
            tmp = Path(tempfile.mkdtemp(dir=self.root / "entries", prefix=f".{name}."))
            try:
                self._seen.add(name)
                for f in files:
                    self._link(objects, f, tmp / f.path, progress)
                (tmp / COMPLETE).touch()
                shutil.rmtree(final, ignore_errors=True)  # an interrupted attempt's leftovers
                os.replace(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return final

    def _found(self, name: str, files: list[FileEntry], final: Path) -> Path:
        """An entry's directory found complete: its objects count as hits the first time this process asks."""
        if name not in self._seen:
            self._seen.add(name)
            self.stats.hits += len(files)
        return final

    def _link(self, objects: Objects, f: FileEntry, dest: Path, progress: Progress | None = None) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):  # the object may be evicted between its fetch and its link: fetch it again, once
            src = self.object(objects, f.sha256, f.bytes, progress)
            try:
                os.link(src, dest)
                return
            except FileNotFoundError:
                continue
            except OSError:  # no hard links here (another filesystem): a copy
                shutil.copyfile(src, dest)
                return
        raise FileNotFoundError(f"{self.root}: object {f.sha256[:12]}… was evicted twice while linking {f.path}")

    @property
    def used_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.root / "objects").iterdir() if not p.name.startswith("."))

    def _make_room(self, size: int) -> None:
        """Evict until `size` more bytes fit: least recently used entry directories, then unlinked objects."""
        with self._lock("evict"):
            used = self.used_bytes
            if used + size <= self.budget:
                return
            entries = sorted((d for d in (self.root / "entries").iterdir()
                              if not d.name.startswith(".") and (d / COMPLETE).exists()),
                             key=lambda d: (d / COMPLETE).stat().st_mtime)
            for d in [None, *entries]:
                if d is not None:
                    shutil.rmtree(d, ignore_errors=True)
                free = sorted((p for p in (self.root / "objects").iterdir()
                               if not p.name.startswith(".") and p.stat().st_nlink == 1),
                              key=lambda p: p.stat().st_mtime)
                for p in free:
                    if used + size <= self.budget:
                        return
                    used -= p.stat().st_size
                    p.unlink()
                if used + size <= self.budget:
                    return

    @staticmethod
    def _touch(path: Path) -> bool:
        """Mark path used now; False when it is not there."""
        try:
            os.utime(path)
            return True
        except FileNotFoundError:
            return False

    @contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        fd = os.open(self.root / "locks" / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
