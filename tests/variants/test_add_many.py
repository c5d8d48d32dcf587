"""Adapters registered by the thousand: `store add --from-dir`, the admin batch route, and the kinds' add_many.
One bad adapter is named and the rest go in; the manifest is written once per batch."""

import asyncio
import json
import shutil

import pytest
from fastapi.testclient import TestClient

from serve.cli import main
from serve.config import ServeConfig, key_digest
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams
from serve.http.app import build_http_app
from serve.store import store as store_module
from serve.store.manifest import MANIFEST
from serve.store.store import Store
from serve.variants import variant_kind
from tests.models import write_lora, write_tiny_causal
from tests.variants.test_adapters import _other_base_shapes

ADMIN = "admin-key"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny base and one good adapter of it; each test copies the adapter under the names it needs."""
    root = tmp_path_factory.mktemp("bulk")
    lm = write_tiny_causal(root / "tiny-lm")
    return lm, write_lora(lm, root / "good", seed=1, r=2, targets=["q_proj", "v_proj"])


@pytest.fixture
def store(made, tmp_path) -> Store:
    lm, _ = made
    s = Store(tmp_path / "store", create=True)
    s.add_base("tiny-lm", lm)
    return s


def adapters(made, under, names: list[str], bad: tuple[str, ...] = ()):
    """Copies of the good adapter at under/NAME; those in `bad` sized for another base."""
    under.mkdir(exist_ok=True)
    for name in names:
        shutil.copytree(made[1], under / name)
        if name in bad:
            _other_base_shapes(under / name)
    return under


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_from_dir_adds_every_good_adapter_and_names_the_bad_one(made, store, tmp_path, capsys):
    src = adapters(made, tmp_path / "src", ["t-1", "t-2", "t-3", "t-bad"], bad=("t-bad",))
    (src / ".hidden").mkdir()
    (src / "notes.txt").write_text("not an adapter")
    code, out, err = run(capsys, "store", "add", "--store", str(store.root), "--kind", "lora", "--base", "tiny-lm",
                         "--from-dir", str(src))
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 2, err
    assert lines[0].startswith("t-bad: ") and "another base" in lines[0]
    assert lines[1].startswith("manyfold: error: added 3 of 4 adapters to base 'tiny-lm'")
    assert sorted(Store(store.root).manifest.variants) == ["t-1", "t-2", "t-3"]
    assert not (store.root / "variants" / "t-bad").exists()
    assert not any((store.root / "staging").iterdir())
    code, out, _ = run(capsys, "store", "verify", "--store", str(store.root))
    assert code == 0 and "t-3: ok" in out
    engine = Engine(ServeConfig(store=store.root))
    gen = asyncio.run(engine.complete("t-2", SamplingParams(max_tokens=3, temperature=0), prompt="the cat"))
    assert len(gen.token_ids) >= 1


def test_a_names_file_picks_the_directories_and_names_them(made, store, tmp_path, capsys):
    src = adapters(made, tmp_path / "src", ["u-17", "u-18", "u-19"])
    names = tmp_path / "names.txt"
    names.write_text("# directory  model\nu-17   tenant-a\n\nu-19 tenant-b  # the second\n")
    code, out, err = run(capsys, "store", "add", "--store", str(store.root), "--kind", "pissa", "--base", "tiny-lm",
                         "--from-dir", str(src), "--names", str(names))
    assert code == 0 and err == "" and out.startswith("added 2 of 2 adapters to base 'tiny-lm'")
    variants = Store(store.root).manifest.variants
    assert sorted(variants) == ["tenant-a", "tenant-b"] and variants["tenant-a"].kind == "pissa"


@pytest.mark.parametrize("argv, words", [
    (["--kind", "lora", "--name", "x"], "drop --name and --model"),
    (["--kind", "full"], "--from-dir is for --kind lora or pissa"),
    (["--kind", "lora", "--names", "NAMES", "--name", "x", "--model", "m"], "drop --name"),
])
def test_from_dir_argument_mistakes_are_one_line(store, tmp_path, capsys, argv, words):
    argv = [a.replace("NAMES", str(tmp_path / "n.txt")) for a in argv]
    code, _, err = run(capsys, "store", "add", "--store", str(store.root), "--base", "tiny-lm",
                       "--from-dir", str(tmp_path), *argv)
    assert code == 2 and words in err and err.count("\n") == 1


def test_usage_without_from_dir_is_one_line(store, tmp_path, capsys):
    code, _, err = run(capsys, "store", "add", "--store", str(store.root), "--kind", "lora", "--base", "tiny-lm",
                       "--name", "x")
    assert code == 2 and "needs --name and --model" in err
    code, _, err = run(capsys, "store", "add", "--store", str(store.root), "--kind", "lora", "--base", "tiny-lm",
                       "--name", "x", "--model", str(tmp_path), "--names", str(tmp_path / "n.txt"))
    assert code == 2 and "--names goes with --from-dir" in err
    (tmp_path / "n.txt").write_text("a b c\n")
    code, _, err = run(capsys, "store", "add", "--store", str(store.root), "--kind", "lora", "--base", "tiny-lm",
                       "--from-dir", str(tmp_path), "--names", str(tmp_path / "n.txt"))
    assert code == 2 and "n.txt:1: expected 'DIRECTORY NAME'" in err


def test_a_batch_reads_the_base_once_and_writes_the_manifest_once(made, store, tmp_path, monkeypatch):
    src = adapters(made, tmp_path / "src", [f"v-{i}" for i in range(6)])
    writes, reads = [], []
    real_write, real_shapes = store_module.write_manifest, Store.base_shapes
    monkeypatch.setattr(store_module, "write_manifest", lambda *a: writes.append(1) or real_write(*a))
    monkeypatch.setattr(Store, "base_shapes", lambda self, b: reads.append(b) or real_shapes(self, b))
    added, failed = variant_kind("lora").add_many(store, "tiny-lm", [(p.name, p) for p in sorted(src.iterdir())])
    assert failed == [] and [e.name for e in added] == [f"v-{i}" for i in range(6)]
    assert len(writes) == 1 and reads == ["tiny-lm"]
    assert all(e.files and (store.root / e.files[0].path).is_file() for e in added)
    assert sorted(Store(store.root).manifest.variants) == [f"v-{i}" for i in range(6)]


def test_a_reopened_store_holds_one_list_of_target_modules_for_all(made, store, tmp_path):
    """Every process that serves reads the manifest: 2,000 adapters' copies of one module list were most of it."""
    src = adapters(made, tmp_path / "src", [f"v-{i}" for i in range(3)])
    variant_kind("lora").add_many(store, "tiny-lm", [(p.name, p) for p in sorted(src.iterdir())])
    entries = list(Store(store.root).manifest.variants.values())
    assert entries[0].target_modules and all(e.target_modules is entries[0].target_modules for e in entries)
    on_disk = json.loads((store.root / MANIFEST).read_text())["variants"]["v-0"]["target_modules"]
    assert on_disk == list(entries[0].target_modules)  # still a JSON list in the file


def test_duplicate_and_taken_names_are_refused_by_name(made, store, tmp_path):
    src = adapters(made, tmp_path / "src", ["d-1", "d-2", "d-3", "d-4"])
    lora = variant_kind("lora")
    lora.add(store, "taken", "tiny-lm", src / "d-4")
    items = [("twice", src / "d-1"), ("once", src / "d-2"), ("twice", src / "d-3"), ("taken", src / "d-4"),
             ("not a name", src / "d-4")]
    added, failed = lora.add_many(store, "tiny-lm", items)
    assert [e.name for e in added] == ["once"]
    why = {name: str(e) for name, e in failed}
    assert sorted(why) == ["not a name", "taken", "twice"] and len(failed) == 4
    assert "named 2 times in this batch" in why["twice"] and "already has an entry named 'taken'" in why["taken"]
    assert "not a valid name" in why["not a name"]
    assert sorted(Store(store.root).manifest.variants) == ["once", "taken"]


def test_commit_many_refuses_a_name_the_batch_holds_twice(store, tmp_path):
    """The store's own check, for callers that stage without add_many's."""
    from serve.store.manifest import LoraVariantEntry

    entries = []
    for name in ("x", "x", "y"):
        staged = store.root / "staging" / f"s{len(entries)}"
        staged.mkdir(parents=True)
        (staged / "f").write_bytes(b"bytes")
        entries.append((staged, LoraVariantEntry(name=name, base="tiny-lm", architecture="a", raw_bytes=5, rank=1,
                                                 target_modules=["m"], files=[])))
    added, refused = store.commit_many(entries)
    assert [e.name for e in added] == ["y"] and [n for n, _ in refused] == ["x", "x"]
    assert sorted(Store(store.root).manifest.variants) == ["y"]


def test_the_admin_batch_route_answers_per_item(made, store, tmp_path):
    src = adapters(made, tmp_path / "src", ["a-1", "a-2", "a-bad"], bad=("a-bad",))
    config = ServeConfig(store=store.root, admin_key_sha256=[key_digest(ADMIN)], admin={"sources": [str(tmp_path)]})
    headers = {"Authorization": f"Bearer {ADMIN}"}

    def item(name, path, base="tiny-lm"):
        return {"name": name, "kind": "lora", "base": base, "path": str(path)}

    with TestClient(build_http_app(Engine(config), config)) as c:
        r = c.post("/v1/admin/variants:batch", json={"variants": [item("a-1", src / "a-1"), item("a-2", src / "a-2")]},
                   headers=headers)
        assert r.status_code == 201, r.text
        assert [(d["name"], d["status"], d["model"]["parent"]) for d in r.json()["data"]] == [
            ("a-1", 201, "tiny-lm"), ("a-2", 201, "tiny-lm")]
        body = {"variants": [item("a-3", src / "a-1"), item("a-bad", src / "a-bad"), item("a-1", src / "a-2"),
                             item("a-4", tmp_path / "nowhere"), item("a-5", src / "a-1", base="nope")]}
        r = c.post("/v1/admin/variants:batch", json=body, headers=headers)
        assert r.status_code == 207, r.text
        data = r.json()["data"]
        assert [(d["name"], d["status"]) for d in data] == [("a-3", 201), ("a-bad", 422), ("a-1", 400), ("a-4", 400),
                                                          ("a-5", 404)]
        assert "another base" in data[1]["error"]["message"] and data[1]["model"] is None
        assert "already has an entry named 'a-1'" in data[2]["error"]["message"]
        ids = {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert {"a-1", "a-2", "a-3"} <= ids and not {"a-bad", "a-4", "a-5"} & ids
        out = c.post("/v1/completions", json={"model": "a-3", "prompt": "the cat", "max_tokens": 2})
        assert out.status_code == 200, out.text
        assert c.post("/v1/admin/variants:batch", json={"variants": []}, headers=headers).status_code == 422
        assert c.post("/v1/admin/variants:batch", json=body).status_code == 401
