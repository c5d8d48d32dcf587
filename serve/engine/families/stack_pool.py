"""A pool of stacked copies on the engine's device, bounded by bytes: what the adapter pool (serve/engine/
adapter_pool.py) and the full fine-tunes' pool (serve/engine/families/weight_pool.py) share (S-LoRA's unified pool).

Variants whose copies have the same shapes share a bucket: one stack per tensor, a row per variant. A forward's
ops read each token's row from a per-token map (serve/engine/families/token_maps.py), so with fixed shapes every
bucket's ops are the same launches whichever variants a step's rows run, and a CUDA graph captured once replays them. A
variant that does not fit evicts idle ones, least recently used first, and the buckets are compacted so their
memory goes back; when the variants of running rows leave no room, the new row waits (attach returns None) until
some leave. Evicted variants stay in the variant cache's tiers (serve/engine/cache.py), so they come back from
memory, not from the store. `version` changes whenever a stack or a map buffer is reallocated (a captured graph
read the old addresses). Attached, detached and read on the engine's compute thread only.
"""

from abc import abstractmethod
from collections.abc import Hashable, Iterable

import torch

from kernels import NO_SLOT
from serve.engine.step.batch import BatchPlan
from serve.engine.families.slots import TableSlots
from serve.engine.families.token_maps import TokenMaps
from serve.errors import VariantIncompatible
from serve.variants.base import BaseView, LoadedVariant

MIB = 1 << 20


class Stacks:
    """One bucket: a stack per tensor, a row per variant; rows are reused, and the stacks grow (at most doubling)
    and shrink (compact) as the pool asks. A subclass allocates its stacks in `_resize` and writes a row in
    `put`."""

    modules: Iterable[str]
    """The modules whose tokens the bucket's ops correct."""

    def __init__(self, row_bytes: int, device: torch.device):
        self.row_bytes = row_bytes
        """What one variant costs in the bucket."""
        self.device = device
        self.owners: list[int | None] = []
        """row -> the pool slot whose variant it holds (None: free)."""

    @property
    def nbytes(self) -> int:
        return len(self.owners) * self.row_bytes

    @property
    def live(self) -> int:
        return sum(o is not None for o in self.owners)

    def free_row(self) -> int | None:
        return self.owners.index(None) if None in self.owners else None

    def grow(self, rows: int) -> None:
        """Room for `rows` more variants; rows keep their places."""
        self._resize(list(range(len(self.owners))), len(self.owners) + rows)

    def compact(self) -> dict[int, int]:
        """Free rows give their memory back; live rows move to the front. -> slot -> its new row."""
        live = [r for r, o in enumerate(self.owners) if o is not None]
        owners = [self.owners[r] for r in live]
        self._resize(live, len(live))
        self.owners = owners
        return {slot: row for row, slot in enumerate(owners)}

    def resized(self, old: torch.Tensor | None, new: torch.Tensor, keep: list[int]) -> torch.Tensor:
        """`new` (rows first) with its first len(keep) rows the old rows `keep`: what `_resize` does to each stack.
        Free rows are left unwritten: no map names them, and `put` writes every element of a row it takes."""
        if keep:
            if keep == list(range(len(keep))):  # growing: the old rows stay where they are
                new[: len(keep)] = old[: len(keep)]
            else:
                new[: len(keep)] = old.index_select(0, torch.tensor(keep, dtype=torch.long, device=self.device))
        return new

    def _resize(self, keep: list[int], rows: int) -> None:
        """Stacks of `rows` rows whose first len(keep) rows are the old rows `keep`; the rest free."""
        self._resize_stacks(keep, rows)
        self.owners = [self.owners[r] for r in keep] + [None] * (rows - len(keep))

    @abstractmethod
    def _resize_stacks(self, keep: list[int], rows: int) -> None: ...

    @abstractmethod
    def put(self, row: int, slot: int, variant: LoadedVariant) -> None:
        """Write the variant's copy into `row` (every element of it) and own the row."""

    def free(self, row: int) -> None:
        self.owners[row] = None


class StackPool(TableSlots):
    """Slots whose variants are copied into buckets of stacks within a byte budget (see the module's docstring)."""

    keep_warm = True

    pool_name: str
    """What messages call the pool ("adapter pool")."""

    def __init__(self, base: BaseView, device: torch.device, budget_bytes: int, budget_name: str):
        super().__init__(base, device)
        self.budget = budget_bytes
        self.budget_name = budget_name
        """The setting the budget comes from, for messages ("slots.adapter_mib")."""
        self.buckets: dict[Hashable, Stacks] = {}
        self.place: dict[int, tuple[Hashable, int]] = {}
        """slot -> (its bucket's key, its row there)."""
        self.maps = TokenMaps(device)
        """Each bucket's per-token rows, keyed by the bucket's key."""
        self._stacks = 0
        """Changes whenever a stack is reallocated."""
        self._planned: tuple[BatchPlan | None, list[tuple[Hashable, Stacks]], frozenset[str]] = \
            (None, [], frozenset())
        """The last forward's plan, its buckets, and the modules they correct."""

    @abstractmethod
    def bucket_key(self, variant: LoadedVariant) -> Hashable: ...

    @abstractmethod
    def row_bytes(self, key: Hashable) -> int:
        """What one variant of the bucket costs in the pool."""

    @abstractmethod
    def new_bucket(self, key: Hashable) -> Stacks: ...

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets.values())

    @property
    def version(self) -> int:
        """Changes whenever a stack or a map buffer is reallocated (a captured graph read the old addresses)."""
        return self._stacks + self.maps.version

    def check_fits(self, variant: LoadedVariant, what: str) -> None:
        """VariantIncompatible when the variant alone exceeds the budget (its rows could never run)."""
        need = self.row_bytes(self.bucket_key(variant))
        if need > self.budget:
            raise VariantIncompatible(f"{what} '{variant.name}' needs {need / MIB:.1f} MiB in the {self.pool_name}; "
                                      f"{self.budget_name} is {self.budget / MIB:g}")

    # ---- room: bytes, not slots
    def _room(self, variant: LoadedVariant) -> bool:
        """Room for one more row of the variant's bucket: a free row, free budget, or idle variants evicted
        (least recently used first) and the buckets compacted. False (nothing evicted): its row waits."""
        key = self.bucket_key(variant)
        bucket = self.buckets.get(key)
        if bucket is not None and bucket.free_row() is not None:
            return True
        need = bucket.row_bytes if bucket is not None else self.row_bytes(key)
        if self.nbytes + need <= self.budget:
            return True
        live = sum(b.live * b.row_bytes for b in self.buckets.values())
        idle = sorted((s for s, r in enumerate(self.refs) if r == 0 and s in self.place),
                      key=self.last_used.__getitem__)
        if live - sum(self._row_bytes(s) for s in idle) + need > self.budget:
            return False
        for s in idle:
            if live + need <= self.budget:
                break
            live -= self._row_bytes(s)
            self._empty(s)
        self._compact()
        return True

    def _row_bytes(self, slot: int) -> int:
        return self.buckets[self.place[slot][0]].row_bytes

    def _compact(self) -> None:
        for key, bucket in self.buckets.items():
            if bucket.free_row() is not None:
                self._stacks += 1
                for slot, row in bucket.compact().items():
                    self.place[slot] = (key, row)

    def _write(self, slot: int, variant: LoadedVariant) -> None:
        key = self.bucket_key(variant)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = self.new_bucket(key)
            self._stacks += 1
        row = bucket.free_row()
        if row is None:
            self._stacks += 1
            spare = (self.budget - self.nbytes) // bucket.row_bytes  # >= 1: _room made sure
            bucket.grow(max(1, min(len(bucket.owners), spare)))
            row = bucket.free_row()
        bucket.put(row, slot, variant)
        self.place[slot] = (key, row)

    def _clear(self, slot: int) -> None:
        place = self.place.pop(slot, None)
        if place is None:
            return
        key, row = place
        self.buckets[key].free(row)
        if self.buckets[key].live == 0:  # its memory goes back at once
            del self.buckets[key]
            self.maps.forget(key)
            self._stacks += 1

    # ---- forwards
    def _keys(self, plan: BatchPlan) -> list[tuple[Hashable, Stacks]]:
        """The buckets this forward runs, found once per forward (every wrapped module asks): with fixed shapes
        all of them (the same launches whichever variants the rows run), else those its rows use."""
        if self._planned[0] is not plan:
            used = self.buckets if self.fixed_shapes else {self.place[s][0] for s in plan.slot_set(self.family)
                                                           if s in self.place}
            self._planned = (plan, [(key, self.buckets[key]) for key in sorted(used)],
                             frozenset(m for key in used for m in self.buckets[key].modules))
        return self._planned[1]

    def prepare(self, plan: BatchPlan) -> None:
        """With fixed shapes, a generation step's per-token rows of every bucket, for all its tokens and for the LM
        head's kept ones, written into buffers allocated once per size: a captured step reads this step's maps."""
        if self.fixed_shapes:
            self.maps.prepare(plan, {key: lambda n, key=key: self._host_rows(plan, key, n)
                                     for key, _ in self._keys(plan)})

    def touches(self, name: str, plan: BatchPlan) -> bool:
        self._keys(plan)
        return name in self._planned[2]

    def rows(self, plan: BatchPlan, key: Hashable, n: int) -> torch.Tensor:
        """[n] int32 on the device: each of a module's n tokens' row in bucket `key` (NO_SLOT: none)."""
        return self.maps.get(plan, key, n, lambda n: self._host_rows(plan, key, n))

    def _host_rows(self, plan: BatchPlan, key: Hashable, n: int) -> list[int]:
        return [NO_SLOT if s == NO_SLOT else self._row_in(s, key) for s in plan.token_slots(self.family, n)]

    def _row_in(self, slot: int, key: Hashable) -> int:
        place = self.place.get(slot)
        return place[1] if place is not None and place[0] == key else NO_SLOT
