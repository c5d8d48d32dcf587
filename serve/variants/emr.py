"""EMR-Merging groups (kind "emr"): a bundle from `manyfold emr merge` (serve/codecs/emr.py), served per task.

One store entry holds a group; each task is a model, "<group>/<task>". In memory the group is one cache entry:
tau_uni once, every task's masks still packed, its rescalers and heads. A row of task t runs in the shared
forward with rows of every other kind; its family "emr:<group>" (serve/engine/families/slots.py EmrSlots) adds
lambda_t x (M_t * tau_uni)^T where the group merged a tensor. Adding a group of the same name again replaces
it whole: the new bundle goes to its own directory and the manifest swaps to it in one write.
"""

import shutil
from pathlib import Path

from serve.codecs.emr import BUNDLE_JSON, HEAD_PREFIXES, HEADS_FILE, MASKS_FILE, TAU_FILE, extract, read_bundle
from serve.config import SlotsConfig
from serve.errors import VariantIncompatible
from serve.store.manifest import MEMBER_SEP, EmrTaskEntry, EmrVariantEntry
from serve.store.store import Store
from serve.store.tensors import Alloc
from serve.store.view import file_sha256
from serve.variants.base import MASKS_SUFFIX, BaseView, LoadedVariant, Progress, VariantKind, register_variant


class EmrVariant(VariantKind):
    kind = "emr"
    family = "emr"
    help = "an EMR-Merging bundle (manyfold emr merge): every task served as <group>/<task>"

    def add(self, store: Store, name: str, base: str, path: Path, progress: Progress | None = None,
            slots: SlotsConfig = SlotsConfig()) -> EmrVariantEntry:
        with store.stage() as staged:
            return store.commit(staged, self.stage(store, name, base, path, staged), replace=True)

    def stage(self, store: Store, name: str, base: str, path: Path, staged: Path) -> EmrVariantEntry:
        """Copy the bundle at `path` into `staged`; -> the group's entry. Tasks the group held before keep the
        form `store add --kind auto` recorded for them."""
        bundle = read_bundle(path)  # every file against the bundle's sha256
        m = bundle.manifest
        if m.base_fingerprint != store.base(base).fingerprint:
            raise VariantIncompatible(f"{path}: merged against another base than '{base}' (fingerprints differ)")
        old = store.manifest.variants.get(name)
        forms = {t.name: t.form for t in old.tasks} if isinstance(old, EmrVariantEntry) else {}
        for rel in [*m.files, BUNDLE_JSON]:
            (staged / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path / rel, staged / rel)
        return EmrVariantEntry(name=name, base=base, architecture=m.tasks[0].architecture,
                               raw_bytes=sum(f.bytes for f in m.files.values()),
                               bundle=f"{name}@{file_sha256(path / BUNDLE_JSON)[:12]}",  # a new bundle, a new dir
                               tasks=[EmrTaskEntry(name=t.name, labels=t.labels, form=forms.get(t.name))
                                      for t in m.tasks], files=[])

    def load(self, store: Store, entry: EmrVariantEntry, base: BaseView, alloc: Alloc) -> LoadedVariant:
        store.verify(entry)
        bundle = read_bundle(store.variant_dir(entry), verify=False)  # just checked, as store files
        tau, masks = bundle.tensors(TAU_FILE), bundle.tensors(MASKS_FILE)
        tensors = {}
        for b in tau:
            if b not in base.tensors:
                raise VariantIncompatible(f"EMR group '{entry.name}': tensor '{b}' is not in base '{base.name}'")
            tensors[b] = tau[b].to(base.tensors[b].dtype)
            tensors[b + MASKS_SUFFIX] = masks[b]
        group = LoadedVariant(entry.name, self.kind, f"emr:{entry.key}", tensors, key=entry.key)
        heads = bundle.tensors(HEADS_FILE)
        for k, t in enumerate(bundle.manifest.tasks):
            prefix = f"{t.name}/"
            head = {n[len(prefix):].split(".", 1)[1]: heads[n] for n in heads
                    if n.startswith(prefix) and n[len(prefix):].startswith(HEAD_PREFIXES)}
            model = f"{entry.name}{MEMBER_SEP}{t.name}"
            group.members[model] = LoadedVariant(model, self.kind, group.family, {}, {"rescaler": t.rescaler},
                                                 head, t.labels, parent=group, index=k)
        return group

    def verify(self, store: Store, entry: EmrVariantEntry) -> None:
        store.verify(entry)
        read_bundle(store.variant_dir(entry))

    def extract(self, store: Store, name: str, out_dir: Path) -> Path:
        """`name` is "<group>/<task>": that task's reconstructed model; a group name gives its bundle."""
        group, _, task = name.partition(MEMBER_SEP)
        entry = store.variant(group)
        d = store.variant_dir(group)
        if not task:
            shutil.copytree(d, out_dir, dirs_exist_ok=True)
            return Path(out_dir)
        return extract(d, task, out_dir, base_dir=store.base_dir(entry.base))


register_variant(EmrVariant())
