"""EMR groups from the command line to HTTP: merge, add, serve every task as <group>/<task>, replace a group
with a re-merged bundle while it serves, and refuse bad bundles whole (one line at the CLI, a 4xx over HTTP)."""

import json
import shutil

import pytest
from fastapi.testclient import TestClient

from serve.cli import main
from serve.codecs import emr
from serve.config import ServeConfig, key_digest
from serve.engine.engine import Engine
from serve.http.app import build_http_app
from serve.store.store import Store
from tests.models import write_perturbed, write_tiny_causal

ADMIN = "admin-key"
PROMPT = {"prompt": "the big red", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("emr-cli")
    lm = write_tiny_causal(root / "tiny-lm")
    store = Store(root / "store", create=True)
    store.add_base("tiny-lm", lm)
    tasks = {t: write_perturbed(lm, root / t, seed=s, scale=0.5) for t, s in (("a", 1), ("b", 2), ("c", 3))}
    return root, store.root, tasks


def _merge(root, tasks, out, names) -> int:
    args = [a for t in names for a in ("--task", f"{t}={tasks[t]}")]
    return main(["emr", "merge", "--base", str(root / "tiny-lm"), *args, "--out", str(out)])


def _greedy_text(model_dir, prompt: str, n: int) -> str:
    """transformers' greedy continuation of `prompt`, as the server's text (the prompt's continuation, special
    tokens left out, up to the end-of-text token)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = AutoModelForCausalLM.from_pretrained(model_dir).eval().generate(**enc, max_new_tokens=n,
                                                                             do_sample=False, pad_token_id=0)
    ids = out[0].tolist()
    ids = ids[: ids.index(2, enc["input_ids"].shape[1])] if 2 in ids[enc["input_ids"].shape[1]:] else ids
    prompt_text = tok.decode(enc["input_ids"][0], skip_special_tokens=True)
    return tok.decode(ids, skip_special_tokens=True)[len(prompt_text):]


def test_merge_add_serve_and_replace_a_group_over_http(setup, tmp_path, capsys):
    root, store_root, tasks = setup
    assert _merge(root, tasks, tmp_path / "ab", ["a", "b"]) == 0
    out = capsys.readouterr().out
    assert "2 tasks over" in out and "\na " in out and "\nb " in out
    assert main(["store", "add", "--store", str(store_root), "--kind", "emr", "--name", "grp", "--base", "tiny-lm",
                 "--model", str(tmp_path / "ab")]) == 0
    assert main(["store", "extract", "--store", str(store_root), "--name", "grp/b", "--out", str(tmp_path / "b")]) == 0
    config = ServeConfig(store=store_root, admin_key_sha256=[key_digest(ADMIN)], admin={"sources": [str(tmp_path)]})
    with TestClient(build_http_app(Engine(config), config)) as c:
        cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert cards["grp/a"]["kind"] == "emr" and cards["grp/b"]["parent"] == "tiny-lm" and "grp" not in cards
        r = c.post("/v1/completions", json={"model": "grp/b", **PROMPT})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == _greedy_text(tmp_path / "b", PROMPT["prompt"], 6)
        assert c.post("/v1/completions", json={"model": "grp/z", **PROMPT}).status_code == 404

        # A third task: the group is merged again and replaced whole, over the admin API, while it serves.
        assert _merge(root, tasks, tmp_path / "abc", ["a", "b", "c"]) == 0
        r = c.post("/v1/admin/variants", json={"name": "grp", "kind": "emr", "base": "tiny-lm",
                                                 "path": str(tmp_path / "abc")}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 201, r.text
        ids = {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert {"grp/a", "grp/b", "grp/c"} <= ids
        emr.extract(tmp_path / "abc", "c", tmp_path / "c")
        r = c.post("/v1/completions", json={"model": "grp/c", **PROMPT})
        assert r.json()["choices"][0]["text"] == _greedy_text(tmp_path / "c", PROMPT["prompt"], 6)
    store = Store(store_root)
    assert [p.name for p in (store_root / "variants").iterdir() if p.name.startswith("grp")] == [
        store.variant("grp").bundle]  # the old bundle's directory is gone


def _spoil(setup, tmp_path, case: str):
    root, _, tasks = setup
    good = tmp_path / "good"
    if not good.exists():
        emr.merge(root / "tiny-lm", {"a": tasks["a"]}, good)
    bad = tmp_path / case
    shutil.copytree(good, bad)
    if case == "other-base":
        other = write_tiny_causal(tmp_path / "other-lm", seed=7)
        shutil.rmtree(bad)
        emr.merge(other, {"a": write_perturbed(other, tmp_path / "other-a", seed=1)}, bad)
    elif case == "corrupt-mask":
        p = bad / emr.MASKS_FILE
        data = bytearray(p.read_bytes())
        data[-3] ^= 0xFF
        p.write_bytes(bytes(data))
    elif case == "truncated-mask":
        p = bad / emr.MASKS_FILE
        p.write_bytes(p.read_bytes()[:100])
    elif case == "missing-manifest":
        (bad / emr.BUNDLE_JSON).unlink()
    elif case == "malformed-manifest":
        (bad / emr.BUNDLE_JSON).write_text(json.dumps({"format": "manyfold.emr", "version": 1}))
    return bad


BAD = {"other-base": "another base", "corrupt-mask": "sha256 mismatch", "truncated-mask": "truncated",
       "missing-manifest": "not an EMR bundle", "malformed-manifest": "malformed bundle manifest"}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_bundle_is_one_line_at_the_cli_and_a_4xx_over_http_and_nothing_is_added(setup, tmp_path, capsys, case):
    _, store_root, _ = setup
    bad = _spoil(setup, tmp_path, case)
    before = (store_root / "manifest.json").read_bytes()
    capsys.readouterr()
    code = main(["store", "add", "--store", str(store_root), "--kind", "emr", "--name", f"bad-{case}",
                 "--base", "tiny-lm", "--model", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 1 and BAD[case] in err and "\n" not in err, err
    assert (store_root / "manifest.json").read_bytes() == before
    config = ServeConfig(store=store_root, admin_key_sha256=[key_digest(ADMIN)], admin={"sources": [str(tmp_path)]})
    with TestClient(build_http_app(Engine(config), config)) as c:
        r = c.post("/v1/admin/variants", json={"name": f"bad-{case}", "kind": "emr", "base": "tiny-lm",
                                                 "path": str(bad)}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code in (400, 422) and BAD[case] in r.json()["error"]["message"], r.text
        assert c.post("/v1/completions", json={"model": "tiny-lm", **PROMPT}).status_code == 200
    assert (store_root / "manifest.json").read_bytes() == before


def test_emr_cli_errors_are_one_line(setup, tmp_path, capsys):
    root, _, tasks = setup
    capsys.readouterr()
    assert main(["emr", "extract", "--bundle", str(tmp_path / "none"), "--task", "a", "--out", str(tmp_path / "o")]) == 1
    assert "not an EMR bundle" in capsys.readouterr().err
    assert main(["emr", "merge", "--base", str(root / "tiny-lm"), "--task", "a", "--out", str(tmp_path / "x")]) == 1
    assert "expected NAME=DIR" in capsys.readouterr().err
    emr.merge(root / "tiny-lm", {"a": tasks["a"]}, tmp_path / "one")
    assert main(["emr", "extract", "--bundle", str(tmp_path / "one"), "--task", "b", "--out", str(tmp_path / "o")]) == 1
    assert "no task 'b'" in capsys.readouterr().err
