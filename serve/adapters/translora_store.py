"""`store translora`: move every LoRA / PiSSA adapter of one store base to another with Trans-LoRA, registering
each result as its own adapter (flagged as a transferred student, or as the source adapter kept unchanged)."""

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

from serve.adapters import translora
from serve.adapters.train import LOG_FILE
from serve.adapters.transfer_guard import Comparison, summary
from serve.errors import ArtifactError, ManyfoldError


def transferred_name(name: str, to_base: str) -> str:
    """The store name of `name` moved to `to_base`."""
    return f"{name}.{to_base}"


def register(store, name: str, base: str, path: Path, kind: str, how: str) -> None:
    """Add the adapter at `path` to the store under `name` as `kind`, its entry marked with how Trans-LoRA made it
    (store.manifest's `translora` field), in one atomic commit."""
    from serve.config import SlotsConfig
    from serve.variants import variant_kind

    with store.stage() as staged:
        entry = variant_kind(kind).stage(store, name, base, path, staged, store.base_shapes(base), SlotsConfig())
        store.commit(staged, entry.model_copy(update={"translora": how}))


def transfer_store(store, from_base: str, to_base: str, **options) -> Iterator[tuple[str, str]]:
    """Move every LoRA / PiSSA adapter of `from_base` to `to_base` (move_adapter, each in turn): (outcome, one line
    of news) for each. Each result is registered atomically as its own adapter, named by transferred_name; one
    already there is not redone, so an interrupted run resumes."""
    store.base(from_base)
    store.base(to_base)
    adapters = adapters_of(store, from_base)
    if not adapters:
        yield "skipped", f"'{from_base}' has no adapters"
    for name in adapters:
        yield move_adapter(store, name, to_base, **options)[:2]


def adapters_of(store, base: str) -> list[str]:
    """The LoRA / PiSSA adapters of a base, by name."""
    return sorted(v.name for v in store.manifest.variants.values() if v.base == base and v.kind in ("lora", "pissa"))


def move_adapter(store, name: str, to_base: str, **options) -> tuple[str, str, dict | None]:
    """Move one adapter to `to_base`: (outcome, one line of news, the validation figures the guard compared when
    it ran now), the outcome "moved", "kept" (the source adapter unchanged: the student did not beat it), "done"
    (before), "skipped" (no discriminator beside it) or "failed" (the line says why, a student no better than the
    target alone included; nothing is registered for it)."""
    from pydantic import TypeAdapter, ValidationError

    from serve.store.manifest import Name

    new = transferred_name(name, to_base)
    if new in store.manifest.variants:
        return "done", f"{name}: done before, as '{new}'", None
    try:
        TypeAdapter(Name).validate_python(new)
    except ValidationError:
        return "failed", f"{name}: failed: '{new}' is no valid variant name (at most 64 letters, digits, . _ -)", None
    try:
        translora.read_assets(store.variant_dir(name))
    except ArtifactError:
        return "skipped", f"{name}: skipped: no discriminator beside it (trained without --discriminator)", None
    try:
        return _move(store, name, new, store.variant(name).base, to_base, options)
    except ManyfoldError as e:
        return "failed", f"{name}: failed: {e}", None


def _move(store, name: str, new: str, from_base: str, to_base: str, options: dict) -> tuple[str, str, dict]:
    """Transfer one adapter and register what the guard kept; (outcome, line, the figures it compared)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = translora.transfer(store.base_dir(from_base), store.variant_dir(name), store.base_dir(to_base),
                                    Path(tmp) / "adapter", **options)
        if report.outcome == "unchanged":
            register(store, new, to_base, Path(tmp) / "adapter", store.variant(name).kind, "unchanged")
        else:
            init = json.loads((Path(tmp) / "adapter" / LOG_FILE).read_text())["init"]
            kind = "lora" if init in ("lora", "adapter") else "pissa"  # a student started from an adapter: a LoRA
            register(store, new, to_base, Path(tmp) / "adapter", kind, "student")
    if report.outcome == "unchanged":
        figures = f"validation: {Comparison(**report.compared).figures()}"
        return "kept", f"{name}: kept unchanged as '{new}', not transferred ({figures})", report.compared
    return "moved", (f"{name}: moved to '{new}' ({report.accepted} of {report.attempts} inputs accepted; "
                     f"{summary(report.compared)})"), report.compared
