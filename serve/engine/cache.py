"""The variant cache: loaded variants of every kind in two byte-budgeted LRU tiers (device, cpu); disk is the store.
Outside the cache they are residencies that mean the same on any machine: device is hot, cpu is warm, disk is cold.

Each key moves through explicit states: on disk -> loading -> device <-> cpu -> evicted, and a move is one
operation at a time, kept in `_busy` while it runs (a load, or a tier copy off the event loop):
- Exactly one load per cold variant: whoever wants it meanwhile waits for that load, then goes back through
  acquisition (so it never holds an entry that was demoted, dropped or replaced in between).
- Entries are keyed by their store entry's key, "<name>@<revision>" (serve/store/manifest.py): one key's contents
  never change, so a replace in the store is another key, and nothing here tells a replaced entry from the new.
- An entry is held (in_use) from the moment its load finishes or a lookup finds it, before anything may evict
  it, until its rows release it; pinned entries never leave the device tier.
- Loading (an FM-Delta decode, an adapter read) runs in a worker thread; tier copies that cost anything (a GPU's
  device <-> host) run on the `copier` executor (the engine's compute thread), never on the event loop.
- Eviction drops the cache's references at once, so the memory goes back as soon as no batch holds it;
  the buffers a decode wrote go to a BufferPool that the next decode writes into.
"""

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import torch

from serve.engine import faults
from serve.engine.buffers import BufferPool
from serve.engine.stats import SECONDS_BUCKETS, Distribution
from serve.engine.types import Residency
from serve.errors import CapacityExceeded
from serve.store.manifest import REVISION_SEP
from serve.store.tensors import Alloc
from serve.variants.base import LoadedVariant

@dataclass
class CachedVariant:
    variant: LoadedVariant
    """Only the tensors that differ from the base (or an adapter's own); the base's are shared, not copied."""
    nbytes: int = 0
    in_use: int = 0
    """Rows or batches holding it: never evicted while > 0."""
    owned: list[torch.Tensor] = field(default_factory=list)
    """The buffers its decode took from the pool (never a base tensor): recycled when it leaves memory."""
    resident: bool = True

    @property
    def name(self) -> str:
        return self.variant.name

    @property
    def key(self) -> str:
        return self.variant.key

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.variant.tensors


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    load_seconds: Distribution = field(default_factory=lambda: Distribution(SECONDS_BUCKETS))


RESIDENCY: dict[str, Residency] = {"device": "hot", "cpu": "warm"}
"""Each tier as the API and metrics name it (serve/engine/types.py): on a CPU engine both tiers are host memory,
so "device" would mislead there."""

ACQUIRE_ATTEMPTS = 8
"""Times one acquisition goes back through the states (its variant evicted, dropped or replaced each time)
before it gives up with CapacityExceeded."""

Loader = Callable[[str, Alloc], LoadedVariant]
"""loader(name, alloc) -> the variant in memory; its new tensors come from alloc(shape, dtype) (a kind's load)."""


class VariantCache:
    def __init__(self, loader: Loader, device_bytes: int, cpu_bytes: int, device: str = "cpu",
                 pinned: tuple[str, ...] = (), copier: Executor | None = None):
        self._loader = loader
        self.device_bytes = device_bytes
        self.cpu_bytes = cpu_bytes
        self.device = torch.device(device)
        self.pinned = set(pinned)
        self._copier = copier
        self.copies_off_loop = self.device.type != "cpu"
        """Tier copies cost a transfer (a GPU's): they run on the copier. On a CPU engine the tiers are the same
        memory and a move is bookkeeping."""
        self._tiers: dict[str, OrderedDict[str, CachedVariant]] = {"device": OrderedDict(), "cpu": OrderedDict()}
        self._busy: dict[str, asyncio.Future] = {}
        """name -> its load or tier move in flight; resolved (its error set, if it failed) when it ends."""
        self._decode_gate: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self.buffers = BufferPool()
        self._refilling: asyncio.Future | None = None
        self.stats = CacheStats()

    # ---- what is where
    def residency(self, name: str) -> Residency:
        for tier, entries in self._tiers.items():
            if name in entries:
                return RESIDENCY[tier]
        return "cold"

    def resident(self) -> dict[str, Residency]:
        """Every variant held in memory, with its residency (hot or warm)."""
        return {name: RESIDENCY[tier] for tier, entries in self._tiers.items() for name in entries}

    def used_bytes(self, tier: str) -> int:
        return sum(e.nbytes for e in self._tiers[tier].values())

    def entries(self) -> list[tuple[str, CachedVariant]]:
        """Every entry in memory, device tier first."""
        return [(n, e) for entries in self._tiers.values() for n, e in entries.items()]

    # ---- use
    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[CachedVariant]:
        """The loaded variant, held on the device tier for the duration of the block."""
        entry = await self.acquire(name)
        try:
            yield entry
        finally:
            self.release(entry)

    def try_acquire(self, name: str) -> CachedVariant | None:
        """The variant held for the caller if it is ready now (a hit), else None; no waiting, no copy."""
        if self._move_of(name) is not None:
            return None
        device, cpu = self._tiers["device"], self._tiers["cpu"]
        if name in device:
            entry = device[name]
            device.move_to_end(name)
            entry.in_use += 1
        elif name in cpu and not self.copies_off_loop:
            entry = cpu.pop(name)
            entry.in_use += 1  # held before _promote's _fit can evict it
            try:
                self._promote(entry)
            except BaseException:
                self._discard(entry)
                raise
        else:
            return None
        self.stats.hits += 1
        return entry

    async def acquire(self, name: str) -> CachedVariant:
        """The variant, loaded or promoted if need be, held for the caller until release()."""
        for _ in range(ACQUIRE_ATTEMPTS):
            entry = self.try_acquire(name)
            if entry is not None:
                return entry
            move = self._move_of(name)
            if move is not None:  # a load or move in flight: wait for it, then start over
                self.stats.hits += 1
                await asyncio.shield(move)  # its error, if it failed, is every waiter's
                continue
            if name in self._tiers["cpu"]:
                self.stats.hits += 1
                entry = await self._while_busy(name, self._promote_off_loop(name))
            else:
                self.stats.misses += 1
                entry = await self._while_busy(name, self._load(name))
            if entry is not None:
                return entry
        raise CapacityExceeded(f"variant '{name.partition(REVISION_SEP)[0]}' was evicted {ACQUIRE_ATTEMPTS} times "
                               f"before it could run; retry later")

    def _move_of(self, name: str) -> asyncio.Future | None:
        """The load or move of `name` in flight on this event loop. One begun on a loop that has ended (a test's
        asyncio.run) can never finish: it is forgotten, and its entry with it."""
        move = self._busy.get(name)
        if move is not None and move.get_loop() is not asyncio.get_running_loop():
            del self._busy[name]
            return None
        return move

    async def _while_busy(self, name: str, move: Awaitable[CachedVariant | None]) -> CachedVariant | None:
        """Run one load or move of `name`; whoever wants it meanwhile waits, then goes back through acquisition."""
        future = asyncio.get_running_loop().create_future()
        self._busy[name] = future
        try:
            entry = await move
        except asyncio.CancelledError:
            future.set_result(None)  # the next waiter starts over
            raise
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # mark retrieved: waiters re-raise it, nobody else must
            raise
        else:
            future.set_result(None)
            return entry
        finally:
            if self._busy.get(name) is future:
                del self._busy[name]

    def release(self, entry: CachedVariant) -> None:
        entry.in_use -= 1
        if not entry.resident and entry.in_use == 0:
            self.buffers.put(entry.owned)  # dropped while held: its buffers go back now
            entry.owned = []
        self._fit()
        self._top_up()  # after the batch, not beside it: the refill's page faults would slow it

    def _gate(self) -> asyncio.Semaphore:
        """One decode at a time: it already uses every core, and each in flight is memory beyond the budget."""
        loop = asyncio.get_running_loop()
        if self._decode_gate is None or self._decode_gate[0] is not loop:
            self._decode_gate = (loop, asyncio.Semaphore(1))
        return self._decode_gate[1]

    async def _load(self, name: str) -> CachedVariant | None:
        """-> the entry loaded and promoted, held once for the caller."""
        owned: list[torch.Tensor] = []

        def alloc(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
            owned.append(self.buffers.take(shape, dtype))
            return owned[-1]

        async with self._gate():
            t0 = time.perf_counter()
            try:
                variant = await asyncio.to_thread(self._loader, name, alloc)
            except BaseException:
                self.buffers.put(owned)
                raise
        entry = CachedVariant(variant, variant.nbytes, in_use=1, owned=owned)
        self.buffers.max_bytes = max(self.buffers.max_bytes, entry.nbytes)
        if entry.nbytes > self.device_bytes:
            self._discard(entry)
            raise CapacityExceeded(f"variant '{variant.name}' needs {entry.nbytes >> 20} MiB; the device cache holds "
                                   f"{self.device_bytes >> 20} MiB")
        self.stats.load_seconds.observe(time.perf_counter() - t0)
        return await self._to_device(entry)

    async def _promote_off_loop(self, name: str) -> CachedVariant | None:
        entry = self._tiers["cpu"].pop(name)
        entry.in_use += 1  # held before anything can evict it
        return await self._to_device(entry)

    async def _to_device(self, entry: CachedVariant) -> CachedVariant | None:
        """A held entry off the tiers -> promoted to the device tier (the copy on the copier when it costs one),
        If the move raises, the entry is discarded."""
        try:
            if self.copies_off_loop:
                await asyncio.get_running_loop().run_in_executor(self._copier, entry.variant.to, self.device)
            return self._promote(entry)
        except BaseException:
            self._discard(entry)
            raise

    def _discard(self, entry: CachedVariant) -> None:
        """A held entry that will not be served (stale, too large, a move that failed): its hold and buffers."""
        entry.in_use -= 1
        self._release(entry)

    async def settle(self) -> None:
        """Wait for the tier moves in flight and a background top-up of the buffer pool to finish (benchmarks
        time a quiet machine; a test ends its event loop with nothing in flight)."""
        for _ in range(ACQUIRE_ATTEMPTS):  # a finished demotion may start another (its _fit)
            moves = [m for name in list(self._busy) if (m := self._move_of(name)) is not None]
            if not moves:
                break
            await asyncio.gather(*(asyncio.shield(m) for m in moves), return_exceptions=True)
        if self._refilling is not None and self._refilling.get_loop() is asyncio.get_running_loop():
            await self._refilling

    def _top_up(self) -> None:
        """Refill the buffer pool's reserve in a worker thread, one refill at a time."""
        if self.buffers.short() and (self._refilling is None or self._refilling.done()):
            self._refilling = asyncio.get_running_loop().run_in_executor(None, self.buffers.refill)

    def _promote(self, entry: CachedVariant) -> CachedVariant:
        """A held entry, off the tiers, onto the device tier (its copy already made, or free)."""
        faults.hit("promote", [entry.name])
        entry.variant.to(self.device)
        if self.device.type != "cpu":
            entry.owned = []  # host staging copies: freed, not pooled
        self._tiers["device"][entry.key] = entry
        self._fit()
        return entry

    # ---- eviction
    def _victims(self, tier: str) -> list[str]:
        return [n for n, e in self._tiers[tier].items() if e.in_use == 0 and n not in self.pinned]

    def _fit(self) -> None:
        """Demote LRU device entries to cpu, then drop LRU cpu entries, until both tiers fit."""
        device, cpu = self._tiers["device"], self._tiers["cpu"]
        for name in self._victims("device"):
            if self.used_bytes("device") <= self.device_bytes:
                break
            entry = device.pop(name)
            if entry.nbytes <= self.cpu_bytes:
                self._demote(name, entry)
            else:
                self._release(entry)
                self.stats.evictions += 1
        for name in self._victims("cpu"):
            if self.used_bytes("cpu") <= self.cpu_bytes:
                break
            self._release(cpu.pop(name))
            self.stats.evictions += 1

    def _demote(self, name: str, entry: CachedVariant) -> None:
        """Device tier -> cpu tier: at once when the copy is free, else on the copier, the name busy meanwhile
        (whoever wants it waits, then finds it on the cpu tier)."""
        if not self.copies_off_loop:
            entry.variant.to("cpu")
            self._tiers["cpu"][name] = entry
            return
        loop = asyncio.get_running_loop()
        done = self._busy[name] = loop.create_future()
        entry.in_use += 1  # nothing evicts it mid-copy

        def moved(copy: asyncio.Future) -> None:
            if self._busy.get(name) is done:
                del self._busy[name]
            entry.in_use -= 1
            if copy.exception() is None:
                self._tiers["cpu"][name] = entry
            else:
                self._release(entry)
            done.set_result(None)
            self._fit()

        loop.run_in_executor(self._copier, entry.variant.to, "cpu").add_done_callback(moved)

    def _release(self, entry: CachedVariant) -> None:
        """entry has left memory: its decode buffers go to the pool now, or when the last holder releases it."""
        entry.resident = False
        if entry.in_use == 0:
            self.buffers.put(entry.owned)
            entry.owned = []

    def drop(self, name: str) -> None:
        """Free a key's memory now (the store no longer has that revision); a running batch keeps its own
        reference. A load in flight for it still serves the rows that asked for it."""
        for entries in self._tiers.values():
            if name in entries:
                self._release(entries.pop(name))
