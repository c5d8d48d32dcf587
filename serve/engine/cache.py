"""The variant cache: loaded variants of every kind in two byte-budgeted LRU tiers (device, cpu); disk is the store.

- Exactly one load per cold variant: every request that waits for it awaits the same future.
- Loading (an FM-Delta decode, an adapter read) runs in a worker thread, off the event loop.
- An entry is held (in_use) from the moment its load finishes or a lookup finds it, before anything may evict
  it, until its rows release it; pinned entries never leave the device tier.
- Eviction drops the cache's references at once, so the memory goes back as soon as no batch holds it;
  the buffers a decode wrote go to a BufferPool that the next decode writes into.
"""

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
import torch

from serve.engine.buffers import BufferPool
from serve.engine.stats import SECONDS_BUCKETS, Distribution
from serve.engine.types import Residency
from serve.errors import CapacityExceeded
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
    def weights(self) -> dict[str, torch.Tensor]:
        return self.variant.tensors


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    load_seconds: Distribution = field(default_factory=lambda: Distribution(SECONDS_BUCKETS))


Loader = Callable[[str, Alloc], LoadedVariant]
"""loader(name, alloc) -> the variant in memory; its new tensors come from alloc(shape, dtype) (a kind's load)."""


class VariantCache:
    def __init__(self, loader: Loader, device_bytes: int, cpu_bytes: int, device: str = "cpu",
                 pinned: tuple[str, ...] = ()):
        self._loader = loader
        self.device_bytes = device_bytes
        self.cpu_bytes = cpu_bytes
        self.device = torch.device(device)
        self.pinned = set(pinned)
        self._tiers: dict[str, OrderedDict[str, CachedVariant]] = {"device": OrderedDict(), "cpu": OrderedDict()}
        self._loading: dict[str, asyncio.Future] = {}
        self._decode_gate: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self.buffers = BufferPool()
        self._refilling: asyncio.Future | None = None
        self.stats = CacheStats()

    # ---- what is where
    def residency(self, name: str) -> Residency:
        for tier, entries in self._tiers.items():
            if name in entries:
                return tier  # type: ignore[return-value]
        return "disk"

    def resident(self) -> dict[str, Residency]:
        """Every variant held in memory, with its tier."""
        return {name: tier for tier, entries in self._tiers.items() for name in entries}  # type: ignore[misc]

    def used_bytes(self, tier: str) -> int:
        return sum(e.nbytes for e in self._tiers[tier].values())

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
        """The variant held for the caller if it is in memory now (a hit), else None; no waiting."""
        device = self._tiers["device"]
        if name in device:
            entry = device[name]
            device.move_to_end(name)
        elif name in self._tiers["cpu"]:
            entry = self._tiers["cpu"].pop(name)
            entry.in_use += 1  # held before _promote's _fit can evict it
            self._promote(entry)
            self.stats.hits += 1
            return entry
        else:
            return None
        self.stats.hits += 1
        entry.in_use += 1
        return entry

    async def acquire(self, name: str) -> CachedVariant:
        """The variant, loaded if need be, held for the caller until release(); at most one load at a time."""
        entry = self.try_acquire(name)
        if entry is not None:
            return entry
        if name in self._loading:  # someone is loading it: share that load
            self.stats.hits += 1
            entry = await asyncio.shield(self._loading[name])
            if entry.resident:
                entry.in_use += 1
                return entry
            # Evicted between its load and this waiter's turn, its buffers recycled: load it again.
            return await self.acquire(name)
        self.stats.misses += 1
        future = asyncio.get_running_loop().create_future()
        self._loading[name] = future
        try:
            entry = await self._load(name)  # held (in_use 1) for this caller
            future.set_result(entry)
            return entry
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # mark retrieved: waiters re-raise it, nobody else must
            raise
        finally:
            del self._loading[name]

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

    async def _load(self, name: str) -> CachedVariant:
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
            entry.in_use = 0
            self._release(entry)
            raise CapacityExceeded(f"variant '{name}' needs {entry.nbytes >> 20} MiB; the device cache holds "
                                   f"{self.device_bytes >> 20} MiB")
        self.stats.load_seconds.observe(time.perf_counter() - t0)
        return self._promote(entry)

    async def settle(self) -> None:
        """Wait for a background top-up of the buffer pool to finish (benchmarks time a quiet machine)."""
        if self._refilling is not None and self._refilling.get_loop() is asyncio.get_running_loop():
            await self._refilling

    def _top_up(self) -> None:
        """Refill the buffer pool's reserve in a worker thread, one refill at a time."""
        if self.buffers.short() and (self._refilling is None or self._refilling.done()):
            self._refilling = asyncio.get_running_loop().run_in_executor(None, self.buffers.refill)

    def _promote(self, entry: CachedVariant) -> CachedVariant:
        entry.variant.to(self.device)
        if self.device.type != "cpu":
            entry.owned = []  # host staging copies: freed, not pooled
        self._tiers["device"][entry.name] = entry
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
                entry.variant.to("cpu")
                cpu[name] = entry
            else:
                self._release(entry)
                self.stats.evictions += 1
        for name in self._victims("cpu"):
            if self.used_bytes("cpu") <= self.cpu_bytes:
                break
            self._release(cpu.pop(name))
            self.stats.evictions += 1

    def _release(self, entry: CachedVariant) -> None:
        """entry has left memory: its decode buffers go to the pool now, or when the last holder releases it."""
        entry.resident = False
        if entry.in_use == 0:
            self.buffers.put(entry.owned)
            entry.owned = []

    def drop(self, name: str) -> None:
        """Forget a variant (removed or replaced in the store); a running batch keeps its own reference."""
        for entries in self._tiers.values():
            if name in entries:
                self._release(entries.pop(name))
