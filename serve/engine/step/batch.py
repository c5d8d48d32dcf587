"""BatchPlan: which variant each row of one forward runs, as slot ids per correction family, and which tokens are
whose.

Every row of a forward belongs to at most one variant, and a variant sits in one slot of its family
("weights" for full variants, "lora" for LoRA and PiSSA adapters; see serve/engine/families/slots.py). The plan keeps,
per family, one slot id per row, NO_SLOT (-1) for rows of the base or of another family.

A forward lays its tokens out one of two ways, and the plan maps a module's tokens to rows either way:
- rows of equal length ([rows, seq, ...]: encoders, benchmarks): each row's seq tokens in turn;
- one flattened sequence ([1, T, ...]: a generation step, `tokens` given): row i's tokens[i] tokens in turn,
  a decode row one token, a prefill chunk many. The LM head reads only the `kept` tokens (those whose logits a
  row samples from), so a module that sees len(kept) tokens maps them through `kept`.

Worked example: rows [base, lora a, full f, lora b, lora a], with a in lora slot 2, b in lora slot 0 and f in
weights slot 0:
    slot_ids["lora"]    = [-1,  2, -1,  0,  2]
    slot_ids["weights"] = [-1, -1,  0, -1, -1]
A module that sees x of shape [5, 7, hidden] (7 tokens a row) works on 35 tokens: segments("lora", 35) gives
each token its row's slot and groups them by slot: slot 0 -> tokens 21..27, slot 2 -> tokens 7..13, 28..34.
The same rows as a generation step with tokens [1, 1, 4, 1, 1] (row 2 prefilling four tokens) and kept
[0, 1, 5, 6, 7]: segments("lora", 8) puts slot 0 -> token 6, slot 2 -> tokens 1, 7; the LM head's 5 tokens
are the rows in order.
"""

from collections.abc import Callable, Hashable, Sequence
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
    """Built once per forward on the host and read by every wrapped module of that forward."""

    def __init__(self, rows: list[RowSlot], device: torch.device | str = "cpu", tokens: Sequence[int] | None = None,
                 kept: Sequence[int] | None = None):
        """tokens: a flattened forward's tokens per row (None: rows of equal length); kept: the token indices the
        LM head reads, in order (None: every token)."""
        self.rows = len(rows)
        self.device = torch.device(device)
        self.tokens = list(tokens) if tokens is not None else None
        self.kept = list(kept) if kept is not None else None
        self._host: dict[str, list[int]] = {}
        """family -> [rows] slot ids, only for families with at least one row in this forward."""
        for family in sorted({r.family for r in rows if r.family is not None}):
            self._host[family] = [r.slot if r.family == family else NO_SLOT for r in rows]
        self._row_of_token: list[int] | None = None
        if self.tokens is not None:
            if len(self.tokens) != self.rows:
                raise ValueError(f"{len(self.tokens)} token counts for {self.rows} rows")
            self._row_of_token = [r for r, n in enumerate(self.tokens) for _ in range(n)]
        self._by_token: dict[tuple, list[int]] = {}
        self._segments: dict[tuple, Segments] = {}
        self._slot_sets: dict[str, frozenset[int]] = {}
        self._groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}

    @property
    def families(self) -> list[str]:
        """The families with rows in this forward."""
        return list(self._host)

    def __contains__(self, family: str) -> bool:
        return family in self._host

    def rows_of(self, num_tokens: int) -> list[int]:
        """The row of each of a module's num_tokens tokens."""
        key = ("rows", num_tokens)
        if key not in self._by_token:
            order = self._row_of_token
            if order is None:
                per_row = num_tokens // max(self.rows, 1)
                if per_row * self.rows != num_tokens:
                    raise ValueError(f"{num_tokens} tokens do not split into {self.rows} rows")
                order = [r for r in range(self.rows) for _ in range(per_row)]
            elif num_tokens != len(order):
                if self.kept is None or num_tokens != len(self.kept):
                    raise ValueError(f"a module saw {num_tokens} tokens; the step has {len(order)} (and keeps "
                                     f"{len(self.kept) if self.kept is not None else 'all'})")
                order = [order[k] for k in self.kept]
            self._by_token[key] = order
        return self._by_token[key]

    def token_slots(self, family: str, num_tokens: int) -> list[int]:
        """The slot in `family` of each of a module's num_tokens tokens (NO_SLOT: not of this family)."""
        key = (family, num_tokens)
        if key not in self._by_token:
            ids = self._host.get(family)
            self._by_token[key] = ([ids[r] for r in self.rows_of(num_tokens)] if ids is not None
                                   else [NO_SLOT] * num_tokens)
        return self._by_token[key]

    def segments(self, family: str, num_tokens: int) -> Segments:
        """A module's num_tokens tokens grouped by their row's slot in `family`."""
        key = (family, num_tokens)
        if key not in self._segments:
            ids = torch.tensor(self.token_slots(family, num_tokens), dtype=torch.long)
            self._segments[key] = make_segments(ids, self.device)
        return self._segments[key]

    def remapped_segments(self, family: str, key: Hashable, remap: Callable[[int], int], num_tokens: int
                          ) -> Segments:
        """Like segments, with each slot s read as remap(s) (NO_SLOT: not in this group): a family that keeps its
        slots in several stacks (the adapter pool's rank buckets) gets one Segments per stack, cached under `key`
        for the forward."""
        cache_key = (family, key, num_tokens)
        if cache_key not in self._segments:
            ids = torch.tensor([NO_SLOT if s == NO_SLOT else remap(s) for s in self.token_slots(family, num_tokens)],
                               dtype=torch.long)  # built on the host: no device round trip
            self._segments[cache_key] = make_segments(ids, self.device)
        return self._segments[cache_key]

    def slot_set(self, family: str) -> frozenset[int]:
        """The slots of `family` that rows of this forward use."""
        if family not in self._slot_sets:
            self._slot_sets[family] = frozenset(s for s in self._host.get(family, ()) if s != NO_SLOT)
        return self._slot_sets[family]

    def groups(self, family: str, num_tokens: int) -> list[tuple[int, torch.Tensor]]:
        """(slot, token indices) for every slot of `family` used in this forward, ascending by slot, among a
        module's num_tokens tokens."""
        key = (family, num_tokens)
        if key not in self._groups:
            by_slot: dict[int, list[int]] = {}
            for i, slot in enumerate(self.token_slots(family, num_tokens)):
                if slot != NO_SLOT:
                    by_slot.setdefault(slot, []).append(i)
            self._groups[key] = [(s, torch.tensor(idx, dtype=torch.long, device=self.device))
                                 for s, idx in sorted(by_slot.items())]
        return self._groups[key]
