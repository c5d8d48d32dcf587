"""A NeuZip base's coded weights decoded on a GPU, a group of weights a launch: what serve/engine/neuzip/coded.py's
pre-hooks call on a device other than the CPU (serve/engine/neuzip/decoder.py decodes on the CPU).

A GPU decode launch takes about as long as one lane's steps whatever the weight's size, and the host takes about
as long again to issue it (an NVIDIA H200 decoding SmolLM2 a weight a launch: 84 us a weight added to a 64-row
decode step, bench-results/README.md#neuzip-on-a-gpu). So the weights, in model order (a decoder's modules run
in that order), are cut into groups of at most GROUP_ELEMENTS elements (a larger weight is a group of its own),
and the first weight a forward asks for of a group decodes the whole group in one launch, into one buffer that
every group shares; the group's other weights are views of it. A weight asked for out of its group's turn
decodes its group again: only time is lost. The stream orders the work, so outputs are exact: a module's matmul
is queued before the next group's decode overwrites the buffer.
"""

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kernels import DecodeGroup, neuzip_decode_group
from serve.codecs.neuzip_file import Stream

GROUP_ELEMENTS = 1 << 23
"""Elements a group holds at most (16 MiB of bf16 in the shared buffer): two or three of SmolLM2's decoder
layers, one projection of a 7B model's."""


def cut_groups(sizes: dict[str, int], most: int = GROUP_ELEMENTS) -> list[list[str]]:
    """Names in order, cut into runs of at most `most` elements (a larger one alone)."""
    groups: list[list[str]] = []
    total = 0
    for name, n in sizes.items():
        if not groups or total + n > most:
            groups.append([])
            total = 0
        groups[-1].append(name)
        total += n
    return groups


class GroupDecoder:
    """Decodes the coded weights of one model on use, by module name, a group at a time (see the module's
    docstring). What CodedWeights and the runtime call of a decoder: forward, weight, nbytes, decode_s, wait_s,
    close (WeightDecoder's too; its ways of decoding ahead are the CPU's alone)."""

    def __init__(self, streams: dict[str, Stream], device: torch.device, group_elements: int = GROUP_ELEMENTS):
        """streams: each coded weight's stream by the name of its module, in model order."""
        groups = cut_groups({m: s.numel for m, s in streams.items()}, group_elements)
        size = max((sum(streams[m].numel for m in g) for g in groups), default=0)
        self.buffer = torch.empty(size, dtype=torch.bfloat16, device=device)
        self.params: dict[str, torch.nn.Parameter] = {}
        self.group_of: dict[str, int] = {}
        self.groups: list[DecodeGroup] = []
        for i, members in enumerate(groups):
            parts, at = [], 0
            for m in members:
                s = streams[m]
                place = self.buffer[at: at + s.numel]
                self.params[m] = torch.nn.Parameter(place.view(s.shape), requires_grad=False)
                parts.append((s.words, s.offsets, s.table, s.sm, place.view(torch.int16)))
                self.group_of[m] = i
                at += s.numel
            self.groups.append(DecodeGroup(parts, streams[members[0]].bits))
        self._held: int | None = None
        """The group the buffer holds (decoded, or queued to be)."""
        self.decode_s = 0.0
        """Host seconds spent issuing decodes (the GPU runs them asynchronously); wait_s the same, as
        WeightDecoder's readers expect both."""
        self.wait_s = 0.0

    @property
    def nbytes(self) -> int:
        """The shared buffer and the groups' address tables and status."""
        extra = sum(g.meta.numel() * 8 + g.status.numel() * 4 for g in self.groups)
        return self.buffer.numel() * self.buffer.element_size() + extra

    @contextmanager
    def forward(self, tokens: int) -> Iterator[None]:
        """Nothing to choose per forward: the GPU decodes each group when its first weight is asked for."""
        yield

    def weight(self, module: str) -> torch.nn.Parameter:
        """The decoded weight of `module`, valid until a weight of another group is asked for."""
        group = self.group_of[module]
        if group != self._held:
            t0 = time.perf_counter()
            self._held = None  # a decode that raises leaves no group believed held
            neuzip_decode_group(self.groups[group])
            self._held = group
            spent = time.perf_counter() - t0
            self.decode_s += spent
            self.wait_s += spent
        return self.params[module]

    def close(self) -> None:
        """Nothing runs beside the compute thread; the buffer is forgotten as held."""
        self._held = None
