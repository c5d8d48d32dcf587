"""The contract of a variant kind, and the registry through which the store, engine, CLI and HTTP reach kinds.

A kind says how a fine-tune is validated and stored (`add`), how it is read into memory (`load`), what it
weighs, and which correction family applies it in the shared forward (`family`): "weights" rows run a module
with the variant's own tensors, "lora" rows add s (x A^T) B^T. The engine holds one set of slots per family
and base (serve/engine/families/slots.py); a new kind either joins a family or brings one.
"""

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, TypeVar

import torch

from serve.config import SlotsConfig
from serve.errors import ArtifactError, BadRequest, ConfigError, ManyfoldError
from serve.store.manifest import VariantEntry
from serve.store.store import Store
from serve.store.tensors import Alloc
from serve.store.view import named_twice

Progress = Callable[[str], None]
Failures = list[tuple[str, ManyfoldError]]
"""(name, why) for each item of a batch that was not added, one line each."""
T = TypeVar("T")
MASKS_SUFFIX = ":masks"
"""An EMR group's tensors: tau_uni under the base tensor's name, its tasks' packed masks under name + this."""


@dataclass(frozen=True)
class BaseView:
    """What loading a variant needs from its resident base: the tensors every variant is a change of."""

    name: str
    tensors: dict[str, torch.Tensor]
    """Canonical name -> tensor as served, on the engine's device (state_dict names)."""
    host: Mapping[str, torch.Tensor]
    """The same tensors in host memory, for decoders (numba, numpy): `tensors` itself on a CPU engine, the
    store's safetensors read on demand on any other device."""
    digests: dict[str, str]
    """Canonical name -> XXH3-128 of the tensor's bytes (what FM-Delta files are checked against)."""
    modules: dict[str, torch.nn.Module]
    """Leaf modules with parameters, by qualified name: what a correction can target."""


def _moved(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t on `device`; from a GPU to the host tier into pinned memory, so that its way back is a DMA copy."""
    if t.is_cuda and torch.device(device).type == "cpu":
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return t.to(device)


@dataclass
class LoadedVariant:
    """A variant in memory, in its family's form. `tensors` is keyed as the family reads it."""

    name: str
    kind: str
    family: str
    tensors: dict[str, torch.Tensor]
    scales: dict[str, float] = field(default_factory=dict)
    """Per target module, for scaled corrections (LoRA's alpha / r)."""
    head: dict[str, torch.Tensor] = field(default_factory=dict)
    """A classifier's own head ("weight", "bias"): heads are per row, never part of the shared forward."""
    labels: list[str] | None = None
    owned: list[torch.Tensor] = field(default_factory=list)
    """Buffers its load took from the engine's pool, returned when it leaves memory."""
    members: dict[str, "LoadedVariant"] = field(default_factory=dict)
    """A group kind's models (an EMR group's tasks, by model id "<group>/<task>"): each is a row's variant,
    with its own head and scales; the tensors they share are the group's."""
    parent: "LoadedVariant | None" = None
    index: int = 0
    """A member's place in its group (an EMR task's index in its bundle)."""
    key: str = ""
    """Its store entry's key, "<name>@<revision>" (VariantEntryBase.key): what slots know it by, so that an entry
    replaced under its name is another variant to them. Empty: its name (a variant built outside a store)."""

    def __post_init__(self) -> None:
        self.key = self.key or self.name

    @property
    def nbytes(self) -> int:
        tensors = [*self.tensors.values(), *self.head.values()]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(m.nbytes for m in self.members.values())

    def to(self, device: torch.device | str) -> "LoadedVariant":
        """Move its tensors, its head and its members' heads (the cache's tiers)."""
        self.tensors = {k: _moved(t, device) for k, t in self.tensors.items()}
        self.head = {k: _moved(t, device) for k, t in self.head.items()}
        for m in self.members.values():
            m.to(device)
        return self

    @property
    def entry(self) -> str:
        """The cache entry that holds it: its own name, or its group's for a member."""
        return self.parent.name if self.parent is not None else self.name

    def member(self, model: str) -> "LoadedVariant":
        """The row's variant for model id `model`: the variant itself, or one of its members."""
        return self if model == self.name else self.members[model]


class VariantKind(ABC):
    """One kind of fine-tune: subclasses set the class attributes and implement add and load."""

    kind: ClassVar[str]
    family: ClassVar[str]
    """The correction family that applies its rows (serve.engine.families.slots.FAMILIES)."""
    help: ClassVar[str]
    """One line for `manyfold store add --kind` and the API docs."""

    @abstractmethod
    def add(self, store: Store, name: str, base: str, path: Path, progress: Progress | None = None,
            slots: SlotsConfig = SlotsConfig()) -> VariantEntry:
        """Validate the fine-tune at `path` against the store's base `base` (and the serving limits in
        `slots`) and store it atomically: either the whole entry is in the manifest afterwards, or nothing is."""

    def add_many(self, store: Store, base: str, items: list[tuple[str, Path]], slots: SlotsConfig = SlotsConfig(),
                 progress: Progress | None = None) -> tuple[list[VariantEntry], Failures]:
        """add() for many (name, path) fine-tunes of one base: one that fails is reported by name and the rest are
        added. -> (entries added, failures). This default adds them one by one, a manifest write each; a kind
        registered by the thousand (lora, pissa) overrides it to write the manifest once per batch."""
        return stage_each(items, lambda name, path: self.add(store, name, base, Path(path), slots=slots), progress)

    @abstractmethod
    def load(self, store: Store, entry: VariantEntry, base: BaseView, alloc: Alloc) -> LoadedVariant:
        """Read a stored variant into memory (runs in a worker thread; new tensors come from alloc)."""

    def verify(self, store: Store, entry: VariantEntry) -> None:
        """Check a stored variant's files (and, where a kind can, that it still reads back whole)."""
        store.verify(entry)

    def extract(self, store: Store, name: str, out_dir: Path) -> Path:
        """Write the variant back out in the form it was added in."""
        raise BadRequest(f"variant kind '{self.kind}' cannot be extracted")

    def reserve_layout(self, store: Store, entry: VariantEntry) -> list[tuple[list[int], torch.dtype]]:
        """(shape, dtype) of the buffers one load of this variant writes, for the engine's pool to keep ready."""
        return []


VARIANT_KINDS: dict[str, VariantKind] = {}


def register_variant(kind: VariantKind) -> VariantKind:
    """Make a kind known to the store, engine, CLI and HTTP (as peft's register_peft_method)."""
    if kind.kind in VARIANT_KINDS:
        raise ConfigError(f"variant kind '{kind.kind}' is registered twice")
    VARIANT_KINDS[kind.kind] = kind
    return kind


def variant_kind(kind: str) -> VariantKind:
    try:
        return VARIANT_KINDS[kind]
    except KeyError:
        known = ", ".join(sorted(VARIANT_KINDS))
        raise BadRequest(f"unknown variant kind '{kind}' (known: {known})") from None


def stage_each(items: list[tuple[str, Path]], stage: Callable[[str, Path], T], progress: Progress | None = None
               ) -> tuple[list[T], Failures]:
    """stage(name, path) for every item of a batch: a ManyfoldError (or an unreadable file) fails that item alone,
    by name, and so does a name the batch holds more than once (all of its items, before any work)."""
    counts = Counter(name for name, _ in items)
    done: list[T] = []
    failed: Failures = []
    for name, path in items:
        try:
            if counts[name] > 1:
                raise named_twice(name, counts[name])
            done.append(stage(name, path))
        except ManyfoldError as e:
            failed.append((name, e))
        except OSError as e:
            failed.append((name, ArtifactError(f"{e.filename or path}: {e.strerror or e}")))
        if progress is not None:
            progress(name)
    return done, failed


def add_batch(store: Store, items: list[tuple[str, str, str, str]], slots: SlotsConfig = SlotsConfig()
              ) -> list[VariantEntry | ManyfoldError]:
    """(name, base, path, kind) items as the admin API takes them, grouped by kind and base, each group added by
    its kind's add_many. A path that is no directory, an unknown kind or base, or a name given twice fails its
    items alone. -> per item, in order, its entry or why it was not added."""
    counts = Counter(name for name, *_ in items)
    out: list[VariantEntry | ManyfoldError | None] = [None] * len(items)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, (name, base, path, kind) in enumerate(items):
        if counts[name] > 1:
            out[i] = named_twice(name, counts[name])
        elif not Path(path).is_dir():
            out[i] = BadRequest(f"path '{path}' is not a directory on the server")
        else:
            groups.setdefault((kind, base), []).append(i)
    for (kind, base), group in groups.items():
        try:
            added, failed = variant_kind(kind).add_many(store, base, [(items[i][0], Path(items[i][2])) for i in group],
                                                        slots=slots)
        except ManyfoldError as e:  # an unknown kind or base: every item of the group
            added, failed = [], [(items[i][0], e) for i in group]
        outcome = {**{e.name: e for e in added}, **dict(failed)}
        for i in group:
            out[i] = outcome[items[i][0]]
    return out  # type: ignore[return-value]  (every item has its outcome by now)
