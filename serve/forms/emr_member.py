"""A fine-tune as one more task of an existing EMR group: the group re-merged with it.

The group keeps no fine-tunes, only tau_uni, masks and rescalers; its tasks are re-merged from what it serves for
each (`emr extract`), with the new fine-tune beside them. The re-merge changes what the group serves for its
other tasks too (a new tau_uni elected with one more vote): the caller says so where it registers one.
"""

from dataclasses import dataclass
from pathlib import Path

from serve.codecs.emr import extract, merge
from serve.store.manifest import EmrVariantEntry
from serve.store.store import Store


@dataclass(frozen=True)
class Remerged:
    group: str
    task: str
    """The fine-tune's name in the group."""
    bundle: Path
    """The re-merged bundle, ready for the group's entry to be replaced by it."""
    model_dir: Path
    """The new task as the re-merged group serves it: a HF model directory, for measuring."""
    added_bytes: int
    """What the group's files grow by (a 1-bit mask per merged weight, a head, a scalar; tau_uni may change)."""


def groups_for(store: Store, base: str, architecture: str, task: str) -> list[EmrVariantEntry]:
    """EMR groups of `base` whose tasks share the fine-tune's architecture and have no task named `task`."""
    return [v for v in store.manifest.variants.values()
            if isinstance(v, EmrVariantEntry) and v.base == base and v.architecture == architecture
            and all(t.name != task for t in v.tasks)]


def remerge(store: Store, group: EmrVariantEntry, task: str, finetuned: Path, work: Path) -> Remerged:
    """Merge the group's tasks, as it serves them, with `finetuned` as `task`, into a bundle under `work`."""
    base_dir = store.base_dir(group.base)
    group_dir = store.variant_dir(group.name)
    tasks: dict[str, Path] = {t.name: extract(group_dir, t.name, work / "tasks" / t.name, base_dir=base_dir)
                              for t in group.tasks}
    tasks[task] = finetuned
    bundle = merge(base_dir, tasks, work / "bundle")
    new_bytes = sum(f.bytes for f in bundle.manifest.files.values())
    model_dir = extract(work / "bundle", task, work / "member", base_dir=base_dir)
    return Remerged(group.name, task, work / "bundle", model_dir, new_bytes - group.raw_bytes)
