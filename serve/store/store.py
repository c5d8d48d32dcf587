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
import difflib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from serve.errors import ArtifactError, BadRequest, ManyfoldError, TenantNotFound, VariantNotFound
from serve.store.manifest import (MANIFEST, MEMBER_SEP, BaseEntry, FileEntry, StoreManifest, TenantEntry,
                                  VariantEntry, read_manifest, write_manifest)
from serve.store.model_dir import NOT_COPIED, architecture_of, read_model_config
from serve.store.node_cache import NodeCache
from serve.store.writer import fsync_dir

_LOCK = ".lock"
_HASH_BLOCK = 8 << 20


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


class ManifestView:
    """Model ids and entries as one manifest has them: what a store reads and a catalog's snapshot
    (serve/store/catalog.py) publishes."""

    root: str | Path
    """Where the store is, as messages name it."""
    manifest: StoreManifest

    def resolve(self, model: str, aliases: bool = True) -> tuple[str, str | None]:
        """A model id -> (its base, the id of the entry's model that answers it: the model id again, or the one
        an alias points it at; None for a base); unknown ids suggest close ones. aliases=False: `model` names an
        entry's model as it is stored (one a router resolved already), even where an alias shadows the name."""
        if model in self.manifest.bases:
            return model, None
        if aliases:
            model = self.aliased(model)
        entry = self.manifest.variants.get(model.split(MEMBER_SEP, 1)[0])
        if entry is not None and model in entry.models():
            return entry.base, model
        known = [*self.manifest.bases, *(m for m, _, _ in self.served())]
        close = difflib.get_close_matches(model, known, n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise VariantNotFound(f"model '{model}' does not exist{hint}")

    def aliased(self, model: str) -> str:
        """The model id an alias (StoreManifest.aliases) turns `model` into, or model: an alias of an EMR group
        names its tasks too ("<alias>/<task>")."""
        name, sep, member = model.partition(MEMBER_SEP)
        target = self.manifest.aliases.get(name)
        return model if target is None else f"{target}{sep}{member}"

    def served(self) -> list[tuple[str, VariantEntry, str]]:
        """(the model id clients call, the entry that answers it, that entry's own id for it) of every variant
        model: each entry's models under their own names but where an alias of the name shadows them, then each
        alias's."""
        aliases = self.manifest.aliases
        out = [(m, v, m) for v in self.manifest.variants.values() if v.name not in aliases for m in v.models()]
        for name, target in aliases.items():
            entry = self.manifest.variants[target]
            out += [(name + m[len(target):], entry, m) for m in entry.models()]
        return out

    def labels(self, model: str) -> list[str] | None:
        """A served variant's class labels (None: not a classifier, or a base)."""
        model = self.aliased(model)
        entry = self.manifest.variants.get(model.split(MEMBER_SEP, 1)[0])
        return entry.models().get(model) if entry is not None else None

    def base(self, name: str) -> BaseEntry:
        try:
            return self.manifest.bases[name]
        except KeyError:
            raise VariantNotFound(f"store {self.root} has no base '{name}'") from None

    def variant(self, name: str) -> VariantEntry:
        try:
            return self.manifest.variants[name]
        except KeyError:
            raise VariantNotFound(f"store {self.root} has no variant '{name}'") from None

    def base_shapes(self, name: str) -> dict[str, list[int]]:
        """Shapes of a base's tensors, from its safetensors headers: what a variant is validated against."""
        from serve.store.tensors import SafetensorsSource

        return SafetensorsSource(self.base_dir(name)).shapes()

    def summary(self) -> list[dict]:
        """One row per base and variant: what `manyfold store list` prints."""
        rows = [{"name": b.name, "kind": "base", "base": "-", "architecture": b.architecture,
                 "stored_bytes": sum(f.bytes for f in b.files), "raw_bytes": None, "params": b.params}
                for b in self.manifest.bases.values()]
        rows += [{"name": v.name, "kind": v.kind, "base": v.base, "architecture": v.architecture,
                  "stored_bytes": sum(f.bytes for f in v.files), "raw_bytes": v.raw_bytes,
                  "models": v.models(), "forms": {m: v.form_of(m) for m in v.models()},
                  "form_records": {m: r.model_dump() for m, r in v.form_records().items()}}
                 for v in self.manifest.variants.values()]
        return rows


class StoreView(ManifestView):
    """What every store does through its manifest alone, wherever its bytes live: check a write, add a base. A
    store in a local directory (Store) and one on object storage (serve/store/object_store.py: ObjectStore) each
    keep `manifest` current and place files their own way."""

    cache: NodeCache | None = None
    """The node's cache its files are read through (object storage); None: they are read where they lie."""
    on_fetch: Callable[[BaseEntry | VariantEntry, int, int], None] | None = None
    """Told how far a fetch of an entry's files into the node's cache has come, with each progress line
    (serve/store/progress.py): (entry, bytes done, bytes in all). A replica puts its base's on the board."""

    def _refuse_taken(self, name: str, manifest: StoreManifest | None = None) -> None:
        m = self.manifest if manifest is None else manifest
        if name in m.bases or name in m.variants:
            raise BadRequest(f"store {self.root} already has an entry named '{name}'")

    def add_base(self, name: str, model_dir: str | Path, derive: Callable[[Path], None] | None = None,
                 neuzip_bits: int | None = None) -> BaseEntry:
        """Copy a HF model directory (safetensors weights, config, tokenizer) into the store as a base.
        derive(staged) may rewrite the copy and add files before it is committed (a NeuZip form:
        serve/codecs/neuzip_file.py add_base); the entry describes the weights as staged."""
        from serve.store.tensors import SafetensorsSource, fingerprint

        model_dir = Path(model_dir)
        read_model_config(model_dir)
        with self.stage() as staged:
            shutil.copytree(model_dir, staged, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(*NOT_COPIED))
            if derive is not None:
                derive(staged)
            weights = SafetensorsSource(staged)
            entry = BaseEntry(name=name, architecture=architecture_of(read_model_config(staged), model_dir),
                              params=sum(t.numel() for t in weights.values()),
                              fingerprint=fingerprint(weights), files=[], neuzip_bits=neuzip_bits)
            return self.commit(staged, entry)

    def base_dir(self, name: str | BaseEntry) -> Path:
        """A local directory holding the base's files (of the entry given, or the manifest's of that name)."""
        raise NotImplementedError

    def variant_dir(self, name: str | VariantEntry) -> Path:
        """A local directory holding the variant's files: of the entry the manifest has under that name, or of the
        entry given (one revision of it, as a catalog's snapshot had it)."""
        raise NotImplementedError

    def _entry(self, name: str | VariantEntry) -> VariantEntry:
        return self.variant(name) if isinstance(name, str) else name

    def stage(self) -> contextlib.AbstractContextManager[Path]:
        """A local temp directory for a new entry's files; removed unless committed."""
        raise NotImplementedError

    def commit(self, staged: Path, entry: BaseEntry | VariantEntry, replace: bool = False) -> BaseEntry | VariantEntry:
        raise NotImplementedError

    def _replaceable(self, manifest: StoreManifest, entry: BaseEntry | VariantEntry, replace: bool
                     ) -> VariantEntry | None:
        """The entry `entry` replaces (None: its name is new), after the checks every commit makes."""
        old = manifest.variants.get(entry.name) if entry.kind != "base" else None
        if old is not None and replace:
            if (old.kind, old.base) != (entry.kind, entry.base):
                raise BadRequest(f"store {self.root}: '{entry.name}' is a {old.kind} variant of '{old.base}'; "
                                 f"it cannot be replaced by a {entry.kind} variant of '{entry.base}'")
            if old.directory == entry.directory:
                raise BadRequest(f"store {self.root}: '{entry.name}' already holds this bundle")
        else:
            self._refuse_taken(entry.name, manifest)
            old = None
        if entry.kind != "base" and entry.base not in manifest.bases:
            raise VariantNotFound(f"store {self.root} has no base '{entry.base}'")
        return old

    def update(self, change: Callable[[StoreManifest], StoreManifest]) -> None:
        """Write change(the newest manifest) as the manifest, atomically against other writers; change raises
        (BadRequest, ...) when the newest manifest refuses it, and nothing is written."""
        raise NotImplementedError

    def put_tenant(self, tenant: TenantEntry) -> bool:
        """Add a tenant or replace the one of its name; -> whether it replaced one. A key that another tenant
        holds is refused (a key names one tenant)."""
        replaced: list[bool] = []

        def change(m: StoreManifest) -> StoreManifest:
            keys = set(tenant.key_sha256) | set(tenant.admin_key_sha256)
            for other in m.tenants.values():
                if other.name != tenant.name and keys & (set(other.key_sha256) | set(other.admin_key_sha256)):
                    raise BadRequest(f"a key of tenant '{tenant.name}' is already a key of tenant '{other.name}'")
            replaced[:] = [tenant.name in m.tenants]
            return m.model_copy(update={"tenants": {**m.tenants, tenant.name: tenant}})

        self.update(change)
        return replaced[0]

    def remove_tenant(self, name: str) -> None:
        def change(m: StoreManifest) -> StoreManifest:
            if name not in m.tenants:
                raise TenantNotFound(f"store {self.root} has no tenant '{name}'")
            return m.model_copy(update={"tenants": {k: t for k, t in m.tenants.items() if k != name}})

        self.update(change)

    def append_audit(self, line: dict) -> None:
        """Keep one admin change's audit line (serve/http/audit.py) in the store, beside what it changed, where
        every node's changes land together; line["time"] (ISO 8601, UTC) files it by day and order."""
        raise NotImplementedError

    def _without(self, manifest: StoreManifest, name: str) -> tuple[StoreManifest, str, str]:
        """The manifest without entry `name` (a base only once no variant needs it); -> (it, its section, its
        directory)."""
        if name in manifest.variants:
            pointing = sorted(a for a, target in manifest.aliases.items() if target == name)
            if pointing:
                raise BadRequest(f"'{name}' answers for {', '.join(repr(a) for a in pointing)} (an alias; "
                                 f"`manyfold store upgrade --rollback` points it back)")
            variants = {k: v for k, v in manifest.variants.items() if k != name}
            return manifest.model_copy(update={"variants": variants}), "variants", manifest.variants[name].directory
        if name in manifest.bases:
            children = sorted(v.name for v in manifest.variants.values() if v.base == name)
            if children:
                raise BadRequest(f"base '{name}' still has variants: {', '.join(children)}")
            bases = {k: v for k, v in manifest.bases.items() if k != name}
            return manifest.model_copy(update={"bases": bases}), "bases", name
        raise VariantNotFound(f"store {self.root} has no entry '{name}'")


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


AUDIT = "audit"
"""The store's folder (or key prefix) of admin audit lines."""


def audit_day(line: dict) -> str:
    """The UTC day an audit line is filed under: its own time's, so a line and its file agree."""
    stamp = str(line.get("time") or datetime.now(UTC).isoformat())
    return stamp[:10]


def open_store(location: str | Path, create: bool = False) -> StoreView:
    """The store at `location`: object storage for a URL (s3://, gs://, az://, file://, memory://; see
    serve/store/object_store.py), else a local directory (Store)."""
    from serve.store.objects import is_url

    if is_url(location):
        from serve.store.object_store import ObjectStore

        return ObjectStore(str(location), create=create)
    return Store(location, create=create)


def named_twice(name: str, count: int) -> BadRequest:
    """Why every item of a batch that shares its name with another is refused: which one was meant is unknown."""
    return BadRequest(f"'{name}' is named {count} times in this batch; none of them was added")
