"""Correction families: the slots a base's variants sit in during a forward, and the correction each applies.

A family holds, per base, a small table of slots. A row's variant is attached to a slot before its first
forward and detached when the row leaves; a slot nobody uses keeps its variant (warm) until another needs it,
least recently used first. Each family's `apply` is what a wrapped module adds for the rows of its slots:
- WeightSlots ("weights", full variants): rows of a variant that changed this module run it with the
  variant's tensors; modules it left alone are the base's, shared with every other row.
- AdapterSlots ("lora", LoRA and PiSSA): y += s (x A^T) B^T through kernels.lora_shrink / lora_expand over
  stacked per-slot tensors, zero-padded to the largest rank attached to the module.
- EmrSlots ("emr:<group>", serve/engine/emr_slots.py): an EMR group's tasks.
A family is registered (register_family); a kind names the family that applies its rows.
Slots are attached, detached and read on the engine's one compute thread only.
"""

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
from torch.func import functional_call

from kernels import lora_expand, lora_shrink
from serve.config import SlotsConfig
from serve.engine.batch import BatchPlan
from serve.errors import VariantIncompatible
from serve.variants.base import BaseView, LoadedVariant

RANK_STEP = 8
"""Adapter stacks grow their rank in steps of this, so a new rank rarely reallocates them."""


class Slots(ABC):
    """One family's slots on one base: rows attach to a slot before their first forward, detach when they leave."""

    family: str
    """The family's name; a group's own family names the group too ("emr:<group>")."""
    per_entry: ClassVar[bool] = False
    """Each entry (an EMR group) gets slots of its own, "<family>:<entry>", on first use."""

    def __init__(self, base: BaseView, device: torch.device):
        self.base = base
        self.device = device

    @property
    @abstractmethod
    def in_use(self) -> int:
        """Rows attached now (slot refs): 0 once every row has left."""

    def check(self, variant: LoadedVariant) -> None:
        """Raise VariantIncompatible if the variant can never sit in these slots (called once, at load)."""

    @property
    def nbytes(self) -> int:
        """Memory the slots hold beyond the cache's variants (stacked copies)."""
        return 0

    @abstractmethod
    def attach(self, variant: LoadedVariant) -> int | None:
        """The variant's slot for the next forwards; None when no slot can take it now (the row waits)."""

    @abstractmethod
    def detach(self, slot: int) -> None: ...

    @abstractmethod
    def forget(self, name: str) -> None:
        """The variant was removed or replaced: its slot must not serve the old contents again."""

    @abstractmethod
    def touches(self, name: str, plan: BatchPlan) -> bool:
        """Whether some slot of this forward corrects module `name` (if not, the module runs as the base)."""

    @abstractmethod
    def apply(self, name: str, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              plan: BatchPlan) -> torch.Tensor:
        """y (the base module's output for all rows of the plan) corrected for this family's rows."""


class TableSlots(Slots):
    """A table of slots, each holding one variant; a slot nobody uses is reused, least recently used first."""

    keep_warm: ClassVar[bool]
    """Whether a slot nobody uses keeps its variant for the next row (a copy is worth keeping; a reference
    to tensors the cache may recycle is not)."""

    def __init__(self, base: BaseView, device: torch.device, max_slots: int | None = None):
        super().__init__(base, device)
        self.max_slots = max_slots
        self.names: list[str | None] = []
        self.variants: list[LoadedVariant | None] = []
        self.refs: list[int] = []
        self.last_used: list[int] = []
        self._clock = 0

    @property
    def in_use(self) -> int:
        return sum(self.refs)

    def slot_of(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    def attach(self, variant: LoadedVariant) -> int | None:
        slot = self.slot_of(variant.name)
        if slot is not None and self.variants[slot] is not variant and self.refs[slot] > 0:
            self.names[slot] = None  # replaced under the same name while rows still run the old one
            slot = None
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
        if self.variants[slot] is not variant:  # new, or the same name loaded anew after an eviction
            self.names[slot], self.variants[slot] = None, None
            self._write(slot, variant)
            self.names[slot], self.variants[slot] = variant.name, variant
        self.refs[slot] += 1
        self._clock += 1
        self.last_used[slot] = self._clock
        return slot

    def detach(self, slot: int) -> None:
        self.refs[slot] -= 1
        if self.refs[slot] == 0 and (not self.keep_warm or self.names[slot] is None):
            self._empty(slot)

    def _empty(self, slot: int) -> None:
        self.names[slot], self.variants[slot] = None, None
        self._clear(slot)

    def forget(self, name: str) -> None:
        slot = self.slot_of(name)
        if slot is not None:
            self.names[slot] = None
            if self.refs[slot] == 0:
                self._empty(slot)

    def _free_slot(self) -> int | None:
        idle = [s for s, r in enumerate(self.refs) if r == 0]
        empty = [s for s in idle if self.names[s] is None]
        if empty:
            return empty[0]
        if self.max_slots is None or len(self.names) < self.max_slots:
            self.names.append(None)
            self.variants.append(None)
            self.refs.append(0)
            self.last_used.append(0)
            return len(self.names) - 1
        return min(idle, key=lambda s: self.last_used[s]) if idle else None

    @abstractmethod
    def _write(self, slot: int, variant: LoadedVariant) -> None: ...

    @abstractmethod
    def _clear(self, slot: int) -> None: ...


def tensor_owners(base: BaseView) -> dict[str, list[tuple[str, str]]]:
    """Canonical tensor name -> every (module, parameter) that holds it (tied weights have several). Grouped by
    parameter object, not by storage: a NeuZip base's coded weights are meta placeholders with no storage."""
    owners: dict[int, list[tuple[str, str]]] = {}
    names: dict[int, list[str]] = {}
    for mname, module in base.modules.items():
        for local, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((mname, local))
            names.setdefault(id(p), []).append(f"{mname}.{local}")
    by_name = {n: owners[key] for key, ns in names.items() for n in ns}
    return {n: by_name.get(n, []) for n in base.tensors}


class WeightSlots(TableSlots):
    family = "weights"
    keep_warm = False

    def __init__(self, base: BaseView, device: torch.device, config: SlotsConfig, family: str = "weights"):
        super().__init__(base, device)  # a slot is a reference to the cache's tensors: as many as rows need
        self._owners = tensor_owners(base)
        self.overrides: list[dict[str, dict[str, torch.Tensor]]] = []

    def _write(self, slot: int, variant: LoadedVariant) -> None:
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in variant.tensors.items():
            for mname, local in self._owners.get(name, ()):
                by_module.setdefault(mname, {})[local] = t
        self.overrides.extend({} for _ in range(slot + 1 - len(self.overrides)))
        self.overrides[slot] = by_module

    def _clear(self, slot: int) -> None:
        if slot < len(self.overrides):
            self.overrides[slot] = {}

    def touches(self, name: str, plan: BatchPlan) -> bool:
        return any(name in self.overrides[slot] for slot, _ in plan.groups(self.family))

    def apply(self, name: str, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              plan: BatchPlan) -> torch.Tensor:
        for slot, rows in plan.groups(self.family):
            params = self.overrides[slot].get(name)
            if params:
                y[rows] = functional_call(module, params, (x[rows],))  # [n, ...] with the variant's tensors
        return y


class AdapterSlots(TableSlots):
    family = "lora"
    keep_warm = True

    def __init__(self, base: BaseView, device: torch.device, config: SlotsConfig, family: str = "lora"):
        super().__init__(base, device, config.max_adapters)
        self.max_rank = config.max_rank
        self.a: dict[str, torch.Tensor] = {}
        """module -> [slots, R, in]: every slot's A, zero-padded to the module's largest attached rank R."""
        self.bt: dict[str, torch.Tensor] = {}
        """module -> [slots, R, out]: B transposed, read as lora_expand's [slots, out, R] through a view (the CPU
        twin's batched matmul runs twice as fast on this layout)."""
        self.scale: dict[str, torch.Tensor] = {}
        """module -> [slots] fp32; 0 for a slot whose adapter leaves the module alone."""
        self.holders: dict[str, set[int]] = {}
        """module -> the slots whose adapter corrects it: a forward whose adapters all leave a module alone
        skips it."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.a, self.bt) for t in d.values())

    def check(self, variant: LoadedVariant) -> None:
        for module in variant.scales:
            rank = variant.tensors[f"{module}.A"].shape[0]
            if rank > self.max_rank:
                raise VariantIncompatible(f"adapter '{variant.name}' has rank {rank} at '{module}'; the slot "
                                          f"maximum is {self.max_rank}")
            if not isinstance(self.base.modules.get(module), torch.nn.Linear):
                raise VariantIncompatible(f"adapter '{variant.name}': '{module}' is no linear layer of the base")

    def _ensure(self, module: str, rank: int) -> None:
        """Stacks for `module` with a row per slot in the table and at least `rank` ranks."""
        slots = len(self.names)
        linear = self.base.modules[module]
        if module in self.a and self.a[module].shape[0] >= slots and self.a[module].shape[1] >= rank:
            return
        old_a, old_bt = self.a.get(module), self.bt.get(module)
        r = max(-(-rank // RANK_STEP) * RANK_STEP, old_a.shape[1] if old_a is not None else 0)
        n = max(slots, old_a.shape[0] if old_a is not None else 0)
        w = linear.weight
        a = torch.zeros((n, r, w.shape[1]), dtype=w.dtype, device=self.device)  # [slots, R, in]
        bt = torch.zeros((n, r, w.shape[0]), dtype=w.dtype, device=self.device)  # [slots, R, out]
        scale = torch.zeros(n, dtype=torch.float32, device=self.device)  # [slots]
        if old_a is not None:
            a[: old_a.shape[0], : old_a.shape[1]] = old_a
            bt[: old_bt.shape[0], : old_bt.shape[1]] = old_bt
            scale[: old_a.shape[0]] = self.scale[module]
        self.a[module], self.bt[module], self.scale[module] = a, bt, scale

    def _write(self, slot: int, variant: LoadedVariant) -> None:
        for module in list(self.a):  # every stack gets a row for the slot: kernels index them all by it
            self._ensure(module, 0)
        self._clear(slot)
        for module, s in variant.scales.items():
            a, b = variant.tensors[f"{module}.A"], variant.tensors[f"{module}.B"]  # [r, in], [out, r]
            rank = a.shape[0]
            self._ensure(module, rank)
            self.a[module][slot, :rank] = a
            self.bt[module][slot, :rank] = b.T
            self.scale[module][slot] = s
            self.holders.setdefault(module, set()).add(slot)

    def _clear(self, slot: int) -> None:
        for module in self.a:
            if slot < self.a[module].shape[0]:
                self.a[module][slot].zero_()
                self.bt[module][slot].zero_()
                self.scale[module][slot] = 0.0
            self.holders.get(module, set()).discard(slot)

    def touches(self, name: str, plan: BatchPlan) -> bool:
        return not self.holders.get(name, set()).isdisjoint(plan.slot_set(self.family))

    def apply(self, name: str, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              plan: BatchPlan) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # [tokens, in]
        y2 = y.view(-1, y.shape[-1])  # [tokens, out]
        seg = plan.segments(self.family, x2.shape[0])
        if seg.slots.numel() == 0:
            return y
        z = lora_shrink(x2, self.a[name], self.scale[name], seg)  # [tokens, R] fp32
        lora_expand(z, self.bt[name].transpose(1, 2), seg, y2)
        return y


FAMILIES: dict[str, type[Slots]] = {}
"""Family name (before any ":<entry>") -> its slots class; a family module adds itself (register_family)."""


def register_family(cls: type[Slots]) -> type[Slots]:
    """Make a correction family known to every base (a kind names it in its `family`)."""
    if cls.family in FAMILIES:
        raise ValueError(f"correction family '{cls.family}' is registered twice")
    FAMILIES[cls.family] = cls
    return cls


def family_class(family: str) -> type[Slots]:
    return FAMILIES[family.split(":", 1)[0]]


register_family(WeightSlots)
register_family(AdapterSlots)
