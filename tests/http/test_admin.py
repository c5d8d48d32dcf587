"""The admin surface (serve/http/admin.py) over a real engine: sources checked before anything is read, a cap on
what one add copies, tenants' admin keys kept to their own variants, tenants managed at run time, and one audit
line per change on stdout and in the store."""

import json
import logging
import os
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from serve.config import ServeConfig, key_digest
from serve.engine.engine import Engine
from serve.errors import Forbidden
from serve.http.app import build_http_app
from serve.http.sources import check_source
from serve.store.store import Store
from tests.models import write_lora, write_tiny_causal

KEYS = {"admin": "sk-admin", "bob": "sk-bob", "acme": "sk-acme", "acme-admin": "sk-acme-admin",
        "zeta": "sk-zeta", "zeta-admin": "sk-zeta-admin"}
CAP_MIB = 0.25


def auth(who: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def tenant(name: str) -> dict:
    """A tenant as POST /v1/admin/tenants takes it: keys as digests, its own variants and the base."""
    return {"name": name, "key_sha256": [key_digest(KEYS[name])], "admin_key_sha256": [key_digest(KEYS[f"{name}-admin"])],
            "models": [f"{name}-*", "lm"], "weight": 2}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A store with a base, the sources folder an admin may add from (adapters in it), and a folder outside it."""
    root = tmp_path_factory.mktemp("admin")
    lm = write_tiny_causal(root / "lm")
    store = Store(root / "store", create=True)
    store.add_base("lm", lm)
    sources = root / "sources"
    for seed in (1, 2, 3, 4, 5):
        write_lora(lm, sources / f"lora-{seed}", seed=seed, r=4, targets=["q_proj", "v_proj"])
    big = write_lora(lm, sources / "big", seed=6, r=4, targets=["q_proj", "v_proj"])
    (big / "padding.bin").write_bytes(bytes(int(CAP_MIB * 2 * (1 << 20))))
    outside = write_lora(lm, root / "outside", seed=7, r=4, targets=["q_proj", "v_proj"])
    return root, store.root, sources, outside


@pytest.fixture(scope="module")
def client(made):
    _, store_root, sources, _ = made
    config = ServeConfig(store=store_root, admin_key_sha256=[key_digest(KEYS["admin"])],
                         tenants=[{"name": "bob", "key_sha256": [key_digest(KEYS["bob"])], "models": ["lm"]}],
                         admin={"sources": [str(sources)], "max_add_mib": CAP_MIB})
    with TestClient(build_http_app(Engine(config), config)) as c:
        yield c


def add(client, name: str, path, who: str = "admin"):
    return client.post("/v1/admin/variants", json={"name": name, "base": "lm", "kind": "lora", "path": str(path)},
                       headers=auth(who))


def names(made) -> set[str]:
    """The variants the store holds."""
    return set(Store(made[1]).manifest.variants)


# ---- sources
def test_a_path_outside_the_sources_is_a_403_whether_it_exists_or_not(client, made):
    root, _, sources, outside = made
    paths = [outside, root / "no-such-dir", "/etc", "/no/such/dir", f"{sources}/../outside", f"file://{outside}",
             f"file://{sources}/../outside", "relative/dir", "s3://any-bucket/adapters", f"{sources}-evil"]
    messages = []
    for path in paths:
        r = add(client, "probe", path)
        assert r.status_code == 403, (path, r.text)
        messages.append(r.json()["error"]["message"].replace(str(path), "<path>"))
    refused = "path '<path>' is not under admin.sources nor the store's incoming/ folder; nothing was read"
    assert set(messages) == {refused}
    assert "probe" not in names(made)


def test_the_source_check_reads_nothing_before_it_refuses(made, monkeypatch):
    """No stat, lstat, listing or open on this thread while a path outside the sources is refused."""
    _, store_root, sources, outside = made
    config = ServeConfig(store=store_root, admin={"sources": [str(sources), "s3://bucket/adapters/"]})
    me = threading.get_ident()
    for fn in ("stat", "lstat", "scandir", "listdir", "open"):
        real = getattr(os, fn)

        def guarded(*a, _real=real, _fn=fn, **kw):
            if threading.get_ident() == me:
                raise AssertionError(f"os.{_fn}{a} before the refusal")
            return _real(*a, **kw)

        monkeypatch.setattr(os, fn, guarded)
    for path in (str(outside), "/etc/passwd", f"{sources}/../outside", "s3://bucket/adapters-evil/x",
                 "s3://bucket/adapters/../secret", "s3://other/adapters/x"):
        with pytest.raises(Forbidden, match="is not under admin.sources"):
            check_source(path, config)
    assert check_source("s3://bucket//adapters/a", config) == "s3://bucket/adapters/a"


def test_the_store_incoming_folder_is_a_source_and_a_symlink_out_of_the_sources_is_refused(client, made):
    _, store_root, sources, outside = made
    (store_root / "incoming").mkdir(exist_ok=True)
    link = store_root / "incoming" / "sneaky"
    link.symlink_to(outside, target_is_directory=True)
    r = add(client, "sneaky", link)
    assert r.status_code == 403 and "through a symlink" in r.json()["error"]["message"], r.text
    inner = sources / "lora-with-link"
    inner.mkdir()
    for f in (sources / "lora-1").iterdir():
        (inner / f.name).write_bytes(f.read_bytes())
    (inner / "stolen").symlink_to(outside / "adapter_config.json")
    r = add(client, "inner-link", inner)
    assert r.status_code == 403 and str(outside) in r.json()["error"]["message"], r.text
    (inner / "stolen").unlink()
    direct = store_root / "incoming" / "lora-in"
    direct.mkdir()
    for f in (sources / "lora-1").iterdir():
        (direct / f.name).write_bytes(f.read_bytes())
    assert add(client, "from-incoming", direct).status_code == 201
    assert client.delete("/v1/admin/variants/from-incoming", headers=auth("admin")).status_code == 200


# ---- the cap
def test_a_copy_over_the_cap_is_refused_and_leaves_nothing_in_the_store(client, made):
    _, store_root, sources, _ = made
    manifest = (store_root / "manifest.json").read_bytes()
    r = add(client, "too-big", sources / "big")
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "source_too_large" and f"admin.max_add_mib = {CAP_MIB:g}" in error["message"]
    assert "\n" not in error["message"]
    batch = client.post("/v1/admin/variants:batch", headers=auth("admin"), json={"variants": [
        {"name": "too-big", "base": "lm", "kind": "lora", "path": str(sources / "big")}]})
    assert batch.status_code == 413, batch.text
    assert (store_root / "manifest.json").read_bytes() == manifest
    assert not (store_root / "variants" / "too-big").exists()
    staging = store_root / "staging"
    assert not staging.exists() or not any(staging.iterdir())
    assert "too-big" not in names(made)


# ---- tenants' admin keys
def test_a_tenant_admin_key_changes_only_its_own_variants(client, made):
    _, _, sources, _ = made
    for name in ("acme", "zeta"):
        assert client.post("/v1/admin/tenants", json=tenant(name), headers=auth("admin")).status_code == 201
    try:
        assert add(client, "zeta-a", sources / "lora-1", who="zeta-admin").status_code == 201
        assert add(client, "acme-a", sources / "lora-2", who="acme-admin").status_code == 201
        for name in ("zeta-b", "lm-b", "acmex"):  # add another's, or no one's
            r = add(client, name, sources / "lora-3", who="acme-admin")
            assert r.status_code == 403 and "may change only its own variants, named 'acme-...'" in \
                r.json()["error"]["message"], r.text
        replace = add(client, "zeta-a", sources / "lora-3", who="acme-admin")  # its name taken: still 403, not 400
        assert replace.status_code == 403
        assert client.delete("/v1/admin/variants/zeta-a", headers=auth("acme-admin")).status_code == 403
        batch = client.post("/v1/admin/variants:batch", headers=auth("acme-admin"), json={"variants": [
            {"name": "acme-b", "base": "lm", "kind": "lora", "path": str(sources / "lora-4")},
            {"name": "zeta-c", "base": "lm", "kind": "lora", "path": str(sources / "lora-5")}]})
        assert batch.status_code == 207, batch.text
        assert [(d["name"], d["status"]) for d in batch.json()["data"]] == [("acme-b", 201), ("zeta-c", 403)]
        assert "named 'acme-...'" in batch.json()["data"][1]["error"]["message"]
        for route in (lambda: client.post("/v1/admin/tenants", json=tenant("acme"), headers=auth("acme-admin")),
                      lambda: client.get("/v1/admin/tenants", headers=auth("acme-admin")),
                      lambda: client.delete("/v1/admin/tenants/zeta", headers=auth("acme-admin"))):
            r = route()
            assert r.status_code == 403 and "only the operator's admin key" in r.json()["error"]["message"]
        assert {"zeta-a", "acme-a", "acme-b"} <= names(made) and "zeta-c" not in names(made)
        ok = client.post("/v1/completions", json={"model": "acme-b", "prompt": "the cat", "max_tokens": 2},
                         headers=auth("acme"))
        assert ok.status_code == 200, ok.text
        assert client.delete("/v1/admin/variants/acme-a", headers=auth("acme-admin")).status_code == 200
        # the operator may change anyone's
        assert client.delete("/v1/admin/variants/zeta-a", headers=auth("admin")).status_code == 200
        assert client.delete("/v1/admin/variants/acme-b", headers=auth("admin")).status_code == 200
    finally:
        for name in ("acme", "zeta"):
            client.delete(f"/v1/admin/tenants/{name}", headers=auth("admin"))


# ---- tenants at run time
def test_tenant_routes_round_trip_and_a_tenant_is_served_at_once_and_refused_once_deleted(client):
    completion = {"model": "lm", "prompt": "the cat", "max_tokens": 2}
    assert client.post("/v1/completions", json=completion, headers=auth("acme")).status_code == 401
    r = client.post("/v1/admin/tenants", json=tenant("acme"), headers=auth("admin"))
    assert r.status_code == 201 and r.json()["source"] == "store" and r.json()["tenant"]["weight"] == 2, r.text
    assert client.post("/v1/completions", json=completion, headers=auth("acme")).status_code == 200
    assert client.post("/v1/completions", json={**completion, "model": "bob-x"},
                       headers=auth("acme")).status_code == 403
    replaced = client.post("/v1/admin/tenants", json={**tenant("acme"), "models": ["acme-*"]}, headers=auth("admin"))
    assert replaced.status_code == 200 and replaced.json()["revision"] != r.json()["revision"]
    assert client.post("/v1/completions", json=completion, headers=auth("acme")).status_code == 403
    listed = client.get("/v1/admin/tenants", headers=auth("admin")).json()["data"]
    assert [(c["tenant"]["name"], c["source"]) for c in listed] == [("acme", "store"), ("bob", "config")]
    one = client.get("/v1/admin/tenants/acme", headers=auth("admin")).json()
    assert one["tenant"] == {**tenant("acme"), "models": ["acme-*"], "weight": 2.0,
                             "limits": {"requests_per_s": None, "tokens_per_min": None, "max_concurrent": None}}
    taken = client.post("/v1/admin/tenants", json={**tenant("zeta"), "key_sha256": [key_digest(KEYS["bob"])]},
                        headers=auth("admin"))
    assert taken.status_code == 400 and "already a key of tenant 'bob'" in taken.json()["error"]["message"]
    assert client.delete("/v1/admin/tenants/acme", headers=auth("admin")).status_code == 200
    assert client.post("/v1/completions", json=completion, headers=auth("acme")).status_code == 401
    assert client.get("/v1/admin/tenants/acme", headers=auth("admin")).status_code == 404
    assert client.delete("/v1/admin/tenants/acme", headers=auth("admin")).status_code == 404
    assert client.delete("/v1/admin/tenants/bob", headers=auth("admin")).status_code == 400  # the config's
    assert client.post("/v1/completions", json=completion, headers=auth("bob")).status_code == 200


def test_admin_routes_need_an_admin_key(client):
    assert client.get("/v1/admin/tenants").status_code == 401
    assert client.get("/v1/admin/tenants", headers=auth("bob")).status_code == 401  # an API key is not an admin key
    assert client.post("/v1/admin/tenants", json=tenant("acme"), headers=auth("bob")).status_code == 401


# ---- the audit log
class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


def _stored(store_root: Path) -> list[dict]:
    return [json.loads(x) for f in sorted((store_root / "audit").glob("*.jsonl")) for x in f.read_text().splitlines()]


def test_the_audit_log_holds_one_line_per_change_on_stdout_and_in_the_store(client, made):
    _, store_root, sources, outside = made
    seen = _Lines()
    logging.getLogger("manyfold.audit").addHandler(seen)
    before = len(_stored(store_root)) if (store_root / "audit").exists() else 0
    try:
        changes = [  # (route, name, status, error) of each change, made or refused, in order
            (add(client, "audit-a", sources / "lora-1"), "POST /v1/admin/variants", "audit-a", 201, None),
            (add(client, "audit-a", sources / "lora-1"), "POST /v1/admin/variants", "audit-a", 400, "bad_request"),
            (add(client, "audit-b", outside), "POST /v1/admin/variants", "audit-b", 403, "forbidden"),
            (client.post("/v1/admin/tenants", json=tenant("acme"), headers=auth("admin")), "POST /v1/admin/tenants",
             "acme", 201, None),
            (add(client, "zeta-x", sources / "lora-2", who="acme-admin"), "POST /v1/admin/variants", "zeta-x", 403,
             "forbidden"),
            (client.delete("/v1/admin/variants/audit-a", headers=auth("admin")), "DELETE /v1/admin/variants",
             "audit-a", 200, None),
            (client.delete("/v1/admin/tenants/acme", headers=auth("admin")), "DELETE /v1/admin/tenants", "acme", 200,
             None),
        ]
        batch = client.post("/v1/admin/variants:batch", headers=auth("admin"), json={"variants": [
            {"name": "audit-c", "base": "lm", "kind": "lora", "path": str(sources / "lora-3")},
            {"name": "audit-d", "base": "lm", "kind": "lora", "path": str(outside)}]})
        assert batch.status_code == 207
        changes += [(batch, "POST /v1/admin/variants:batch", "audit-c", 201, None),
                    (batch, "POST /v1/admin/variants:batch", "audit-d", 403, "forbidden")]
        assert client.delete("/v1/admin/variants/audit-c", headers=auth("admin")).status_code == 200
        changes.append((None, "DELETE /v1/admin/variants", "audit-c", 200, None))
        assert client.delete("/v1/admin/variants/audit-c").status_code == 401  # no key: stdout only
    finally:
        logging.getLogger("manyfold.audit").removeHandler(seen)
    stored = _stored(store_root)[before:]
    assert len(stored) == len(changes) and seen.lines[:-1] == stored
    for line, (_, route, name, status, error) in zip(stored, changes):
        assert set(line) == {"time", "key", "tenant", "route", "name", "revision", "outcome"}
        assert (line["route"], line["name"], line["outcome"]) == (route, name, {"status": status, "error": error})
        assert line["time"].endswith("Z") and line["time"][10] == "T"
    operator, acme = key_digest(KEYS["admin"])[:12], key_digest(KEYS["acme-admin"])[:12]
    assert [(x["key"], x["tenant"]) for x in stored][3:5] == [(operator, None), (acme, "acme")]
    assert stored[0]["revision"] and stored[3]["revision"] and stored[7]["revision"]  # entries after adds
    assert stored[5]["revision"] is None and stored[2]["revision"] is None
    assert seen.lines[-1]["outcome"] == {"status": 401, "error": "unauthorized"} and seen.lines[-1]["key"] is None


def test_an_audit_line_the_store_refuses_fails_no_request(client, made, monkeypatch):
    _, _, sources, _ = made
    engine = client.app.state.http.backend

    async def broken(line):
        raise OSError("disk full")

    monkeypatch.setattr(engine.catalog, "append_audit", broken)
    assert add(client, "audit-e", sources / "lora-4").status_code == 201
    assert client.delete("/v1/admin/variants/audit-e", headers=auth("admin")).status_code == 200
