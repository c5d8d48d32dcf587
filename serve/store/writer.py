"""Atomic writes: temp file in the target's directory, fsync, rename, fsync the directory.

A crash at any point leaves either the old file or the new one, never a partial file under the real name.
"""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from serve.errors import ArtifactError


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


@contextlib.contextmanager
def atomic_dir(out_dir: str | os.PathLike, replace: bool = False) -> Iterator[Path]:
    """Yield a fresh directory beside out_dir; on clean exit its files are fsynced and it is renamed to out_dir.

    A crash or an error leaves out_dir as it was, never half-written. Without replace, an out_dir that exists and
    is not empty is refused; with it, the old directory is moved aside first and removed once the new is in place.
    """
    out_dir = Path(out_dir)
    if not replace and out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ArtifactError(f"{out_dir}: already exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        yield stage
        for f in stage.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        old = None
        if replace and out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
        os.replace(stage, out_dir)  # rename(2) may replace an empty directory
        fsync_dir(out_dir.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
