"""Bad adapters are refused whole: one line at the CLI, a 4xx at the admin API, nothing half-registered, and
every other variant keeps serving."""

import json
import shutil

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from serve.cli import main
from serve.config import ServeConfig, key_digest
from serve.engine.engine import Engine
from serve.http.app import build_http_app
from serve.store.store import Store
from tests.models import write_lora, write_tiny_causal

ADMIN = "admin-key"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    lm = write_tiny_causal(root / "tiny-lm")
    store = Store(root / "store", create=True)
    store.add_base("tiny-lm", lm)
    good = write_lora(lm, root / "good", seed=1, r=2, targets=["q_proj", "v_proj"])
    assert main(["store", "add", "--store", str(store.root), "--kind", "lora", "--name", "good", "--base", "tiny-lm",
                 "--model", str(good)]) == 0
    return root, store.root, good


def _config(d):
    return json.loads((d / "adapter_config.json").read_text())


def _write_config(d, **changes):
    (d / "adapter_config.json").write_text(json.dumps({**_config(d), **changes}))


def _other_base_shapes(d):
    tensors = load_file(d / "adapter_model.safetensors")
    tensors = {k: (v[:, :16].contiguous() if "lora_A" in k else v) for k, v in tensors.items()}
    save_file(tensors, d / "adapter_model.safetensors")


def _double_rank(d):
    tensors = load_file(d / "adapter_model.safetensors")
    save_file({k: torch.cat([v, v], dim=0 if "lora_A" in k else 1) for k, v in tensors.items()},
              d / "adapter_model.safetensors")
    _write_config(d, r=4)


def _pickle(d):
    (d / "adapter_model.safetensors").rename(d / "adapter_model.bin")


def _corrupt(d):
    data = (d / "adapter_model.safetensors").read_bytes()
    (d / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])


BAD = {  # case: (how to spoil a good adapter, words the one-line message must contain)
    "other-base": (_other_base_shapes, "another base"),
    "rank-over-max": (_double_rank, "slot maximum is 3"),
    "pickle": (_pickle, "pickle"),
    "no-config": (lambda d: (d / "adapter_config.json").unlink(), "adapter_config.json"),
    "bad-config": (lambda d: (d / "adapter_config.json").write_text("{not json"), "not valid JSON"),
    "corrupt": (_corrupt, "safetensors"),
    "raw-pissa": (lambda d: _write_config(d, init_lora_weights="pissa_niter_4"), "manyfold adapter convert"),
    "dora": (lambda d: _write_config(d, use_dora=True), "use_dora"),
    "modules-to-save": (lambda d: _write_config(d, modules_to_save=["lm_head"]), "modules_to_save"),
}


def spoiled(setup, tmp_path, case: str):
    _, _, good = setup
    d = tmp_path / case
    shutil.copytree(good, d)
    BAD[case][0](d)
    return d


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_is_one_line_at_the_cli_and_nothing_is_added(setup, tmp_path, capsys, case):
    _, root, _ = setup
    before = (root / "manifest.json").read_bytes()
    capsys.readouterr()
    code = main(["store", "add", "--store", str(root), "--kind", "lora", "--name", f"bad-{case}",
                 "--base", "tiny-lm", "--model", str(spoiled(setup, tmp_path, case)), "--max-rank", "3"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and err.startswith("manyfold: error:")
    assert BAD[case][1] in err
    assert (root / "manifest.json").read_bytes() == before
    assert not (root / "variants" / f"bad-{case}").exists()


def test_bad_adapters_are_4xx_at_the_admin_api_and_the_rest_keeps_serving(setup, tmp_path):
    _, root, _ = setup
    config = ServeConfig(store=root, admin_key_sha256=[key_digest(ADMIN)], slots={"max_rank": 3},
                         admin={"sources": [str(tmp_path)]})
    headers = {"Authorization": f"Bearer {ADMIN}"}
    with TestClient(build_http_app(Engine(config), config)) as c:
        for case, (_, words) in sorted(BAD.items()):
            body = {"name": f"bad-{case}", "kind": "lora", "base": "tiny-lm", "path": str(spoiled(setup, tmp_path, case))}
            r = c.post("/v1/admin/variants", json=body, headers=headers)
            assert r.status_code in (400, 422), (case, r.status_code, r.text)
            message = r.json()["error"]["message"]
            assert words in message and "\n" not in message, case
        names = {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert not any(n.startswith("bad-") for n in names)
        for model in ("tiny-lm", "good"):
            r = c.post("/v1/completions", json={"model": model, "prompt": "the cat", "max_tokens": 3})
            assert r.status_code == 200, r.text
        unknown = c.post("/v1/admin/variants", json={"name": "x", "kind": "nope", "base": "tiny-lm",
                                                      "path": str(tmp_path)}, headers=headers)
        assert unknown.status_code == 400 and "unknown variant kind 'nope'" in unknown.json()["error"]["message"]


def test_an_adapter_added_over_http_is_served_without_restart(setup, tmp_path):
    root_dir, root, _ = setup
    config = ServeConfig(store=root, admin_key_sha256=[key_digest(ADMIN)], admin={"sources": [str(tmp_path)]})
    new = write_lora(root_dir / "tiny-lm", tmp_path / "new", seed=5, r=3, targets=["o_proj"])
    with TestClient(build_http_app(Engine(config), config)) as c:
        prompt = {"prompt": "the big red", "max_tokens": 6, "temperature": 0}
        r = c.post("/v1/admin/variants", json={"name": "new", "kind": "lora", "base": "tiny-lm", "path": str(new)},
                   headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 201 and r.json()["kind"] == "lora" and r.json()["parent"] == "tiny-lm"
        card = next(m for m in c.get("/v1/models").json()["data"] if m["id"] == "new")
        assert card["kind"] == "lora" and card["residency"] == "cold"
        out = c.post("/v1/completions", json={"model": "new", **prompt})
        assert out.status_code == 200
        card = next(m for m in c.get("/v1/models").json()["data"] if m["id"] == "new")
        assert card["residency"] == "hot"


def test_adapter_train_then_store_add_then_serve(setup, tmp_path, capsys):
    """The CLI path a user takes: train a PiSSA adapter on JSONL, add it to the store, and it serves."""
    import asyncio

    from serve.engine.types import SamplingParams

    root_dir, root, _ = setup
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [{"prompt": "the cat", "completion": " sat on the mat"},
                                                      {"text": "one two three four five six"}] * 4) + "\n")
    out = tmp_path / "pissa"
    assert main(["adapter", "train", "--base", str(root_dir / "tiny-lm"), "--data", str(data), "--init", "pissa",
                 "--rank", "4", "--steps", "3", "--lr", "0.05", "--out", str(out)]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert len(log["log"]) == 3 and _config(out)["r"] == 8  # served converted: rank 2r
    assert main(["store", "add", "--store", str(root), "--kind", "pissa", "--name", "trained", "--base", "tiny-lm",
                 "--model", str(out)]) == 0
    assert "added pissa variant 'trained'" in capsys.readouterr().out
    engine = Engine(ServeConfig(store=root))
    gen = asyncio.run(engine.complete("trained", SamplingParams(max_tokens=4, temperature=0), prompt="the cat"))
    assert len(gen.token_ids) >= 1
