"""A Manyfold store: a directory of bases and variants under one manifest.

    root/manifest.json             StoreManifest
    root/bases/<name>/...          a HF model directory (config, tokenizer, safetensors)
    root/variants/<name>/...       a variant's files (for kind "full": config.json + delta.fmd)
    root/incoming/...              where an admin may put a variant's source to add it over HTTP
    root/audit/<YYYY-MM-DD>.jsonl  admin changes, one JSON line each (serve/http/audit.py)

Writers stage files in a temp directory, fsync them, rename the directory into place, then rewrite the
manifest atomically, all under an exclusive lock; a crash at any point leaves the previous state readable.
Reading the manifest needs no torch (the HTTP ingress resolves names with it); tensors are read where needed.
"""

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from serve.errors import ArtifactError, ManyfoldError
from serve.store.manifest import (MANIFEST, BaseEntry, FileEntry, StoreManifest, VariantEntry, read_manifest,
                                  write_manifest)
from serve.store.view import AUDIT, StoreView, audit_day, file_sha256, named_twice
from serve.store.writer import fsync_dir

_LOCK = ".lock"


class Store(StoreView):
    """A store in a local directory (the layout above)."""

    def __init__(self, root: str | Path, create: bool = False):
        self.root = Path(root)
        if create and not (self.root / MANIFEST).exists():
            self.root.mkdir(parents=True, exist_ok=True)
            with self._locked():
                if not (self.root / MANIFEST).exists():
                    write_manifest(self.root, StoreManifest())
        self.reload()

    def _stamp(self) -> tuple[int, int]:
        st = (self.root / MANIFEST).stat()
        return st.st_mtime_ns, st.st_size

    def reload(self) -> StoreManifest:
        # Stamp first: a change racing the read makes the next refresh() read again, never miss it.
        stamp = self._stamp() if (self.root / MANIFEST).exists() else None
        self.manifest = read_manifest(self.root)
        self._read_stamp = stamp
        return self.manifest

    def refresh(self) -> bool:
        """Re-read the manifest if another process changed it; -> whether it changed."""
        if self._stamp() == self._read_stamp:
            return False
        self.reload()
        return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def base_dir(self, name: str | BaseEntry) -> Path:
        return self.root / "bases" / (self.base(name) if isinstance(name, str) else name).name

    def variant_dir(self, name: str | VariantEntry) -> Path:
        return self.root / "variants" / self._entry(name).directory

    def verify(self, entry: BaseEntry | VariantEntry) -> None:
        """Check every file of an entry against its recorded size and sha256."""
        for f in entry.files:
            path = self.root / f.path
            if not path.is_file():
                raise ArtifactError(f"{path}: missing from the store")
            if path.stat().st_size != f.bytes:
                raise ArtifactError(f"{path}: {path.stat().st_size} bytes, manifest says {f.bytes}")
            digest = file_sha256(path)
            if digest != f.sha256:
                raise ArtifactError(f"{path}: sha256 mismatch (manifest {f.sha256[:12]}…, file {digest[:12]}…)")

    @contextlib.contextmanager
    def stage(self) -> Iterator[Path]:
        """A temp directory inside the store for a new entry's files; removed unless committed."""
        (self.root / "staging").mkdir(exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.root / "staging"))
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _place(self, staged: Path, section: str, name: str, sync_parent: bool = True) -> list[FileEntry]:
        """fsync the staged files, move the directory to section/name, and describe its files. Without
        sync_parent the caller fsyncs section/ itself before writing a manifest that names the move (once per
        batch, not once per entry)."""
        for p in staged.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(staged)
        dest = self.root / section / name
        dest.parent.mkdir(exist_ok=True)
        if dest.exists():  # left by an interrupted add that never reached the manifest
            shutil.rmtree(dest)
        os.replace(staged, dest)
        if sync_parent:
            fsync_dir(dest.parent)
        return [FileEntry(path=str(p.relative_to(self.root)), bytes=p.stat().st_size, sha256=file_sha256(p))
                for p in sorted(dest.rglob("*")) if p.is_file()]

    def commit(self, staged: Path, entry: BaseEntry | VariantEntry, replace: bool = False) -> BaseEntry | VariantEntry:
        """Move staged files into place and record the entry (with its files' digests) in the manifest.

        With replace, an entry of the same name, kind and base is replaced: the new entry's files must go to
        a directory of their own (EmrVariantEntry.bundle), the manifest swaps from the old entry to the new
        in one atomic write, and only then are the old files removed."""
        section = "bases" if entry.kind == "base" else "variants"
        with self._locked():
            self.reload()
            old = self._replaceable(self.manifest, entry, replace)
            directory = entry.name if entry.kind == "base" else entry.directory
            entry = entry.model_copy(update={"files": self._place(staged, section, directory)})
            entries = {**getattr(self.manifest, section), entry.name: entry}
            self.manifest = self.manifest.model_copy(update={section: entries})
            write_manifest(self.root, self.manifest)
            if old is not None:
                shutil.rmtree(self.root / section / old.directory, ignore_errors=True)
        return entry

    def commit_many(self, staged: list[tuple[Path, VariantEntry]]
                    ) -> tuple[list[VariantEntry], list[tuple[str, ManyfoldError]]]:
        """commit() for a batch of new variants, under one lock, one reload and ONE manifest write: adding
        thousands of adapters one commit at a time rewrites a manifest of thousands of entries each time.

        Each entry's files are placed as commit() places them, all before the manifest names any of them (a crash
        leaves the old manifest and directories it does not name, which a later add replaces). An entry whose name
        the store has, or that the batch holds more than once, or whose base is unknown, is refused by name and
        the rest go in. -> (entries added, in order, with their files; (name, why) for each refused)."""
        counts = Counter(entry.name for _, entry in staged)
        added: list[VariantEntry] = []
        refused: list[tuple[str, ManyfoldError]] = []
        with self._locked():
            self.reload()
            for path, entry in staged:
                try:
                    if counts[entry.name] > 1:
                        raise named_twice(entry.name, counts[entry.name])
                    self._refuse_taken(entry.name)
                    self.base(entry.base)
                    files = self._place(path, "variants", entry.directory, sync_parent=False)
                except ManyfoldError as e:
                    refused.append((entry.name, e))
                    continue
                except OSError as e:
                    refused.append((entry.name, ArtifactError(f"{self.root}: placing '{entry.name}' failed ({e})")))
                    continue
                added.append(entry.model_copy(update={"files": files}))
            if added:
                fsync_dir(self.root / "variants")
                variants = {**self.manifest.variants, **{e.name: e for e in added}}
                self.manifest = self.manifest.model_copy(update={"variants": variants})
                write_manifest(self.root, self.manifest)
        return added, refused

    def update(self, change: Callable[[StoreManifest], StoreManifest]) -> None:
        with self._locked():
            self.reload()
            self.manifest = change(self.manifest)
            write_manifest(self.root, self.manifest)

    def append_audit(self, line: dict) -> None:
        """Appended to audit/<YYYY-MM-DD>.jsonl under the store's lock (two processes' lines never interleave) and
        fsynced before this returns."""
        folder = self.root / AUDIT
        folder.mkdir(exist_ok=True)
        data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        with self._locked(), open(folder / f"{audit_day(line)}.jsonl", "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def remove(self, name: str) -> None:
        """Drop an entry from the manifest first, then its files. A base goes only without variants."""
        with self._locked():
            self.reload()
            self.manifest, section, directory = self._without(self.manifest, name)
            write_manifest(self.root, self.manifest)
            shutil.rmtree(self.root / section / directory, ignore_errors=True)


def open_store(location: str | Path, create: bool = False) -> StoreView:
    """The store at `location`: object storage for a URL (s3://, gs://, az://, file://, memory://; see
    serve/store/object_store.py), else a local directory (Store)."""
    from serve.store.objects import is_url

    if is_url(location):
        from serve.store.object_store import ObjectStore

        return ObjectStore(str(location), create=create)
    return Store(location, create=create)
