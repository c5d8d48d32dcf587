"""The catalog: one process's view of the store, as immutable snapshots.

Readers (the ingress's router, a replica's engine) resolve model ids against `catalog.snapshot`, a Snapshot that
never changes once published; the catalog publishes another when the store changes. It looks for a change every
refresh_s (on object storage one LIST of the manifest generations after the one held; locally one stat) and at
once on a change notice: a request naming a revision of an entry that this process does not hold yet (the
router resolved it against a newer snapshot) refreshes before it is answered. A model id the snapshot lacks is
looked for again only when the latest look began refresh_s ago or more: within that window the snapshot is the
negative cache (every name it lacks was unknown at that look), so a flood of random names costs the store at
most one look per refresh_s per process, and another process's add is served here within refresh_s, as it would
be anyway; an add made through this catalog is published at once. Every call to the store, reads and
writes alike, runs on the catalog's one thread: the store object is never touched by two threads, and the writes
of one process are serial.

An entry's revision (VariantEntryBase.revision) is a digest of what the manifest says of it, and its key
"<name>@<revision>" is what the engine's cache, slots and families, and Ray's multiplexed routing, know it by: a
variant replaced under its name is another key everywhere, and the old key's memory is freed when a snapshot
without it is followed (serve/engine/engine.py).
"""

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from serve.errors import VariantNotFound
from serve.store.manifest import MEMBER_SEP, REVISION_SEP, StoreManifest, VariantEntry
from serve.store.store import open_store
from serve.store.view import ManifestView, StoreView

log = logging.getLogger("manyfold.catalog")

REFRESH_S = 2.0
"""How often a catalog looks for a change of the store by default (ServeConfig.store_refresh_s)."""

T = TypeVar("T")


class Snapshot(ManifestView):
    """The store's entries as of one manifest; never changed once published."""

    def __init__(self, root: str | Path, manifest: StoreManifest, number: int):
        self.root = root
        self.manifest = manifest
        self.number = number
        """Snapshots this process has published, this one included."""
        self._keys: dict[str, str] = {}

    def key(self, name: str) -> str:
        """The key of the variant entry named `name` (VariantNotFound if this snapshot has none)."""
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = self.variant(name).key
        return key

    def model_key(self, model: str) -> str:
        """The key of the entry a variant's model id names (an EMR task's id names its group first)."""
        return self.key(model.split(MEMBER_SEP, 1)[0])

    def holds(self, key: str) -> bool:
        name = key.partition(REVISION_SEP)[0]
        return name in self.manifest.variants and self.key(name) == key

    def routed(self, model: str) -> str:
        """The id Ray's multiplexed routing knows a request for variant `model` by: the model id at its entry's
        revision ("support/topic@<revision>"), so that a replaced variant is routed as another model and a
        replica can tell which revision the router resolved (key_of)."""
        return f"{model}{REVISION_SEP}{self.model_key(model).partition(REVISION_SEP)[2]}"

    def entry(self, key: str) -> VariantEntry:
        """The entry of that revision; VariantNotFound once the store has replaced or removed it."""
        name = key.partition(REVISION_SEP)[0]
        if not self.holds(key):
            raise VariantNotFound(f"model '{name}' was replaced or removed while its request waited; retry")
        return self.manifest.variants[name]


def key_of(routed: str) -> str:
    """The entry key of a request's routed id (Snapshot.routed)."""
    model, _, revision = routed.rpartition(REVISION_SEP)
    return f"{model.split(MEMBER_SEP, 1)[0]}{REVISION_SEP}{revision}"


class Catalog:
    def __init__(self, location: str | Path, refresh_s: float = REFRESH_S, create: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        """refresh_s: seconds between looks for a change (0: only on a notice or after a write here, and a miss
        always looks). clock: monotonic seconds (a test's own clock moves the negative window without waiting)."""
        self._clock = clock
        self._started = clock()
        """When the latest look for a change began (on the catalog's thread)."""
        self._store = open_store(location, create=create)
        self.root = self._store.root
        self.snapshot = Snapshot(self.root, self._store.manifest, 1)
        self.refresh_s = refresh_s
        self.looks = 1
        """Times this catalog has read the store's state (opening it included): on object storage each is a LIST
        of the manifest generations, locally a stat."""
        self._looked = self._started
        """When the latest look that finished began: the time the snapshot's misses are known as of."""
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="manyfold-catalog")
        self._closed = threading.Event()
        if refresh_s > 0:
            threading.Thread(target=_refresh_every, args=(weakref.ref(self), self._closed, refresh_s),
                             name="manyfold-catalog-timer", daemon=True).start()

    @property
    def files(self) -> StoreView:
        """The store, for reading an entry's files (variant_dir(entry), base_dir, verify) from any thread: the
        files of an entry never change under its key. Its manifest is the catalog's to change: resolve names
        against `snapshot`, write with `write`."""
        return self._store

    # ---- following the store
    def _refresh(self, since: float | None = None, key: str | None = None) -> Snapshot:
        """On the catalog's thread: publish the store's newest manifest if it is not the one held. Skipped when a
        refresh has started since `since` (requests that miss at once share one look) or has brought `key`. A
        store out of reach keeps the snapshot held."""
        if (since is not None and self._started >= since) or (key is not None and self.snapshot.holds(key)):
            return self.snapshot
        started = self._started = self._clock()
        try:
            changed = self._look()
        except Exception as e:  # noqa: BLE001  (object storage away, a manifest being replaced: try next time)
            log.warning("store %s: refresh failed, serving snapshot %d (%s)", self.root, self.snapshot.number,
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            return self.snapshot
        finally:  # a failed look counts too: misses must not hammer a store that is out of reach
            self._looked = started
        if changed:
            self._publish()
        return self.snapshot

    def _look(self) -> bool:
        self.looks += 1
        return self._store.refresh()

    def _publish(self) -> None:
        if self._store.manifest is not self.snapshot.manifest:
            self.snapshot = Snapshot(self.root, self._store.manifest, self.snapshot.number + 1)

    async def refresh(self) -> Snapshot:
        """Look for a change now, unless a look has started since this call (a model id this process does not
        know may have just been added: requests that miss together share one look)."""
        return await asyncio.wrap_future(self._thread.submit(self._refresh, self._clock()))

    async def notice(self, key: str) -> Snapshot:
        """A request names this revision of an entry: hold it before answering, looking once if it is new here
        (a key the store no longer has leaves the snapshot as it is: its request gets a 404)."""
        if self.snapshot.holds(key):
            return self.snapshot
        return await asyncio.wrap_future(self._thread.submit(self._refresh, self._clock(), key))

    async def resolve(self, model: str, aliases: bool = True) -> tuple[Snapshot, str, str | None]:
        """model id -> (the snapshot that has it, its base, the id of the entry's model that answers it or None
        for a base; ManifestView.resolve), looking once more before a 404 unless the snapshot's look began less
        than refresh_s ago (the negative cache)."""
        snapshot = self.snapshot
        try:
            return snapshot, *snapshot.resolve(model, aliases)
        except VariantNotFound:
            if self._clock() - self._looked < self.refresh_s:
                raise
            snapshot = await self.refresh()
            return snapshot, *snapshot.resolve(model, aliases)

    # ---- writing
    async def write(self, change: Callable[[StoreView], T]) -> T:
        """change(store) on the catalog's thread (an add, a remove); the store's manifest after it is published
        before this returns, so this process serves the change at once."""
        return await asyncio.wrap_future(self._thread.submit(self._write, change))

    def _write(self, change: Callable[[StoreView], T]) -> T:
        try:
            return change(self._store)
        finally:
            self._look()
            self._publish()

    async def append_audit(self, line: dict) -> None:
        """Keep an admin change's audit line in the store (StoreView.append_audit), on the catalog's thread as
        every call to the store is; the manifest is not read again for it."""
        await asyncio.wrap_future(self._thread.submit(self._store.append_audit, line))

    def close(self) -> None:
        self._closed.set()
        self._thread.shutdown(wait=False)


def _refresh_every(catalog: "weakref.ref[Catalog]", closed: threading.Event, refresh_s: float) -> None:
    """The timer: a look every refresh_s, one at a time, until the catalog is closed or no longer referenced."""
    while not closed.wait(refresh_s):
        held = catalog()
        if held is None:
            return
        try:
            future = held._thread.submit(held._refresh, held._clock())
        except RuntimeError:  # closed meanwhile
            return
        del held
        future.result()
