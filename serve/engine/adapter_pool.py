"""The adapter pool (family "lora"): LoRA and PiSSA adapters on the engine's device, bounded by bytes, not by
a count of slots (S-LoRA's unified memory pool).

Each adapter sits in a rank bucket: the adapters whose rank rounds up to the same power of two R (8 at least)
and that target the same modules share one stack per module, A [rows, R, in], B^T [rows, R, out] and
scale [rows], a row per adapter. A forward runs the LoRA ops once per bucket its rows use, over
that bucket's own stack, so rank-8 adapters beside a rank-64 one are multiplied, and held, at rank 8. On CUDA the
A stacks of layers that read one input (a layer's q, k and v; gate and up: SIBLINGS) lie in one tensor, so their
shrink is one launch for all of them (Punica's packed slices) and each layer's expand reads its own block.

The pool's bytes are its stacks' bytes, at most slots.adapter_mib. An adapter that does not fit evicts idle
ones, least recently used first, and the buckets are compacted so their memory goes back; when the adapters of
running rows leave no room, the new row waits (attach returns None) until some leave. Evicted adapters stay in
the variant cache's tiers (serve/engine/cache.py), so they come back from memory, not from the store.
Attached, detached and read on the engine's compute thread only.
"""

import torch

from kernels import (NO_SLOT, HostStacks, bgmv_expand, bgmv_shrink, host_stacks, lora_by_token, lora_expand,
                     lora_shrink)
from serve.config import SlotsConfig
from serve.engine.batch import BatchPlan
from serve.engine.slots import TableSlots, register_family
from serve.errors import VariantIncompatible
from serve.variants.base import BaseView, LoadedVariant
from serve.variants.lora import matmul_dims

MIN_RANK = 8
MIB = 1 << 20

BucketKey = tuple[int, tuple[str, ...]]
"""(R, the modules its adapters target)."""
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Layers of one parent that read the same input, by their names in transformers' models (vLLM's
packed_modules_mapping)."""


def same_input(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two views of one tensor's same elements, unchanged between them."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a._version == b._version)


def packed_groups(modules: tuple[str, ...], base: BaseView) -> list[tuple[str, ...]]:
    """The modules as groups whose A stacks share one tensor: siblings of one parent with one input width
    together, in SIBLINGS' order; every other module alone."""
    groups: dict[tuple, list[str]] = {}
    for m in modules:
        parent, _, leaf = m.rpartition(".")
        family = next((i for i, names in enumerate(SIBLINGS) if leaf in names), None)
        key = (m,) if family is None else (parent, family, matmul_dims(base.modules[m])[0])
        groups.setdefault(key, []).append(m)
    order = {leaf: i for names in SIBLINGS for i, leaf in enumerate(names)}
    return [tuple(sorted(g, key=lambda m: order.get(m.rpartition(".")[2], 0))) for g in groups.values()]


def rank_bucket(rank: int) -> int:
    """The stack rank an adapter of this rank is held at: the next power of two, at least MIN_RANK."""
    return max(MIN_RANK, 1 << (rank - 1).bit_length())


class Bucket:
    """The adapters of one BucketKey: a stack per module, a row per adapter; rows are reused, and the stacks
    grow (at most doubling) and shrink (compact) as the pool asks."""

    def __init__(self, key: BucketKey, base: BaseView, device: torch.device, packed: bool):
        """packed: siblings' A stacks share one tensor (packed_groups); else every module has its own."""
        self.rank, self.modules = key
        self.modules_of = {m: base.modules[m] for m in self.modules}
        self.device = device
        self.groups = packed_groups(self.modules, base) if packed else [(m,) for m in self.modules]
        self.group_of = {m: (g, i) for g in self.groups for i, m in enumerate(g)}
        """module -> (its group, its place there)."""
        self.a_group: dict[tuple[str, ...], torch.Tensor] = {}
        """group -> [rows, len(group) * R, in]: its modules' A stacks, one block of R each."""
        self.scale_group: dict[tuple[str, ...], torch.Tensor] = {}
        """group -> [rows, len(group)] fp32: each module's scale, a column each."""
        self.a: dict[str, torch.Tensor] = {}
        """module -> [rows, R, in] (a view of its group's): each row's A, zero beyond its own rank."""
        self.bt: dict[str, torch.Tensor] = {}
        """module -> [rows, R, out]: B transposed, read as the kernels' [rows, out, R] through a view, `b` (the CPU
        twin's batched matmul runs twice as fast on this layout)."""
        self.b: dict[str, torch.Tensor] = {}
        """module -> bt[module].transpose(1, 2)."""
        self.scale: dict[str, torch.Tensor] = {}
        """module -> [rows] fp32 (a column of its group's)."""
        self.host: dict[str, HostStacks] = {}
        """module -> its stacks as CPU serving's compiled loop reads them (fp32 on a CPU only), viewed once a
        resize."""
        self.owners: list[int | None] = []
        """row -> the pool slot whose adapter it holds (None: free)."""
        self.row_bytes = bucket_row_bytes(key, base)
        self._resize([], 0)

    @property
    def nbytes(self) -> int:
        return len(self.owners) * self.row_bytes

    @property
    def live(self) -> int:
        return sum(o is not None for o in self.owners)

    def free_row(self) -> int | None:
        return self.owners.index(None) if None in self.owners else None

    def grow(self, rows: int) -> None:
        """Room for `rows` more adapters; rows keep their places."""
        self._resize(list(range(len(self.owners))), len(self.owners) + rows)

    def compact(self) -> dict[int, int]:
        """Free rows give their memory back; live rows move to the front. -> slot -> its new row."""
        live = [r for r, o in enumerate(self.owners) if o is not None]
        owners = [self.owners[r] for r in live]
        self._resize(live, len(live))
        self.owners = owners
        return {slot: row for row, slot in enumerate(owners)}

    def _resize(self, keep: list[int], rows: int) -> None:
        """Stacks of `rows` rows whose first len(keep) rows are the old rows `keep`; the rest free. Free rows are
        left unwritten: no segment reads them, and `put` writes every element of a row it takes."""
        prefix = keep == list(range(len(keep)))  # growing: the old rows stay where they are
        idx = None if prefix else torch.tensor(keep, dtype=torch.long, device=self.device)

        def resized(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
            if keep:
                new[: len(keep)] = old[: len(keep)] if prefix else old.index_select(0, idx)
            return new

        for g in self.groups:
            in_f = matmul_dims(self.modules_of[g[0]])[0]
            dtype = self.modules_of[g[0]].weight.dtype
            a = resized(self.a_group.get(g), torch.empty((rows, len(g) * self.rank, in_f), dtype=dtype,
                                                         device=self.device))
            scale = resized(self.scale_group.get(g), torch.zeros((rows, len(g)), dtype=torch.float32,
                                                                 device=self.device))
            self.a_group[g], self.scale_group[g] = a, scale
            for i, m in enumerate(g):
                self.a[m] = a[:, i * self.rank:(i + 1) * self.rank]
                self.scale[m] = scale[:, i]
        for m, module in self.modules_of.items():
            out_f = matmul_dims(module)[1]
            self.bt[m] = resized(self.bt.get(m), torch.empty((rows, self.rank, out_f), dtype=module.weight.dtype,
                                                             device=self.device))
            self.b[m] = self.bt[m].transpose(1, 2)
            if self.device.type == "cpu" and module.weight.dtype == torch.float32 and len(self.group_of[m][0]) == 1:
                self.host[m] = host_stacks(self.a[m], self.b[m], self.scale[m])
        self.owners = [self.owners[r] for r in keep] + [None] * (rows - len(keep))

    def put(self, row: int, slot: int, variant: LoadedVariant) -> None:
        for m in self.modules:
            a, b = variant.tensors[f"{m}.A"], variant.tensors[f"{m}.B"]  # [r, in], [out, r]
            r = a.shape[0]
            self.a[m][row, :r] = a
            self.bt[m][row, :r] = b.T
            if r < self.rank:  # ranks past its own add nothing
                self.a[m][row, r:] = 0
                self.bt[m][row, r:] = 0
            self.scale[m][row] = variant.scales[m]
        self.owners[row] = slot

    def free(self, row: int) -> None:
        for scale in self.scale.values():
            scale[row] = 0.0
        self.owners[row] = None


def bucket_key(variant: LoadedVariant) -> BucketKey:
    rank = max(variant.tensors[f"{m}.A"].shape[0] for m in variant.scales)
    return rank_bucket(rank), tuple(sorted(variant.scales))


def bucket_row_bytes(key: BucketKey, base: BaseView) -> int:
    """What one adapter of the bucket costs in the pool: its stacks' rows at the bucket's rank."""
    rank, modules = key
    total = 0
    for m in modules:
        w = base.modules[m].weight
        total += rank * (w.shape[0] + w.shape[1]) * w.element_size() + 4
    return total


class AdapterPool(TableSlots):
    family = "lora"
    keep_warm = True

    def __init__(self, base: BaseView, device: torch.device, config: SlotsConfig, family: str = "lora"):
        super().__init__(base, device)
        self.budget = int(config.adapter_mib * MIB)
        self.max_rank = config.max_rank
        self.buckets: dict[BucketKey, Bucket] = {}
        self.place: dict[int, tuple[BucketKey, int]] = {}
        """slot -> (its bucket, its row there)."""
        self._planned: tuple[BatchPlan | None, list[tuple[BucketKey, Bucket]], frozenset[str]] = \
            (None, [], frozenset())
        """The last forward's plan, its buckets, and the modules they target."""
        # Each token reads its own stack row from a per-token map (kernels.lora_by_token: Triton on CUDA, a compiled
        # loop for fp32 on a CPU; half precision on a CPU groups tokens by row instead, kernels.lora_shrink /
        # lora_expand). With fixed_shapes (the runtime's, on CUDA) every bucket's ops run in every forward, the
        # maps in buffers allocated once: the same launches whichever adapters the rows use, so a CUDA graph
        # replays them. Otherwise only the buckets the rows use run.
        self.version = 0
        """Changes whenever a stack or a map buffer is reallocated (a captured graph read the old addresses)."""
        self._maps: dict[tuple[Bucket, int], torch.Tensor] = {}
        """(bucket, tokens) -> [tokens] int32 on the device, each token's row (-1: none), for the plan
        `_maps_of`; prepared ones are views of `_buffers`."""
        self._maps_of: BatchPlan | None = None
        self._buffers: dict[tuple[BucketKey, str], torch.Tensor] = {}
        self.packed = device.type == "cuda"
        """Buckets made from now on pack siblings' A stacks (Bucket): on CUDA, where a launch costs more than the
        shrink's bytes; a CPU's compiled loop does a module whole."""
        self._shrunk: tuple | None = None
        """The last packed shrink, (plan, bucket, group, x, z): the group's other modules reuse its z."""

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets.values())

    def check(self, variant: LoadedVariant) -> None:
        for module in variant.scales:
            rank = variant.tensors[f"{module}.A"].shape[0]
            if rank > self.max_rank:
                raise VariantIncompatible(f"adapter '{variant.name}' has rank {rank} at '{module}'; the slot "
                                          f"maximum is {self.max_rank}")
            dims = matmul_dims(self.base.modules.get(module))
            if dims is None:
                raise VariantIncompatible(f"adapter '{variant.name}': '{module}' is no linear layer of the base")
            got = (variant.tensors[f"{module}.A"].shape[1], variant.tensors[f"{module}.B"].shape[0])
            if got != dims:
                raise VariantIncompatible(f"adapter '{variant.name}' maps {got[0]} -> {got[1]} at '{module}'; the "
                                          f"base's layer maps {dims[0]} -> {dims[1]}")
        need = bucket_row_bytes(bucket_key(variant), self.base)
        if need > self.budget:
            raise VariantIncompatible(f"adapter '{variant.name}' needs {need / MIB:.1f} MiB in the adapter pool; "
                                      f"slots.adapter_mib is {self.budget / MIB:g}")

    # ---- room: bytes, not slots
    def _room(self, variant: LoadedVariant) -> bool:
        """Room for one more row of the variant's bucket: a free row, free budget, or idle adapters evicted
        (least recently used first) and the buckets compacted. False (nothing evicted): its row waits."""
        key = bucket_key(variant)
        bucket = self.buckets.get(key)
        if bucket is not None and bucket.free_row() is not None:
            return True
        need = bucket.row_bytes if bucket is not None else bucket_row_bytes(key, self.base)
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
                self.version += 1
                for slot, row in bucket.compact().items():
                    self.place[slot] = (key, row)

    def _write(self, slot: int, variant: LoadedVariant) -> None:
        key = bucket_key(variant)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = Bucket(key, self.base, self.device, self.packed)
            self.version += 1
        row = bucket.free_row()
        if row is None:
            self.version += 1
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
            self.version += 1

    # ---- forwards
    def _keys(self, plan: BatchPlan) -> list[tuple[BucketKey, Bucket]]:
        """The buckets this forward runs, found once per forward (every wrapped module asks): with fixed shapes
        all of them, else those its rows use."""
        if self._planned[0] is not plan:
            used = self.buckets if self.fixed_shapes else {self.place[s][0] for s in plan.slot_set(self.family)
                                                           if s in self.place}
            self._planned = (plan, [(key, self.buckets[key]) for key in sorted(used)],
                             frozenset(m for key in used for m in key[1]))
        return self._planned[1]

    def prepare(self, plan: BatchPlan) -> None:
        """With fixed shapes, a generation step's per-token rows of every bucket, for all its tokens and for the LM
        head's kept ones, written into buffers allocated once per size: a captured step reads this step's maps."""
        self._maps, self._maps_of = {}, plan
        if not self.fixed_shapes or plan.tokens is None:
            return
        sizes = {"all": sum(plan.tokens)}
        if plan.kept is not None and len(plan.kept) != sizes["all"]:
            sizes["kept"] = len(plan.kept)
        for key, bucket in self._keys(plan):
            for which, n in sizes.items():
                buffer = self._buffer(key, which, n)
                buffer[:n].copy_(self._host_rows(plan, key, n), non_blocking=True)
                self._maps[(bucket, n)] = buffer[:n]

    def _buffer(self, key: BucketKey, which: str, n: int) -> torch.Tensor:
        buffer = self._buffers.get((key, which))
        if buffer is None or buffer.numel() < n:
            size = max(64, 1 << (n - 1).bit_length())
            buffer = self._buffers[(key, which)] = torch.full((size,), NO_SLOT, dtype=torch.int32, device=self.device)
            self.version += 1
        return buffer

    def _host_rows(self, plan: BatchPlan, key: BucketKey, n: int) -> torch.Tensor:
        """[n] int32 on the host: each of a module's n tokens' row in the bucket (NO_SLOT: none)."""
        return torch.tensor([NO_SLOT if s == NO_SLOT else self._row_in(s, key)
                             for s in plan.token_slots(self.family, n)], dtype=torch.int32)

    def _rows(self, plan: BatchPlan, key: BucketKey, bucket: Bucket, n: int) -> torch.Tensor:
        """The prepared map, or (a forward of rows of equal length, not prepared) one built now."""
        if self._maps_of is not plan:
            self._maps, self._maps_of = {}, plan
        rows = self._maps.get((bucket, n))
        if rows is None:
            rows = self._maps[(bucket, n)] = self._host_rows(plan, key, n).to(self.device)
        return rows

    def touches(self, name: str, plan: BatchPlan) -> bool:
        self._keys(plan)
        return name in self._planned[2]

    def apply(self, name: str, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              plan: BatchPlan) -> torch.Tensor:
        x = x.contiguous()  # [N, in]; a pooler reads a strided first token
        by_token = x.is_cuda or x.dtype == torch.float32 or self.fixed_shapes
        for key, bucket in self._keys(plan):
            place = bucket.group_of.get(name)
            if place is None:
                continue
            group, i = place
            if by_token and len(group) > 1:  # the group's shrink, once for all of it; this module's block of z
                rows = self._rows(plan, key, bucket, x.shape[0])
                z = self._group_shrink(bucket, group, x, rows, plan)
                bgmv_expand(z[..., i * bucket.rank:(i + 1) * bucket.rank], bucket.b[name], rows, y)
            elif by_token:
                lora_by_token(x, bucket.a[name], bucket.b[name], bucket.scale[name],
                              self._rows(plan, key, bucket, x.shape[0]), y, bucket.host.get(name))
            else:  # half precision on a CPU (no compiled form): tokens grouped by row, batched matmuls
                seg = plan.remapped_segments(self.family, key, lambda s, key=key: self._row_in(s, key), x.shape[0])
                lora_expand(lora_shrink(x, bucket.a[name], bucket.scale[name], seg), bucket.b[name], seg, y)
        return y

    def _group_shrink(self, bucket: Bucket, group: tuple[str, ...], x: torch.Tensor, rows: torch.Tensor,
                      plan: BatchPlan) -> torch.Tensor:
        """z of every module of the group for input x: the group's first module to see x shrinks for all; its
        siblings, called with the same x in the same forward, read that z."""
        last = self._shrunk
        if last is not None and last[0] is plan and last[1] is bucket and last[2] == group and same_input(last[3], x):
            return last[4]
        z = bgmv_shrink(x, bucket.a_group[group], bucket.scale_group[group], rows)
        self._shrunk = (plan, bucket, group, x, z)  # x held: no other tensor can take its memory meanwhile
        return z

    def _row_in(self, slot: int, key: BucketKey) -> int:
        place = self.place.get(slot)
        return place[1] if place is not None and place[0] == key else NO_SLOT


register_family(AdapterPool)
