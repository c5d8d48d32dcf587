"""Full fine-tunes stored losslessly as FM-Delta files against their base (kind "full").

In the shared forward a full variant is a weight set: its rows run each module it changed with its own
tensors (family "weights"); every module it left alone is the base's, shared with all other rows.
"""

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from serve.codecs.fmdelta_file import CompressStats, FmdFile, compress, match_base_name
from serve.config import SlotsConfig
from serve.errors import ArtifactError, VariantIncompatible
from serve.store.manifest import FullVariantEntry
from serve.store.model_dir import architecture_of, classifier_labels, is_tokenizer_file, read_model_config
from serve.store.store import Store
from serve.store.tensors import DTYPES, Alloc, SafetensorsSource, save_tensors
from serve.variants.base import (
    BaseView,
    LoadedVariant,
    Progress,
    VariantKind,
    register_variant,
)

DELTA_FILE = "delta.fmd"
_CONFIG_FILES = ("config.json", "generation_config.json")


def add_full_variant(store: Store, name: str, base: str, finetuned: str | Path, workers: int | None = None,
                     progress: Callable[[str], None] | None = None) -> tuple[FullVariantEntry, CompressStats]:
    """Store the HF model directory `finetuned` as an FM-Delta variant of the store's base `base`."""
    with store.stage() as staged:
        entry, stats = stage_full_variant(store, name, base, Path(finetuned), staged, workers, progress)
        return store.commit(staged, entry), stats


def stage_full_variant(store: Store, name: str, base: str, finetuned: Path, staged: Path, workers: int | None = None,
                       progress: Callable[[str], None] | None = None) -> tuple[FullVariantEntry, CompressStats]:
    """Code the fine-tune's FM-Delta file into `staged`; -> its entry, which the store's commit completes."""
    config = read_model_config(finetuned)
    base_entry = store.base(base)
    fine = SafetensorsSource(finetuned)
    stats = compress(SafetensorsSource(store.base_dir(base)), fine, staged / DELTA_FILE, metadata=fine.metadata,
                     workers=workers, progress=progress)
    if stats.base_fingerprint != base_entry.fingerprint:
        raise VariantIncompatible(f"store base '{base}' changed on disk since it was added")
    for f in _CONFIG_FILES:
        if (finetuned / f).is_file():
            shutil.copy2(finetuned / f, staged / f)
    entry = FullVariantEntry(name=name, base=base, architecture=architecture_of(config, finetuned),
                             raw_bytes=stats.raw_bytes, labels=classifier_labels(config), files=[])
    return entry, stats


def changed_layout(delta_file: Path) -> list[tuple[list[int], torch.dtype]]:
    """(shape, dtype) of each tensor an FM-Delta file changed: what serving it decodes (the rest are the base's)."""
    return [(r.shape, DTYPES[r.dtype]) for r in FmdFile(delta_file).records.values() if r.codec != "same"]


def resident_bytes(delta_file: Path) -> int:
    """What serving an FM-Delta variant holds in memory: the tensors it changed, decoded."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in changed_layout(delta_file))


HEAD_PREFIXES = ("classifier.",)
"""Tensors of a BertForSequenceClassification fine-tune that are its own head, not base weights."""


def split_variant(tensors: dict[str, torch.Tensor], base: BaseView) -> tuple[dict[str, torch.Tensor], dict]:
    """A full fine-tune's decoded tensors -> (base tensors it changed, by canonical name; its head).

    Only the tensors the fine-tune changed are decoded (FullVariant.load skips the file's "same" records): every
    row keeps using the base's module for the rest.
    """
    weights, head = {}, {}
    names = set(base.tensors)
    for name, t in tensors.items():
        target = match_base_name(name, names)
        if target is None:
            if not name.startswith(HEAD_PREFIXES):
                raise VariantIncompatible(f"tensor '{name}' matches nothing in base '{base.name}'")
            head[name.split(".", 1)[1]] = t
            continue
        base_t = base.tensors[target]
        if t.shape != base_t.shape:
            raise VariantIncompatible(f"tensor '{name}' is {list(t.shape)}; base '{base.name}' has "
                                      f"{list(base_t.shape)}")
        weights[target] = t.to(base_t.dtype)
    return weights, head


def _delta_file(store: Store, name: str) -> FmdFile:
    entry = store.variant(name)
    if entry.kind != "full":
        raise ArtifactError(f"variant '{name}' is of kind '{entry.kind}', not 'full'")
    return FmdFile(store.variant_dir(name) / DELTA_FILE)


def load_full_variant(store: Store, name: str, workers: int | None = None) -> dict[str, torch.Tensor]:
    """Decode a full variant's tensors, bit-identical to the fine-tune that was added."""
    base = SafetensorsSource(store.base_dir(store.variant(name).base))
    return _delta_file(store, name).decode_all(base, workers=workers)


def extract_full_variant(store: Store, name: str, out_dir: str | Path, workers: int | None = None) -> Path:
    """Write a full variant back out as a HF model directory (config + model.safetensors + the base's tokenizer)."""
    out_dir = Path(out_dir)
    fmd = _delta_file(store, name)
    entry = store.variant(name)
    tensors = fmd.decode_all(SafetensorsSource(store.base_dir(entry.base)), workers=workers)
    out_dir.mkdir(parents=True, exist_ok=True)
    base_dir = store.base_dir(entry.base)
    for p in base_dir.iterdir():
        if p.is_file() and is_tokenizer_file(p.name):
            shutil.copy2(p, out_dir / p.name)
    for f in _CONFIG_FILES:
        if (store.variant_dir(name) / f).is_file():
            shutil.copy2(store.variant_dir(name) / f, out_dir / f)
    save_tensors(out_dir / "model.safetensors", tensors, metadata=fmd.header.metadata or None)
    return out_dir


class FullVariant(VariantKind):
    kind = "full"
    family = "weights"
    help = "a full fine-tune (HF model directory), stored as an FM-Delta file against its base"

    def add(self, store: Store, name: str, base: str, path: Path, progress: Progress | None = None,
            slots: SlotsConfig = SlotsConfig()) -> FullVariantEntry:
        return add_full_variant(store, name, base, path, progress=progress)[0]

    def verify(self, store: Store, entry: FullVariantEntry) -> None:
        store.verify(entry)
        load_full_variant(store, entry.name)  # every tensor decoded and checked against its digest

    def load(self, store: Store, entry: FullVariantEntry, base: BaseView, alloc: Alloc) -> LoadedVariant:
        fmd = FmdFile(store.variant_dir(entry) / DELTA_FILE)
        changed = [n for n, r in fmd.records.items() if r.codec != "same"]  # the rest is the base's, shared
        tensors = fmd.decode_all(base.host, names=changed, base_digests=base.digests, alloc=alloc)
        weights, head = split_variant(tensors, base)
        return LoadedVariant(entry.name, self.kind, self.family, weights, head=head, labels=entry.labels,
                             key=entry.key)

    def extract(self, store: Store, name: str, out_dir: Path) -> Path:
        return extract_full_variant(store, name, out_dir)

    def reserve_layout(self, store: Store, entry: FullVariantEntry) -> list[tuple[list[int], torch.dtype]]:
        return changed_layout(store.variant_dir(entry) / DELTA_FILE)


register_variant(FullVariant())
