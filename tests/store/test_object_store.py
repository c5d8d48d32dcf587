"""A store on object storage (S3 on loopback, and memory): bases and adapters added, served through a node's
cache, seen by every other reader once it refreshes; two writers at once lose nothing; a removal is seen
everywhere; `manyfold store add --store s3://...` writes to the bucket, never to a local directory named after it."""

import asyncio
import subprocess
import sys
import threading

import pytest

from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams
from serve.errors import VariantNotFound
from serve.store.node_cache import NodeCache
from serve.store.object_store import ObjectStore
from serve.store.store import open_store
from serve.variants import variant_kind
from tests.models import write_lora, write_tiny_causal


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MANYFOLD_CACHE_DIR", str(tmp_path / "node"))
    return tmp_path / "node"


def test_a_base_and_an_adapter_on_s3_serve_and_a_second_reader_sees_them(s3_bucket, cache_dir, tmp_path):
    url = f"{s3_bucket}/stores/main"
    lm = write_tiny_causal(tmp_path / "lm")
    writer = open_store(url, create=True)
    assert isinstance(writer, ObjectStore)
    reader = open_store(url)  # another replica, opened before the adds
    writer.add_base("lm", lm)
    variant_kind("lora").add(writer, "lm-lora", "lm", write_lora(lm, tmp_path / "lora", seed=1, r=4,
                                                                   targets=["q_proj", "v_proj"]))
    assert reader.refresh() and set(reader.manifest.variants) == {"lm-lora"}
    base = reader.base_dir("lm")
    assert (base / "config.json").read_bytes() == (lm / "config.json").read_bytes()
    assert str(base).startswith(str(cache_dir))  # read through this node's cache
    engine = Engine(ServeConfig(store=url))
    params = SamplingParams(max_tokens=3, temperature=0)

    async def both():
        return await asyncio.gather(engine.complete("lm", params, prompt="the cat"),
                                    engine.complete("lm-lora", params, prompt="the cat"))

    base_answer, lora_answer = asyncio.run(both())
    assert base_answer.token_ids and lora_answer.token_ids
    writer.remove("lm-lora")
    assert reader.refresh()
    with pytest.raises(VariantNotFound):
        reader.resolve("lm-lora")


def test_two_writers_at_once_lose_nothing(tmp_path):
    """Both read generation N and race for N + 1: one wins, the other checks its add again over N + 1 and
    writes N + 2."""
    url = "memory://"
    lm = write_tiny_causal(tmp_path / "lm")
    first = ObjectStore(url, create=True, cache=NodeCache(tmp_path / "a", 1 << 30))
    first.add_base("lm", lm)
    second = ObjectStore.__new__(ObjectStore)  # the same bucket through the same objects (memory:// is per object)
    second.__dict__.update(root=url, objects=first.objects, cache=NodeCache(tmp_path / "b", 1 << 30),
                           manifest=first.manifest, generation=first.generation)
    barrier = threading.Barrier(2)
    real = first.objects.put_new

    waited: set[int] = set()

    def racing(key, data):
        if key.startswith("manifests/") and threading.get_ident() not in waited:
            waited.add(threading.get_ident())
            barrier.wait(timeout=30)  # both writers reach the same generation before either writes it
        return real(key, data)

    first.objects.put_new = racing
    adapters = [write_lora(lm, tmp_path / f"a{i}", seed=i, r=4, targets=["q_proj"]) for i in range(2)]
    threads = [threading.Thread(target=variant_kind("lora").add, args=(s, f"t{i}", "lm", adapters[i]))
               for i, s in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    first.objects.put_new = real
    first.refresh()
    assert set(first.manifest.variants) == {"t0", "t1"}
    assert len(first.objects.keys("manifests")) == first.generation == 4  # empty, base, then one add each


def test_store_add_to_s3_writes_the_bucket_not_a_local_directory(s3_bucket, cache_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lm = write_tiny_causal(tmp_path / "lm")
    url = f"{s3_bucket}/cli"
    add = subprocess.run([sys.executable, "-m", "serve.cli", "store", "add", "--store", url, "--kind", "base",
                          "--name", "lm", "--model", str(lm)], capture_output=True, text=True)
    assert add.returncode == 0, add.stderr
    assert not (tmp_path / "s3:").exists()
    listed = subprocess.run([sys.executable, "-m", "serve.cli", "store", "list", "--store", url, "--json"],
                            capture_output=True, text=True)
    assert listed.returncode == 0 and '"lm"' in listed.stdout, listed.stderr


def test_gc_deletes_only_what_no_reader_within_the_grace_period_can_need(tmp_path):
    import time

    from serve.store.object_store import collect

    store = ObjectStore("memory://", create=True, cache=NodeCache(tmp_path / "node", 1 << 30))
    lm = write_tiny_causal(tmp_path / "lm")
    store.add_base("lm", lm)
    variant_kind("lora").add(store, "gone", "lm", write_lora(lm, tmp_path / "a", seed=1, r=4, targets=["q_proj"]))
    only_gone = {f.sha256 for f in store.variant("gone").files} - {f.sha256 for f in store.base("lm").files}
    store.remove("gone")
    assert collect(store, grace_s=3600)["objects"] == 0  # a reader may still hold the generation that names it
    freed = collect(store, grace_s=3600, now=time.time() + 7200)  # two hours on
    assert freed["objects"] == len(only_gone) and freed["generations"] == 3
    assert store.objects.keys("manifests") == [f"manifests/{store.generation:020d}"]
    held = {k.rsplit("/", 1)[1] for k in store.objects.keys("objects")}
    assert held == {f.sha256 for f in store.base("lm").files}  # the base's objects all stay
    assert (store.base_dir("lm") / "config.json").exists()


def test_an_admin_add_from_an_s3_directory_is_served_and_an_empty_one_is_one_line(s3_bucket, cache_dir, tmp_path):
    from fastapi.testclient import TestClient

    from serve.config import key_digest
    from serve.http.app import build_http_app
    from serve.store.objects import Objects

    lm = write_tiny_causal(tmp_path / "lm")
    open_store(f"{s3_bucket}/store", create=True).add_base("lm", lm)
    adapter = write_lora(lm, tmp_path / "adapter", seed=3, r=4, targets=["q_proj", "v_proj"])
    upload = Objects(f"{s3_bucket}/uploads/tenant-a")  # where a platform put a tenant's adapter
    for f in adapter.rglob("*"):
        if f.is_file():
            upload.put_file(str(f.relative_to(adapter)), f)
    config = ServeConfig(store=f"{s3_bucket}/store", admin_key_sha256=[key_digest("sk-admin")],
                         admin={"sources": [f"{s3_bucket}/uploads/"]})
    admin = {"Authorization": "Bearer sk-admin"}
    with TestClient(build_http_app(Engine(config), config)) as c:
        added = c.post("/v1/admin/variants", headers=admin, json={"name": "tenant-a", "base": "lm", "kind": "lora",
                                                                  "path": f"{s3_bucket}/uploads/tenant-a"})
        assert added.status_code == 201, added.text
        answer = c.post("/v1/completions", json={"model": "tenant-a", "prompt": "the cat", "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        empty = c.post("/v1/admin/variants", headers=admin, json={"name": "tenant-b", "base": "lm", "kind": "lora",
                                                                  "path": f"{s3_bucket}/uploads/nobody"})
    assert empty.status_code == 422 and "nothing there" in empty.json()["error"]["message"]


def test_audit_lines_are_one_object_each_sorted_by_time(s3_bucket, tmp_path):
    import json

    store = ObjectStore(f"{s3_bucket}/store", create=True, cache=NodeCache(tmp_path / "cache", 1 << 30))
    lines = [{"time": f"2025-01-01T00:00:0{s}.000Z", "name": f"n{s}"} for s in (3, 1, 2)] + \
            [{"time": "2025-01-01T00:00:01.000Z", "name": "same time"}]
    for line in lines:
        store.append_audit(line)
    keys = store.objects.keys("audit")
    assert len(keys) == 4 and all(k.startswith("audit/2025-01-01/20250101T00000") for k in keys)
    read = [json.loads(store.objects.read(k)) for k in keys]
    assert [x["time"] for x in read] == sorted(x["time"] for x in lines)
