"""BatchPlan: which variant each row of one forward runs, as slot ids per correction family.

Every row of a forward belongs to at most one variant, and a variant sits in one slot of its family
("weights" for full variants, "lora" for LoRA and PiSSA adapters; see serve/engine/slots.py). The plan keeps,
per family, one slot id per row, NO_SLOT (-1) for rows of the base or of another family.

Worked example: rows [base, lora a, full f, lora b, lora a], with a in lora slot 2, b in lora slot 0 and f in
weights slot 0:
    slot_ids["lora"]    = [-1,  2, -1,  0,  2]
    slot_ids["weights"] = [-1, -1,  0, -1, -1]
A module that sees x of shape [5, 7, hidden] (7 tokens a row) works on 35 tokens: segments("lora", 35) gives
each token its row's slot and groups them by slot: slot 0 -> tokens 21..27, slot 2 -> tokens 7..13, 28..34.
"""

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from kernels import NO_SLOT, Segments, make_segments


@dataclass(frozen=True)
class RowSlot:
    """Where one row's variant sits: a family and a slot in it; family None is the base itself."""

    family: str | None = None
    slot: int = NO_SLOT


BASE_ROW = RowSlot()


class BatchPlan:
    """Built once per forward (on the host, then moved to the engine's device) and read by every wrapped
    module of that forward."""

    def __init__(self, rows: list[RowSlot], device: torch.device | str = "cpu"):
        self.rows = len(rows)
        self.device = torch.device(device)
        self.slot_ids: dict[str, torch.Tensor] = {}
        """family -> [rows] int64 slot ids, only for families with at least one row in this forward."""
        self._host: dict[str, list[int]] = {}
        for family in sorted({r.family for r in rows if r.family is not None}):
            ids = [r.slot if r.family == family else NO_SLOT for r in rows]
            self._host[family] = ids
            self.slot_ids[family] = torch.tensor(ids, dtype=torch.long, device=self.device)
        self._segments: dict[tuple, Segments] = {}
        self._slot_sets: dict[str, frozenset[int]] = {}
        self._groups: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def __contains__(self, family: str) -> bool:
        return family in self.slot_ids

    def segments(self, family: str, num_tokens: int) -> Segments:
        """Tokens of a [rows, num_tokens / rows, ...] input grouped by their row's slot in `family`."""
        key = (family, num_tokens)
        if key not in self._segments:
            ids = self.slot_ids[family].repeat_interleave(self._per_row(num_tokens))  # [num_tokens]
            self._segments[key] = make_segments(ids)
        return self._segments[key]

    def remapped_segments(self, family: str, key: Hashable, remap: Callable[[int], int], num_tokens: int
                          ) -> Segments:
        """Like segments, with each row's slot s read as remap(s) (NO_SLOT: not in this group): a family that
        keeps its slots in several stacks (the adapter pool's rank buckets) gets one Segments per stack, cached
        under `key` for the forward."""
        cache_key = (family, key, num_tokens)
        if cache_key not in self._segments:
            ids = torch.tensor([NO_SLOT if s == NO_SLOT else remap(s) for s in self._host.get(family, ())],
                               dtype=torch.long)  # [rows], built on the host: no device round trip
            self._segments[cache_key] = make_segments(ids.repeat_interleave(self._per_row(num_tokens)), self.device)
        return self._segments[cache_key]

    def _per_row(self, num_tokens: int) -> int:
        per_row = num_tokens // self.rows
        if per_row * self.rows != num_tokens:
            raise ValueError(f"{num_tokens} tokens do not split into {self.rows} rows")
        return per_row

    def slot_set(self, family: str) -> frozenset[int]:
        """The slots of `family` that rows of this forward use."""
        if family not in self._slot_sets:
            self._slot_sets[family] = frozenset(s for s in self._host.get(family, ()) if s != NO_SLOT)
        return self._slot_sets[family]

    def groups(self, family: str) -> list[tuple[int, torch.Tensor]]:
        """(slot, [n] row indices) for every slot of `family` used in this forward, ascending by slot."""
        if family not in self._groups:
            by_slot: dict[int, list[int]] = {}
            for row, slot in enumerate(self._host.get(family, ())):
                if slot != NO_SLOT:
                    by_slot.setdefault(slot, []).append(row)
            self._groups[family] = [(s, torch.tensor(rs, dtype=torch.long, device=self.device))
                                    for s, rs in sorted(by_slot.items())]
        return self._groups[family]
