"""Per-token maps for fixed-shape corrections: each token of a forward names its row in one of a family's stacks
(-1: none), so a family's launches depend only on the number of tokens, never on which variants the rows run.

A generation step's maps are written once per step (`prepare`, on the host, before the forward) into device
buffers allocated once per size, for all of the step's tokens and for the LM head's kept ones: a captured step
(serve/engine/step/graphs.py) reads, at its next replay, the maps that replay's prepare wrote (vLLM's
LoRAKernelMeta). A buffer that must grow is a new address, so `version` changes and a graph reading the old one is
captured again. Forwards that are not steps (encoders) get their maps built on first use instead (`get`).
"""

from collections.abc import Callable, Hashable, Mapping

import torch

from serve.engine.step.batch import BatchPlan

HostRows = Callable[[int], list[int]]
"""n -> each of a module's n tokens' row (-1: none), built on the host from the plan."""


class TokenMaps:
    def __init__(self, device: torch.device):
        self.device = device
        self.version = 0
        """Changes whenever a buffer is reallocated."""
        self._buffers: dict[tuple[Hashable, str], torch.Tensor] = {}
        self._maps: dict[tuple[Hashable, int], torch.Tensor] = {}
        """(key, tokens) -> [tokens] int32 on the device, for the plan `_plan`; prepared ones are buffer views."""
        self._plan: BatchPlan | None = None

    def prepare(self, plan: BatchPlan, rows: Mapping[Hashable, HostRows]) -> None:
        """Each key's map for a generation step's tokens, and for the LM head's kept ones, into its buffers."""
        self._maps, self._plan = {}, plan
        if plan.tokens is None:
            return
        sizes = {"all": sum(plan.tokens)}
        if plan.kept is not None and len(plan.kept) != sizes["all"]:
            sizes["kept"] = len(plan.kept)
        for key, host_rows in rows.items():
            for which, n in sizes.items():
                buffer = self._buffer(key, which, n)
                buffer[:n].copy_(torch.tensor(host_rows(n), dtype=torch.int32), non_blocking=True)
                self._maps[(key, n)] = buffer[:n]

    def get(self, plan: BatchPlan, key: Hashable, n: int, host_rows: HostRows) -> torch.Tensor:
        """The prepared map of n tokens, or (a forward of rows of equal length, not prepared) one built now."""
        if self._plan is not plan:
            self._maps, self._plan = {}, plan
        rows = self._maps.get((key, n))
        if rows is None:
            rows = self._maps[(key, n)] = torch.tensor(host_rows(n), dtype=torch.int32).to(self.device)
        return rows

    def forget(self, key: Hashable) -> None:
        """A key gone for good (its stack freed): its buffers go too."""
        for k in [k for k in self._buffers if k[0] == key]:
            del self._buffers[k]

    def _buffer(self, key: Hashable, which: str, n: int) -> torch.Tensor:
        buffer = self._buffers.get((key, which))
        if buffer is None or buffer.numel() < n:
            size = max(64, 1 << (n - 1).bit_length())
            buffer = self._buffers[(key, which)] = torch.full((size,), -1, dtype=torch.int32, device=self.device)
            self.version += 1
        return buffer
