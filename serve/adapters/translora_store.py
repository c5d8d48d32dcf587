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
    """Move every LoRA / PiSSA adapter of `from_base` to `to_base`: (outcome, one line of news) for each, the
    outcome "moved", "kept" (the source adapter unchanged: the student did not beat it), "done" (before),
    "skipped" (no discriminator beside it) or "failed" (the line says why, a student no better than the target
    alone included; nothing is registered for it, the others still move). Each result is registered atomically
    as its own adapter, named by transferred_name; one already there is not redone, so an interrupted run
    resumes."""
    from pydantic import TypeAdapter, ValidationError

    from serve.store.manifest import Name

    store.base(from_base)
    store.base(to_base)
    adapters = sorted(v.name for v in store.manifest.variants.values()
                      if v.base == from_base and v.kind in ("lora", "pissa"))
    if not adapters:
        yield "skipped", f"'{from_base}' has no adapters"
    for name in adapters:
        new = transferred_name(name, to_base)
        if new in store.manifest.variants:
            yield "done", f"{name}: done before, as '{new}'"
            continue
        try:
            TypeAdapter(Name).validate_python(new)
        except ValidationError:
            yield "failed", f"{name}: failed: '{new}' is no valid variant name (at most 64 letters, digits, . _ -)"
            continue
        try:
            translora.read_assets(store.variant_dir(name))
        except ArtifactError:
            yield "skipped", f"{name}: skipped: no discriminator beside it (trained without --discriminator)"
            continue
        try:
            yield _move(store, name, new, from_base, to_base, options)
        except ManyfoldError as e:
            yield "failed", f"{name}: failed: {e}"


def _move(store, name: str, new: str, from_base: str, to_base: str, options: dict) -> tuple[str, str]:
    """Transfer one adapter and register what the guard kept; (outcome, line)."""
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
        return "kept", f"{name}: kept unchanged as '{new}', not transferred ({figures})"
    return "moved", (f"{name}: moved to '{new}' ({report.accepted} of {report.attempts} inputs accepted; "
                     f"{summary(report.compared)})")
