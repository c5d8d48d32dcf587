"""Correction families: the slots a base's variants sit in during a forward, and the correction each applies.

A family holds, per base, a small table of slots. A row's variant is attached to a slot before its first
forward and detached when the row leaves; a slot nobody uses keeps its variant (warm) until another needs it,
least recently used first. Each family's `apply` is what a wrapped module adds for the rows of its slots:
- WeightPool ("weights", full variants; serve/engine/families/weight_pool.py): rows of a variant that changed this
module
  run it with the variant's tensors; modules it left alone are the base's, shared with every other row.
- AdapterPool ("lora", LoRA and PiSSA; serve/engine/families/adapter_pool.py): y += s (x A^T) B^T through
  kernels.lora_shrink / lora_expand, adapters held in rank buckets under a byte budget.
- EmrSlots ("emr:<group>", serve/engine/families/emr_slots.py): an EMR group's tasks.
A family is registered (register_family); a kind names the family that applies its rows.
Slots are attached, detached and read on the engine's one compute thread only.
"""

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from serve.engine.step.batch import BatchPlan
from serve.variants.base import BaseView, LoadedVariant

class Slots(ABC):
    """One family's slots on one base: rows attach to a slot before their first forward, detach when they leave."""

    family: str
    """The family's name; a group's own family names the group too ("emr:<group>")."""
    per_entry: ClassVar[bool] = False
    """Each entry (an EMR group) gets slots of its own, "<family>:<entry>", on first use."""
    fixed_shapes: bool = False
    """Set by the runtime: a forward's launches must not depend on which slots its rows use (see prepare)."""
    graphable: ClassVar[bool] = False
    """With fixed shapes, its corrections run as launches that depend only on a step's shapes and on buffers whose
    addresses hold (a change of them changes `version`), so a CUDA graph of the step replays them. A step with rows
    of a family that is not runs eagerly, and the reason is counted."""

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
    def retire(self, key: str) -> None:
        """The store no longer has this revision of the entry (removed, or replaced by another key): an idle slot
        holding it is freed now, not when the least recently used slot is wanted. Memory only: a replaced entry
        is another key, so no slot serves the old contents for the new."""

    def prepare(self, plan: BatchPlan) -> None:
        """Called once per forward before it runs, on the host: write what the forward's modules read from the
        device (per-token maps into static buffers, so a captured step reads this step's). Default: nothing."""

    def claims(self, name: str, plan: BatchPlan, num_tokens: int) -> list[int]:
        """Tokens (of the module's num_tokens) whose output of module `name` this family computes whole in `apply`
        (the base skips them: their base output would be thrown away). Default: none, the family corrects the
        base's output."""
        return []

    @abstractmethod
    def touches(self, name: str, plan: BatchPlan) -> bool:
        """Whether some slot of this forward corrects module `name` (if not, the module runs as the base)."""

    @abstractmethod
    def apply(self, name: str, module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              plan: BatchPlan) -> torch.Tensor:
        """y (the base module's output, [N, out], for the module's N tokens: x [N, in], or [N] token ids for an
        embedding) corrected for this family's tokens; claimed tokens are still to be written.
        plan.groups(family, N) gives each slot's tokens."""


class TableSlots(Slots):
    """A table of slots, each holding one variant; a slot nobody uses is reused, least recently used first."""

    keep_warm: ClassVar[bool]
    """Whether a slot nobody uses keeps its variant for the next row (a copy is worth keeping; a reference
    to tensors the cache may recycle is not)."""

    def __init__(self, base: BaseView, device: torch.device):
        super().__init__(base, device)
        self.names: list[str | None] = []
        self.variants: list[LoadedVariant | None] = []
        self.refs: list[int] = []
        self.last_used: list[int] = []
        self._clock = 0

    @property
    def in_use(self) -> int:
        return sum(self.refs)

    def slot_of(self, key: str) -> int | None:
        return self.names.index(key) if key in self.names else None

    def attach(self, variant: LoadedVariant) -> int | None:
        slot = self.slot_of(variant.key)
        if slot is None:
            if not self._room(variant):
                return None
            slot = self._free_slot()
            self._write(slot, variant)
            self.names[slot], self.variants[slot] = variant.key, variant
        self.refs[slot] += 1
        self._clock += 1
        self.last_used[slot] = self._clock
        return slot

    def detach(self, slot: int) -> None:
        self.refs[slot] -= 1
        self._clock += 1
        self.last_used[slot] = self._clock  # used until now: the least recently used is the longest idle
        if self.refs[slot] == 0 and (not self.keep_warm or self.names[slot] is None):
            self._empty(slot)

    def _empty(self, slot: int) -> None:
        self.names[slot], self.variants[slot] = None, None
        self._clear(slot)

    def retire(self, key: str) -> None:
        slot = self.slot_of(key)
        if slot is not None:
            self.names[slot] = None
            if self.refs[slot] == 0:
                self._empty(slot)

    def _room(self, variant: LoadedVariant) -> bool:
        """Whether the variant can be written now (making room if it can); False: its row waits."""
        return True

    def _free_slot(self) -> int:
        empty = [s for s, r in enumerate(self.refs) if r == 0 and self.names[s] is None]
        if empty:
            return empty[0]
        self.names.append(None)
        self.variants.append(None)
        self.refs.append(0)
        self.last_used.append(0)
        return len(self.names) - 1

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


