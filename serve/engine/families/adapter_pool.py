"""The adapter pool (family "lora"): LoRA and PiSSA adapters on the engine's device, bounded by bytes, not by
a count of slots (S-LoRA's unified memory pool).

Each adapter sits in a rank bucket: the adapters whose rank rounds up to the same power of two R (8 at least)
and that target the same modules share one stack per module, A [rows, R, in], B^T [rows, R, out] and
scale [rows], a row per adapter. A forward runs the LoRA ops once per bucket its rows use, over
that bucket's own stack, so rank-8 adapters beside a rank-64 one are multiplied, and held, at rank 8. On CUDA the
A stacks of layers that read one input (a layer's q, k and v; gate and up: SIBLINGS) lie in one tensor, so their
shrink is one launch for all of them (Punica's packed slices) and each layer's expand reads its own block.

The pool's bytes are its stacks' bytes, at most slots.adapter_mib; what a pool of stacks does when an adapter
does not fit, and how its per-token maps are kept, is serve/engine/families/stack_pool.py's. Attached, detached and read
on the engine's compute thread only.
"""

import torch

from kernels import (HostStacks, bgmv_expand, bgmv_shrink, host_stacks, lora_by_token, lora_expand,
                     lora_shrink)
from serve.config import SlotsConfig
from serve.engine.step.batch import BatchPlan
from serve.engine.families.slots import register_family
from serve.engine.families.stack_pool import MIB, StackPool, Stacks
from serve.errors import VariantIncompatible
from serve.variants.base import BaseView, LoadedVariant
from serve.variants.lora import matmul_dims

MIN_RANK = 8

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


class Bucket(Stacks):
    """The adapters of one BucketKey: a stack per module, a row per adapter."""

    def __init__(self, key: BucketKey, base: BaseView, device: torch.device, packed: bool):
        """packed: siblings' A stacks share one tensor (packed_groups); else every module has its own."""
        super().__init__(bucket_row_bytes(key, base), device)
        self.rank, self.modules = key
        self.modules_of = {m: base.modules[m] for m in self.modules}
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
        self._resize([], 0)

    def _resize_stacks(self, keep: list[int], rows: int) -> None:
        for g in self.groups:
            in_f = matmul_dims(self.modules_of[g[0]])[0]
            dtype = self.modules_of[g[0]].weight.dtype
            a = self.resized(self.a_group.get(g), torch.empty((rows, len(g) * self.rank, in_f), dtype=dtype,
                                                              device=self.device), keep)
            scale = self.resized(self.scale_group.get(g), torch.zeros((rows, len(g)), dtype=torch.float32,
                                                                      device=self.device), keep)
            self.a_group[g], self.scale_group[g] = a, scale
            for i, m in enumerate(g):
                self.a[m] = a[:, i * self.rank:(i + 1) * self.rank]
                self.scale[m] = scale[:, i]
        for m, module in self.modules_of.items():
            out_f = matmul_dims(module)[1]
            self.bt[m] = self.resized(self.bt.get(m), torch.empty((rows, self.rank, out_f), dtype=module.weight.dtype,
                                                                  device=self.device), keep)
            self.b[m] = self.bt[m].transpose(1, 2)
            if self.device.type == "cpu" and module.weight.dtype == torch.float32 and len(self.group_of[m][0]) == 1:
                self.host[m] = host_stacks(self.a[m], self.b[m], self.scale[m])

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
        super().free(row)


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


class AdapterPool(StackPool):
    family = "lora"
    pool_name = "adapter pool"
    graphable = True

    def __init__(self, base: BaseView, device: torch.device, config: SlotsConfig, family: str = "lora"):
        super().__init__(base, device, int(config.adapter_mib * MIB), "slots.adapter_mib")
        self.max_rank = config.max_rank
        # Each token reads its own stack row from a per-token map (kernels.lora_by_token: Triton on CUDA, a compiled
        # loop for fp32 on a CPU; half precision on a CPU groups tokens by row instead, kernels.lora_shrink /
        # lora_expand). With fixed_shapes (the runtime's, on CUDA) every bucket's ops run in every forward: the
        # same launches whichever adapters the rows use, so a CUDA graph replays them. Otherwise only the buckets
        # the rows use run.
        self.packed = device.type == "cuda"
        """Buckets made from now on pack siblings' A stacks (Bucket): on CUDA, where a launch costs more than the
        shrink's bytes; a CPU's compiled loop does a module whole."""
        self._shrunk: tuple | None = None
        """The last packed shrink, (plan, bucket, group, x, z): the group's other modules reuse its z."""

    def bucket_key(self, variant: LoadedVariant) -> BucketKey:
        return bucket_key(variant)

    def row_bytes(self, key: BucketKey) -> int:
        return bucket_row_bytes(key, self.base)

    def new_bucket(self, key: BucketKey) -> Bucket:
        return Bucket(key, self.base, self.device, self.packed)

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
        self.check_fits(variant, "adapter")

    # ---- forwards
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
                rows = self.rows(plan, key, x.shape[0])
                z = self._group_shrink(bucket, group, x, rows, plan)
                bgmv_expand(z[..., i * bucket.rank:(i + 1) * bucket.rank], bucket.b[name], rows, y)
            elif by_token:
                lora_by_token(x, bucket.a[name], bucket.b[name], bucket.scale[name], self.rows(plan, key, x.shape[0]),
                              y, bucket.host.get(name))
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


register_family(AdapterPool)
