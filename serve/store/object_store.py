"""A store on object storage (s3://, gs://, az://, memory://): immutable objects and one manifest per generation.

    manifests/<generation, 20 digits>   the StoreManifest as of that generation
    objects/<sha256>                    a file's bytes, named by their digest
    audit/<YYYY-MM-DD>/<time>-<random>.json   one admin change's audit line (serve/http/audit.py)

An entry's files are objects: FileEntry.path is the file's path inside the entry's directory, and its sha256 the
object's name, so the same bytes (a tokenizer many bases share, an adapter added twice) are one object. A write
uploads the new files' objects first (a reader never sees an object half-written, and none is named yet), then
puts manifest generation N + 1 if absent: of two writers racing for it, one wins and the other reads N + 1,
checks its change again against it and tries N + 2, so neither loses the other's add. A reader refreshes by
listing the generations after the one it holds. Entries are read through a node's cache (node_cache.py): a
directory per entry and content, its files fetched once per node and checked against their digests once, the
fetch's progress logged as it goes (progress.py) and told to `on_fetch`.
Objects of a removed or replaced entry stay until `collect` runs (`manyfold store gc`): it deletes only objects
that no generation written within the grace period names and that are themselves older than it (an upload
whose manifest is not written yet is young), then the generations older than it but the newest, so a reader
holding an older generation can fetch its files for as long as the grace period lasts.
"""

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from pydantic import ValidationError
from pydantic_core import from_json

from serve.errors import ArtifactError, ConfigError, ManyfoldError, first_error
from serve.store.manifest import BaseEntry, FileEntry, StoreManifest, VariantEntry
from serve.store.node_cache import NodeCache
from serve.store.objects import Objects
from serve.store.progress import Progress
from serve.store.view import AUDIT, StoreView, audit_day, file_sha256, named_twice

GENERATIONS = "manifests"
MAX_ATTEMPTS = 64
"""Generations a write tries before it gives up (each lost race means another writer's change went in)."""
CACHE_MIB = 20 << 10
"""A node cache's default budget when MANYFOLD_CACHE_MIB is not set: 20 GiB."""


def node_cache() -> NodeCache:
    """This node's cache: MANYFOLD_CACHE_DIR (default ~/.cache/manyfold/node), MANYFOLD_CACHE_MIB of it."""
    root = os.environ.get("MANYFOLD_CACHE_DIR") or Path.home() / ".cache" / "manyfold" / "node"
    try:
        mib = int(os.environ.get("MANYFOLD_CACHE_MIB", CACHE_MIB))
    except ValueError:
        raise ConfigError(f"MANYFOLD_CACHE_MIB: expected a number of MiB, got {os.environ['MANYFOLD_CACHE_MIB']!r}")
    return NodeCache(root, mib << 20)


def generation_key(n: int) -> str:
    return f"{GENERATIONS}/{n:020d}"


class ObjectStore(StoreView):
    def __init__(self, url: str, create: bool = False, cache: NodeCache | None = None):
        self.root = url
        self.objects = Objects(url)
        self.cache = cache if cache is not None else node_cache()
        self.generation = 0
        """The manifest generation held (0: none written yet)."""
        if create and not self.objects.keys(GENERATIONS):
            self.objects.put_new(generation_key(1), _dump(StoreManifest()))
        self.reload()

    # ---- reading
    def reload(self) -> StoreManifest:
        keys = self.objects.keys(GENERATIONS)
        if not keys:
            raise ArtifactError(f"{self.root}: not a Manyfold store (no {GENERATIONS}/)")
        self._load(keys[-1])
        return self.manifest

    def refresh(self) -> bool:
        """Read the newest generation if it is not the one held; -> whether it changed."""
        newer = self.objects.keys(GENERATIONS, after=generation_key(self.generation))
        if not newer:
            return False
        self._load(newer[-1])
        return True

    def _load(self, key: str) -> None:
        data = self.objects.read(key)
        try:
            self.manifest = StoreManifest.model_validate(from_json(data, cache_strings="all"))
        except ValidationError as e:
            raise ArtifactError(f"{self.root}/{key}: malformed manifest ({first_error(e)})") from e
        except ValueError as e:
            raise ArtifactError(f"{self.root}/{key}: malformed manifest ({e})") from e
        self.generation = int(key.rsplit("/", 1)[1])

    def base_dir(self, name: str | BaseEntry) -> Path:
        return self._directory(self.base(name) if isinstance(name, str) else name)

    def variant_dir(self, name: str | VariantEntry) -> Path:
        return self._directory(self._entry(name))

    def _directory(self, entry: BaseEntry | VariantEntry) -> Path:
        content = hashlib.sha256("".join(f"{f.path}\0{f.sha256}\0" for f in entry.files).encode()).hexdigest()
        report = None if self.on_fetch is None else partial(self.on_fetch, entry)
        progress = Progress(f"{'base' if entry.kind == 'base' else 'variant'} '{entry.name}'",
                            sum(f.bytes for f in entry.files), report)
        return self.cache.directory(self.objects, f"{entry.name}-{content[:16]}", entry.files, progress)

    def verify(self, entry: BaseEntry | VariantEntry) -> None:
        """Every file of the entry in this node's cache, each checked against its digest when it came in (once
        per node: a replica starting where the cache holds them reads and hashes nothing)."""
        self._directory(entry)

    # ---- writing
    @contextlib.contextmanager
    def stage(self) -> Iterator[Path]:
        tmp = Path(tempfile.mkdtemp(dir=self._staging()))
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _staging(self) -> Path:
        path = self.cache.root / "staging"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _upload(self, staged: Path) -> list[FileEntry]:
        """Each staged file as an object (uploaded unless its bytes are there already); -> their entries."""
        files = []
        for p in sorted(staged.rglob("*")):
            if p.is_file():
                digest = file_sha256(p)
                if not self.objects.exists(f"objects/{digest}"):
                    self.objects.put_file(f"objects/{digest}", p)
                files.append(FileEntry(path=str(p.relative_to(staged)), bytes=p.stat().st_size, sha256=digest))
        return files

    def _swap(self, change: Callable[[StoreManifest], StoreManifest]) -> None:
        """Write change(newest manifest) as the next generation, again over a newer one if another writer got
        there first; change raises (BadRequest, ...) when the newest manifest refuses it."""
        for _ in range(MAX_ATTEMPTS):
            self.refresh()
            new = change(self.manifest)
            if self.objects.put_new(generation_key(self.generation + 1), _dump(new)):
                self.manifest, self.generation = new, self.generation + 1
                return
        raise ArtifactError(f"{self.root}: {MAX_ATTEMPTS} manifest generations were written by others meanwhile; "
                            f"try again")

    def commit(self, staged: Path, entry: BaseEntry | VariantEntry, replace: bool = False) -> BaseEntry | VariantEntry:
        """Upload the staged files, then record the entry (replacing one of the same name, kind and base with
        replace) in the next manifest generation."""
        entry = entry.model_copy(update={"files": self._upload(staged)})
        section = "bases" if entry.kind == "base" else "variants"

        def change(m: StoreManifest) -> StoreManifest:
            self._replaceable(m, entry, replace)
            return m.model_copy(update={section: {**getattr(m, section), entry.name: entry}})

        self._swap(change)
        return entry

    def commit_many(self, staged: list[tuple[Path, VariantEntry]]
                    ) -> tuple[list[VariantEntry], list[tuple[str, ManyfoldError]]]:
        """commit() for a batch of new variants in one generation; an entry whose name is taken, or named twice,
        or whose base is unknown, is refused by name and the rest go in."""
        counts: dict[str, int] = {}
        for _, entry in staged:
            counts[entry.name] = counts.get(entry.name, 0) + 1
        uploaded = [(e.model_copy(update={"files": self._upload(p)}), counts[e.name]) for p, e in staged]
        result: tuple[list, list] = ([], [])

        def change(m: StoreManifest) -> StoreManifest:
            added, refused = [], []
            for entry, count in uploaded:
                try:
                    if count > 1:
                        raise named_twice(entry.name, count)
                    self._replaceable(m, entry, replace=False)
                except ManyfoldError as e:
                    refused.append((entry.name, e))
                    continue
                added.append(entry)
            result[0][:], result[1][:] = added, refused
            return m.model_copy(update={"variants": {**m.variants, **{e.name: e for e in added}}})

        self._swap(change)
        return result

    def update(self, change: Callable[[StoreManifest], StoreManifest]) -> None:
        self._swap(change)

    def remove(self, name: str) -> None:
        self._swap(lambda m: self._without(m, name)[0])

    def append_audit(self, line: dict) -> None:
        """One object per line, audit/<YYYY-MM-DD>/<time>-<random>.json: object storage has no append, and
        writers on many nodes never collide; the keys sort by time within a day."""
        stamp = "".join(c for c in str(line.get("time", "")) if c.isalnum() or c == ".")
        key = f"{AUDIT}/{audit_day(line)}/{stamp}-{secrets.token_hex(4)}.json"
        self.objects.put_new(key, (json.dumps(line, separators=(",", ":")) + "\n").encode())


GRACE_S = 3600.0
"""How long objects nothing names any more, and generations not the newest, stay before `collect` deletes them:
far above any reader's refresh interval."""


def collect(store: ObjectStore, grace_s: float = GRACE_S, now: float | None = None) -> dict[str, int]:
    """Delete what no reader can need: objects that no generation newer than grace_s (nor the newest) names and
    that are older than grace_s, then generations older than grace_s but the newest. -> counts and bytes freed."""
    now = time.time() if now is None else now
    generations = store.objects.listing(GENERATIONS)
    if not generations:
        return {"objects": 0, "bytes": 0, "generations": 0}
    newest = generations[-1][0]
    kept = [key for key, _, modified in generations if key == newest or now - modified < grace_s]
    named = set()
    for key in kept:
        manifest = StoreManifest.model_validate(from_json(store.objects.read(key)))
        named |= {f.sha256 for e in (*manifest.bases.values(), *manifest.variants.values()) for f in e.files}
    freed = {"objects": 0, "bytes": 0, "generations": 0}
    for key, size, modified in store.objects.listing("objects"):
        if key.rsplit("/", 1)[1] not in named and now - modified >= grace_s:
            store.objects.delete(key)
            freed["objects"] += 1
            freed["bytes"] += size
    for key, _, _ in generations:
        if key not in kept:
            store.objects.delete(key)
            freed["generations"] += 1
    return freed


def _dump(manifest: StoreManifest) -> bytes:
    return manifest.model_dump_json(indent=2).encode() + b"\n"
