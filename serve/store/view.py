"""What every Manyfold store is through its manifest, wherever its bytes live: model ids resolved to entries
(ManifestView, which a catalog's snapshot publishes too), and the checks and steps every store's writes share
(StoreView). A store in a local directory (serve/store/store.py: Store) and one on object storage
(serve/store/object_store.py: ObjectStore) build on it, each placing files its own way.
"""

import contextlib
import difflib
import hashlib
import shutil
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from serve.errors import BadRequest, TenantNotFound, VariantNotFound
from serve.store.manifest import MEMBER_SEP, BaseEntry, StoreManifest, TenantEntry, VariantEntry
from serve.store.model_dir import NOT_COPIED, architecture_of, read_model_config
from serve.store.node_cache import NodeCache

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


AUDIT = "audit"
"""The store's folder (or key prefix) of admin audit lines."""


def audit_day(line: dict) -> str:
    """The UTC day an audit line is filed under: its own time's, so a line and its file agree."""
    stamp = str(line.get("time") or datetime.now(UTC).isoformat())
    return stamp[:10]


def named_twice(name: str, count: int) -> BadRequest:
    """Why every item of a batch that shares its name with another is refused: which one was meant is unknown."""
    return BadRequest(f"'{name}' is named {count} times in this batch; none of them was added")
