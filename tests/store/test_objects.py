"""A store's objects on a local directory, in memory and on S3 (moto's server on loopback): written once, read
whole or not at all, checked against their digest; and a node's cache of them: one download per object however
many replicas ask at once, nothing read again where the cache holds it, least recently used out first."""

import hashlib
import threading

import pytest

from serve.errors import ArtifactError, ConfigError
from serve.store.manifest import FileEntry
from serve.store.node_cache import NodeCache
from serve.store.objects import Objects


@pytest.fixture(params=["dir", "memory", "s3"])
def objects(request, tmp_path) -> Objects:
    if request.param == "dir":
        return Objects(tmp_path / "store")
    if request.param == "memory":
        return Objects("memory://")
    return Objects(request.getfixturevalue("s3_bucket") + "/some/prefix")


def put_blob(objects: Objects, tmp_path, data: bytes) -> FileEntry:
    digest = hashlib.sha256(data).hexdigest()
    src = tmp_path / f"src-{digest[:8]}"
    src.write_bytes(data)
    objects.put_file(f"objects/{digest}", src)
    return FileEntry(path=f"weights/{digest[:8]}.bin", bytes=len(data), sha256=digest)


def test_a_key_is_written_once_and_read_whole(objects, tmp_path):
    assert objects.put_new("manifests/00000000000000000001", b"first")
    assert not objects.put_new("manifests/00000000000000000001", b"second")  # put-if-absent: the first stays
    assert objects.read("manifests/00000000000000000001") == b"first"
    objects.put_new("manifests/00000000000000000002", b"next")
    objects.put_new("other/x", b"elsewhere")
    assert objects.keys("manifests") == ["manifests/00000000000000000001", "manifests/00000000000000000002"]
    assert objects.keys("manifests", after="manifests/00000000000000000001") == ["manifests/00000000000000000002"]
    blob = put_blob(objects, tmp_path, b"x" * 100_000)
    dest = tmp_path / "out" / "blob"
    assert objects.download(f"objects/{blob.sha256}", dest, blob.sha256) == 100_000
    assert dest.read_bytes() == b"x" * 100_000
    objects.delete(f"objects/{blob.sha256}")
    assert not objects.exists(f"objects/{blob.sha256}")
    with pytest.raises(ArtifactError, match=f"object 'objects/{blob.sha256}' is missing"):
        objects.read(f"objects/{blob.sha256}")


def test_a_download_whose_bytes_do_not_match_their_digest_leaves_nothing(objects, tmp_path):
    objects.put_new("objects/" + "0" * 64, b"not what the name says")
    dest = tmp_path / "out" / "blob"
    with pytest.raises(ArtifactError, match="has sha256 .*, expected 000000000000"):
        objects.download("objects/" + "0" * 64, dest, "0" * 64)
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def test_an_unknown_scheme_is_one_clear_line_not_a_directory_named_after_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="store ftp://host/store: unknown scheme; expected a local path or one of s3://"):
        Objects("ftp://host/store")
    assert list(tmp_path.iterdir()) == []


class CountingObjects(Objects):
    """Objects that count downloads and hold each until released: replicas asking at once really overlap."""

    def __init__(self, location, release: threading.Event | None = None):
        super().__init__(location)
        self.downloads = 0
        self.release = release

    def download(self, key, dest, sha256=None, progress=None):
        self.downloads += 1
        if self.release is not None:
            self.release.wait(timeout=30)
        return super().download(key, dest, sha256, progress)


def test_replicas_asking_for_one_object_at_once_share_one_download(tmp_path):
    release = threading.Event()
    objects = CountingObjects(tmp_path / "store", release)
    blob = put_blob(objects, tmp_path, b"weights" * 1000)
    caches = [NodeCache(tmp_path / "node", 1 << 20) for _ in range(4)]  # four replicas on one node
    paths = []
    threads = [threading.Thread(target=lambda c=c: paths.append(c.object(objects, blob.sha256, blob.bytes)))
               for c in caches]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(timeout=60)
    assert objects.downloads == 1 and len(set(paths)) == 1
    assert sum(c.stats.fetches for c in caches) == 1 and sum(c.stats.hits for c in caches) == 3


def test_an_entry_on_a_warm_node_reads_nothing_from_the_store(tmp_path):
    objects = CountingObjects(tmp_path / "store")
    files = [put_blob(objects, tmp_path, bytes([i]) * 5000) for i in range(3)]
    first = NodeCache(tmp_path / "node", 1 << 20).directory(objects, "base@1", files)
    assert sorted(str(p.relative_to(first)) for p in first.rglob("*.bin")) == sorted(f.path for f in files)
    assert objects.downloads == 3
    restarted = NodeCache(tmp_path / "node", 1 << 20)  # a replica started again on the same node
    assert restarted.directory(objects, "base@1", files) == first
    assert objects.downloads == 3 and restarted.stats.fetches == 0 and restarted.stats.hits == 3


def test_the_least_recently_used_go_first_and_the_budget_holds(tmp_path):
    objects = Objects(tmp_path / "store")
    a, b, c = (put_blob(objects, tmp_path, bytes([i]) * 4000) for i in range(3))
    cache = NodeCache(tmp_path / "node", 9000)  # room for two
    cache.directory(objects, "a@1", [a])
    cache.object(objects, b.sha256, b.bytes)
    cache.directory(objects, "a@1", [a])  # a used again: b is now the least recently used
    cache.object(objects, c.sha256, c.bytes)
    assert cache.used_bytes <= 9000
    held = {p.name for p in (tmp_path / "node" / "objects").iterdir()}
    assert held == {a.sha256, c.sha256}  # b (no entry links it) left first
    cache.object(objects, b.sha256, b.bytes)  # objects no entry links leave before any entry
    assert {p.name for p in (tmp_path / "node" / "objects").iterdir()} == {a.sha256, b.sha256}
    big = put_blob(objects, tmp_path, b"d" * 8000)
    cache.object(objects, big.sha256, big.bytes)  # room only once the entry's directory goes too
    assert not (tmp_path / "node" / "entries" / "a@1").exists()
    assert {p.name for p in (tmp_path / "node" / "objects").iterdir()} == {big.sha256}


def test_a_source_over_the_cap_is_refused_before_anything_is_copied(objects, tmp_path, monkeypatch):
    """fetched(max_bytes) measures first (a local tree's files, an object listing's sizes): a source one byte
    over the cap downloads nothing and its block never runs; one at the cap is fetched whole."""
    from serve.errors import SourceTooLarge
    from serve.store.objects import fetched

    local = tmp_path / "adapter"
    local.mkdir()
    (local / "a.bin").write_bytes(bytes(600))
    (local / "b.bin").write_bytes(bytes(424))
    for f in local.iterdir():
        objects.put_file(f"upload/{f.name}", f)
    remote = f"{objects.location}/upload" if objects.location.startswith("s3://") else None  # memory:// is per object
    downloads = []
    real = Objects.download
    monkeypatch.setattr(Objects, "download", lambda self, *a, **kw: downloads.append(a) or real(self, *a, **kw))
    for source in filter(None, (str(local), remote)):
        with pytest.raises(SourceTooLarge, match=r"more than one add may copy \(admin.max_add_mib = "), \
                fetched([source], max_bytes=1023):
            raise AssertionError("the block ran")
        assert downloads == []
        with fetched([source], max_bytes=1024) as (got,):
            assert sorted(p.name for p in got.iterdir()) == ["a.bin", "b.bin"]
    assert len(downloads) == (2 if remote else 0)
