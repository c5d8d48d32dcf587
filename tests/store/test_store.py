import json

import pytest

from serve.errors import ArtifactError, BadRequest, VariantNotFound
from serve.store.manifest import MANIFEST
from serve.store.store import Store
from serve.store.tensors import save_tensors
from serve.variants.full import add_full_variant, extract_full_variant, load_full_variant
from tests.conftest import finetune_of, same_bits, tiny_state


def model_dir(path, tensors, arch="TinyModel", **config):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": [arch], **config}))
    save_tensors(path / "model.safetensors", tensors, metadata={"format": "pt"})
    return path


@pytest.fixture
def store_with_variant(tmp_path, rng):
    base = tiny_state(rng)
    fine = finetune_of(base, rng)
    store = Store(tmp_path / "store", create=True)
    store.add_base("tiny", model_dir(tmp_path / "base", base))
    ft = model_dir(tmp_path / "ft", fine, arch="TinyForSequenceClassification", id2label={"0": "a", "1": "b", "2": "c"})
    add_full_variant(store, "tiny-ft", "tiny", ft)
    return store, base, fine


def test_added_variant_decodes_bit_identical_and_survives_reopen(store_with_variant, tmp_path):
    store, _, fine = store_with_variant
    reopened = Store(store.root)
    entry = reopened.variant("tiny-ft")
    assert entry.labels == ["a", "b", "c"] and entry.base == "tiny"
    out = load_full_variant(reopened, "tiny-ft")
    assert set(out) == set(fine) and all(same_bits(out[k], fine[k]) for k in fine)
    for e in [*reopened.manifest.bases.values(), *reopened.manifest.variants.values()]:
        reopened.verify(e)
    extracted = extract_full_variant(reopened, "tiny-ft", tmp_path / "extracted")
    assert json.loads((extracted / "config.json").read_text())["architectures"] == ["TinyForSequenceClassification"]


def test_summary_lists_sizes(store_with_variant):
    store, _, _ = store_with_variant
    rows = {r["name"]: r for r in store.summary()}
    assert rows["tiny"]["kind"] == "base" and rows["tiny-ft"]["kind"] == "full"
    assert 0 < rows["tiny-ft"]["stored_bytes"] and rows["tiny-ft"]["raw_bytes"] > 0


def test_tampered_file_fails_verify(store_with_variant):
    store, _, _ = store_with_variant
    path = store.variant_dir("tiny-ft") / "delta.fmd"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="sha256 mismatch"):
        store.verify(store.variant("tiny-ft"))


def test_remove_variant_then_base(store_with_variant):
    store, _, _ = store_with_variant
    with pytest.raises(BadRequest, match="still has variants: tiny-ft"):
        store.remove("tiny")
    store.remove("tiny-ft")
    assert not (store.root / "variants" / "tiny-ft").exists()
    store.remove("tiny")
    assert Store(store.root).manifest.bases == {}
    with pytest.raises(VariantNotFound):
        store.remove("tiny")


def test_duplicate_and_unknown_names(store_with_variant, tmp_path, rng):
    store, base, _ = store_with_variant
    with pytest.raises(BadRequest, match="already has an entry named 'tiny-ft'"):
        add_full_variant(store, "tiny-ft", "tiny", store.base_dir("tiny"))
    with pytest.raises(VariantNotFound, match="no base 'nope'"):
        add_full_variant(store, "x", "nope", store.base_dir("tiny"))


def test_failed_add_leaves_manifest_and_tree_unchanged(store_with_variant, tmp_path, monkeypatch):
    store, base, _ = store_with_variant
    before = (store.root / MANIFEST).read_bytes()
    import serve.variants.full as full

    def boom(*a, **k):
        raise OSError("killed mid-write")

    monkeypatch.setattr(full, "compress", boom)
    with pytest.raises(OSError):
        add_full_variant(store, "tiny-2", "tiny", store.base_dir("tiny"))
    assert (store.root / MANIFEST).read_bytes() == before
    assert not (store.root / "variants" / "tiny-2").exists()
    assert list((store.root / "staging").iterdir()) == []


def test_corrupt_manifest_is_one_clear_error(tmp_path):
    (tmp_path / MANIFEST).write_text('{"format": "manyfold.store", "version": 1, "bases": {"a/b": 1}}')
    with pytest.raises(ArtifactError, match="malformed manifest"):
        Store(tmp_path)
    (tmp_path / MANIFEST).write_text("{")
    with pytest.raises(ArtifactError, match="malformed manifest"):
        Store(tmp_path)
    with pytest.raises(ArtifactError, match="not a Manyfold store"):
        Store(tmp_path / "missing")


def test_missing_model_dir_is_reported(tmp_path):
    store = Store(tmp_path / "s", create=True)
    with pytest.raises(ArtifactError, match="no config.json"):
        store.add_base("x", tmp_path / "nothing")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ArtifactError, match="no model.safetensors"):
        store.add_base("x", tmp_path / "m")


def test_audit_lines_are_appended_one_per_change_and_filed_by_day(tmp_path):
    store = Store(tmp_path / "store", create=True)
    lines = [{"time": f"2025-01-0{d}T0{h}:00:00.000Z", "name": f"n{d}{h}"} for d, h in ((1, 1), (1, 2), (2, 1))]
    for line in lines:
        store.append_audit(line)
    read = {f.name: [json.loads(x) for x in f.read_text().splitlines()] for f in (store.root / "audit").iterdir()}
    assert read == {"2025-01-01.jsonl": lines[:2], "2025-01-02.jsonl": lines[2:]}
