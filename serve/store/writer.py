"""Atomic writes: temp file in the target's directory, fsync, rename, fsync the directory.

A crash at any point leaves either the old file or the new one, never a partial file under the real name.
"""

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path`; on clean exit it is fsynced and renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, parts: Iterable[bytes | memoryview]) -> int:
    """Write the parts in order as one file, atomically; returns the byte count."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for part in parts:
            f.write(part)
            n += len(part) if isinstance(part, bytes) else part.nbytes
    return n
