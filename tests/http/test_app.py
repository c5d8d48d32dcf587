"""The HTTP contract over a real engine: the official openai client, auth, limits, errors, metrics, admin."""

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient

from serve.config import ServeConfig, key_digest
from serve.engine.engine import Engine
from serve.http.app import build_http_app

KEYS = {"alice": "sk-alice", "bob": "sk-bob", "admin": "sk-admin"}


@pytest.fixture(scope="module")
def client(serving_store, tmp_path_factory):
    root, _ = serving_store
    config = ServeConfig(
        store=root,
        tenants=[{"name": "alice", "key_sha256": [key_digest(KEYS["alice"])], "models": ["*"]},
                 {"name": "bob", "key_sha256": [key_digest(KEYS["bob"])], "models": ["tiny-lm"]}],
        admin_key_sha256=[key_digest(KEYS["admin"])], admin={"sources": [str(tmp_path_factory.getbasetemp())]},
        limits={"max_request_bytes": 4096, "max_tokens": 32, "max_inputs": 4})
    with TestClient(build_http_app(Engine(config), config)) as c:
        yield c


def auth(who: str = "alice") -> dict:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def test_official_openai_client_completions_chat_embeddings(client):
    from openai import OpenAI

    oa = OpenAI(base_url="http://testserver/v1", api_key=KEYS["alice"], http_client=client, max_retries=0)
    c = oa.completions.create(model="tiny-lm-all", prompt="the cat sat", max_tokens=6, temperature=0)
    assert c.choices[0].finish_reason in ("stop", "length") and c.usage.prompt_tokens == 3
    chat = oa.chat.completions.create(model="tiny-lm", messages=[{"role": "user", "content": "hello"}],
                                      max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    emb = oa.embeddings.create(model="minilm", input=["a cat", "a dog"])  # the client asks for base64
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 384
    assert abs(np.linalg.norm(emb.data[0].embedding) - 1) < 1e-5
    from transformers import AutoTokenizer

    from serve.data.models import minilm_dir

    tok = AutoTokenizer.from_pretrained(minilm_dir())
    assert emb.usage.prompt_tokens == sum(len(x) for x in tok(["a cat", "a dog"])["input_ids"])
    ids = {m.id for m in oa.models.list()}
    assert {"tiny-lm", "tiny-lm-top", "minilm", "minilm-clf"} <= ids


def test_streams_carry_the_same_text_as_whole_answers(client):
    from openai import OpenAI

    oa = OpenAI(base_url="http://testserver/v1", api_key=KEYS["alice"], http_client=client, max_retries=0)
    kw = {"model": "tiny-lm-all", "max_tokens": 12, "temperature": 0}
    whole = oa.completions.create(prompt="hello world", **kw)
    chunks = list(oa.completions.create(prompt="hello world", stream=True,
                                        stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # pieces as they come, not one
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices

    messages = [{"role": "user", "content": "hello"}]
    whole = oa.chat.completions.create(messages=messages, **kw)
    chunks = list(oa.chat.completions.create(messages=messages, stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_a_stream_never_shows_its_stop_string_and_refusals_keep_their_status(client):
    whole = client.post("/v1/completions", json={"model": "tiny-lm", "prompt": "hello world", "max_tokens": 12,
                                                 "temperature": 0}, headers=auth()).json()["choices"][0]["text"]
    stop = whole.split()[2]
    body = {"model": "tiny-lm", "prompt": "hello world", "max_tokens": 12, "temperature": 0, "stop": stop}
    cut = client.post("/v1/completions", json=body, headers=auth()).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=auth()) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    import json

    assert events[-1] == "[DONE]"
    pieces = [json.loads(e)["choices"][0]["text"] for e in events[:-1]]
    assert "".join(pieces) == cut and stop not in "".join(pieces)
    r = client.post("/v1/completions", json={"model": "tiny-lm-tpo", "prompt": "a", "stream": True}, headers=auth())
    assert r.status_code == 404


def test_completion_over_http_matches_the_engine_direct(client):
    body = {"model": "tiny-lm-top", "prompt": "one two three", "max_tokens": 8, "temperature": 0}
    a = client.post("/v1/completions", json=body, headers=auth()).json()
    b = client.post("/v1/completions", json=body, headers=auth()).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and a["usage"]["completion_tokens"] >= 1


def test_classify_returns_labels_and_probabilities(client):
    r = client.post("/v1/classify", json={"model": "minilm-clf", "input": ["good", "bad"]}, headers=auth())
    assert r.status_code == 200
    data = r.json()["data"]
    assert [d["index"] for d in data] == [0, 1]
    for d in data:
        assert set(d["probs"]) == {"neg", "pos", "other"} and abs(sum(d["probs"].values()) - 1) < 1e-5
        assert d["label"] == max(d["probs"], key=d["probs"].get)


def test_embeddings_float_and_base64_agree(client):
    f = client.post("/v1/embeddings", json={"model": "minilm", "input": "sun"}, headers=auth()).json()
    b = client.post("/v1/embeddings", json={"model": "minilm", "input": "sun", "encoding_format": "base64"},
                    headers=auth()).json()
    decoded = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, f["data"][0]["embedding"], atol=1e-7)


@pytest.mark.parametrize("headers,model,status,code", [
    ({}, "tiny-lm", 401, "unauthorized"),
    ({"Authorization": "Bearer sk-nobody"}, "tiny-lm", 401, "unauthorized"),
    ({"Authorization": f"Bearer {KEYS['bob']}"}, "tiny-lm-all", 403, "forbidden"),
    ({"Authorization": f"Bearer {KEYS['bob']}"}, "tiny-lm", 200, None),
    ({"Authorization": f"Bearer {KEYS['alice']}"}, "tiny-lm-tpo", 404, "variant_not_found"),
])
def test_auth_and_routing(client, headers, model, status, code):
    r = client.post("/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 2}, headers=headers)
    assert r.status_code == status
    if code:
        assert r.json()["error"]["code"] == code and "\n" not in r.json()["error"]["message"]


def test_unknown_model_names_close_matches(client):
    r = client.post("/v1/completions", json={"model": "tiny-lm-tpo", "prompt": "a"}, headers=auth())
    assert "did you mean 'tiny-lm-top'" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,status,fragment", [
    ({"model": "tiny-lm", "prompt": "a", "max_tokens": -1}, 422, "max_tokens"),
    ({"model": "tiny-lm", "prompt": "a", "stream": True, "stream_options": {"bogus": 1}}, 422, "bogus"),
    ({"model": "tiny-lm", "prompt": "a", "bogus": 1}, 422, "bogus"),
    ({"model": "tiny-lm"}, 422, "prompt"),
    ({"model": "tiny-lm", "prompt": "a", "max_tokens": 33}, 400, "max_tokens: at most 32 on this server, got 33"),
    ({"model": "tiny-lm", "prompt": "a " * 3000}, 413, "exceeds"),
])
def test_invalid_and_oversized_bodies(client, body, status, fragment):
    r = client.post("/v1/completions", json=body, headers=auth())
    assert r.status_code == status and fragment in r.json()["error"]["message"]


def test_too_many_inputs_is_413_and_wrong_kind_is_400(client):
    r = client.post("/v1/classify", json={"model": "minilm-clf", "input": ["a"] * 5}, headers=auth())
    assert r.status_code == 413
    r = client.post("/v1/classify", json={"model": "tiny-lm", "input": "a"}, headers=auth())
    assert r.status_code == 400 and "not a classifier" in r.json()["error"]["message"]


def test_models_show_kind_parent_and_residency(client):
    client.post("/v1/classify", json={"model": "minilm-clf", "input": "warm"}, headers=auth())
    cards = {m["id"]: m for m in client.get("/v1/models", headers=auth()).json()["data"]}
    assert cards["minilm-clf"]["kind"] == "full" and cards["minilm-clf"]["parent"] == "minilm"
    assert cards["minilm-clf"]["residency"] == "hot" and cards["minilm"]["kind"] == "base"
    bob = {m["id"] for m in client.get("/v1/models", headers=auth("bob")).json()["data"]}
    assert bob == {"tiny-lm"}


def test_residency_tells_the_fast_tier_from_host_memory_from_disk_on_a_cpu_server(serving_store):
    """On a CPU engine both cache tiers are host memory: the names say what a request needs, not which device."""
    from prometheus_client.parser import text_string_to_metric_families

    config = ServeConfig(store=serving_store[0])
    engine = Engine(config)
    body = {"prompt": "the cat", "max_tokens": 1}
    with TestClient(build_http_app(engine, config)) as c:
        assert c.post("/v1/completions", json={**body, "model": "tiny-lm-all"}).status_code == 200
        engine.cache.device_bytes = max(e.nbytes for _, e in engine.cache.entries())  # room for tiny-lm-all alone
        assert c.post("/v1/completions", json={**body, "model": "tiny-lm-top"}).status_code == 200  # demotes it
        cards = {m["id"]: m["residency"] for m in c.get("/v1/models").json()["data"]}
        families = text_string_to_metric_families(c.get("/metrics").text)
    named = {"tiny-lm": "hot", "tiny-lm-top": "hot", "tiny-lm-all": "warm", "minilm": "hot", "minilm-clf": "cold"}
    assert {m: cards[m] for m in named} == named  # other tests' variants in the shared store: never loaded here
    assert set(cards.values()) <= {"hot", "warm", "cold"}
    gauge = {s.labels["model"]: s.labels["tier"] for f in families if f.name == "manyfold_variant_resident"
             for s in f.samples if s.value == 1.0}
    assert gauge == cards


def test_models_page_through_with_limit_and_after(client):
    whole = client.get("/v1/models", headers=auth()).json()
    ids = [m["id"] for m in whole["data"]]
    assert whole["object"] == "list" and whole["has_more"] is False and len(ids) >= 4
    assert (whole["first_id"], whole["last_id"]) == (ids[0], ids[-1])
    paged, after = [], None
    while True:
        page = client.get("/v1/models", params={"limit": 3, **({"after": after} if after else {})},
                          headers=auth()).json()
        assert len(page["data"]) <= 3 and page["last_id"] == page["data"][-1]["id"]
        paged += [m["id"] for m in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert paged == ids
    last = client.get("/v1/models", params={"after": ids[-1]}, headers=auth()).json()
    assert last["data"] == [] and last["has_more"] is False and last["first_id"] is None
    r = client.get("/v1/models", params={"after": "no-such-model"}, headers=auth())
    assert r.status_code == 400 and "after: no model 'no-such-model'" in r.json()["error"]["message"]
    assert client.get("/v1/models", params={"limit": 0}, headers=auth()).status_code == 422
    hidden = client.get("/v1/models", params={"after": "minilm"}, headers=auth("bob"))  # not in bob's list
    assert hidden.status_code == 400


def test_metrics_are_prometheus_text(client):
    from prometheus_client.parser import text_string_to_metric_families

    client.post("/v1/completions", json={"model": "tiny-lm", "prompt": "a", "max_tokens": 2}, headers=auth())
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert {"manyfold_requests", "manyfold_request_latency_seconds", "manyfold_cache_events",
            "manyfold_variant_resident", "manyfold_batch_size", "manyfold_queue_depth",
            "manyfold_tokens"} <= set(families)
    ok = [s for s in families["manyfold_requests"].samples
          if s.labels.get("model") == "tiny-lm" and s.labels.get("status") == "200"]
    assert ok and ok[0].value >= 1
    seconds = {s.labels["part"]: s.value for s in families["manyfold_engine_seconds"].samples}
    assert seconds["step"] > 0 and seconds["forward"] > 0  # where a generation step's time went
    steps = {(s.labels["base"], s.labels["mode"], s.labels["reason"]): s.value
             for s in families["manyfold_generation_steps"].samples}
    assert steps[("tiny-lm", "eager", "cpu")] >= 2  # the completion's steps, and why none replayed a graph
    tokens = {(s.labels["base"], s.labels["kind"], s.labels["mode"]): s.value
              for s in families["manyfold_generation_step_tokens"].samples}
    assert tokens[("tiny-lm", "decode", "eager")] >= 1 and tokens[("tiny-lm", "prompt", "eager")] >= 1
    kv = {s.labels["base"]: s.value for s in families["manyfold_kv_store_bytes"].samples}
    assert kv["tiny-lm"] > 0 and "minilm" not in kv  # an encoder keeps no KV store


def test_vllm_latency_and_load_metrics_count_every_request_and_token(serving_store):
    """vLLM's names, as dashboards built for vLLM read them: one time-to-first-token, one end-to-end and one queue
    figure a request, one inter-token figure for every token after the first, the prompt and generated tokens the
    answers' usage counts; nothing running, waiting or holding a KV slot once answered."""
    from prometheus_client.parser import text_string_to_metric_families

    config = ServeConfig(store=serving_store[0])
    engine = Engine(config)
    with TestClient(build_http_app(engine, config)) as c:
        usages = [c.post("/v1/completions", json={"model": "tiny-lm", "prompt": "the cat", "max_tokens": n,
                                                  "temperature": 0}).json()["usage"] for n in (1, 3, 5)]
        families = {f.name: f for f in text_string_to_metric_families(c.get("/metrics").text)}
    tokens = [u["completion_tokens"] for u in usages]

    def count(name: str) -> float:
        return next(s.value for s in families[name].samples
                    if s.name.endswith("_count") and s.labels == {"model_name": "tiny-lm"})

    assert count("vllm:time_to_first_token_seconds") == 3 and count("vllm:e2e_request_latency_seconds") == 3
    assert count("vllm:inter_token_latency_seconds") == sum(tokens) - 3
    assert count("vllm:request_queue_time_seconds") == 3

    def value(name: str) -> float:
        return next(s.value for s in families[name].samples if s.labels == {"model_name": "tiny-lm"})

    assert value("vllm:prompt_tokens") == sum(u["prompt_tokens"] for u in usages)
    assert value("vllm:generation_tokens") == sum(tokens)
    assert value("vllm:kv_cache_usage_perc") == 0.0  # every row answered: its slot given back
    load = {(f.name, s.labels["model_name"]): s.value for f in families.values() for s in f.samples
            if f.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")}
    assert load[("vllm:num_requests_running", "tiny-lm")] == load[("vllm:num_requests_waiting", "tiny-lm")] == 0
    assert "vllm:lora_requests_info" in families


def test_each_tenants_requests_are_timed_by_phase_to_joining_a_batch_and_to_the_first_token(client):
    """manyfold_tenant_queue_seconds and manyfold_tenant_first_token_seconds: one figure a request in each, under its
    authenticated tenant; the first token comes no sooner than the row joined its batch."""
    from prometheus_client.parser import text_string_to_metric_families

    def waits() -> dict[tuple[str, str, str], float]:
        return {(f.name, s.name.rsplit("_", 1)[1], s.labels["tenant"]): s.value
                for f in text_string_to_metric_families(client.get("/metrics").text)
                if f.name in ("manyfold_tenant_queue_seconds", "manyfold_tenant_first_token_seconds")
                for s in f.samples if s.name.endswith(("_count", "_sum"))}

    before = waits()
    for who in ("alice", "alice", "bob"):
        r = client.post("/v1/completions", headers=auth(who), json={"model": "tiny-lm", "prompt": "the cat",
                                                                    "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200
    after = waits()
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    for phase in ("manyfold_tenant_queue_seconds", "manyfold_tenant_first_token_seconds"):
        assert (delta[(phase, "count", "alice")], delta[(phase, "count", "bob")]) == (2, 1)
    for who in ("alice", "bob"):
        assert delta[("manyfold_tenant_first_token_seconds", "sum", who)] >= \
            delta[("manyfold_tenant_queue_seconds", "sum", who)] > 0


def test_every_dashboard_panel_reads_a_metric_the_server_exposes(serving_store):
    """deploy/grafana-dashboard.json: each panel's query names only series /metrics has (after a completion, a
    classification and a cold load, as a server in use has them)."""
    import json
    import re
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    config = ServeConfig(store=serving_store[0], tenants=[
        {"name": "dash", "key_sha256": [key_digest("sk-dash")], "limits": {"requests_per_s": 1}}])
    key = {"Authorization": "Bearer sk-dash"}
    with TestClient(build_http_app(Engine(config), config)) as c:
        c.post("/v1/completions", json={"model": "tiny-lm-top", "prompt": "the cat", "max_tokens": 2}, headers=key)
        assert c.post("/v1/classify", json={"model": "minilm-clf", "input": "x"}, headers=key).status_code == 429
        text = c.get("/metrics").text
    exposed = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dashboard = json.loads((Path(__file__).parents[2] / "deploy" / "grafana-dashboard.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\b(?:manyfold_|vllm:)[a-zA-Z0-9_:]+", target["expr"])}
    assert len(dashboard["panels"]) >= 12 and queried
    assert queried <= exposed, sorted(queried - exposed)


def test_every_dashboard_panel_title_says_what_its_queries_show():
    """A title that names quantiles ("(p50, p95)") has a query for each and no other; a panel of several queries
    tells them apart in its legend."""
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parents[2] / "deploy" / "grafana-dashboard.json").read_text())
    for panel in dashboard["panels"]:
        named = {float(p) / 100 for p in re.findall(r"\bp(\d{2})\b", panel["title"])}
        queried = {float(q) for t in panel["targets"] for q in re.findall(r"histogram_quantile\(([0-9.]+)", t["expr"])}
        assert named == queried, panel["title"]
        legends = [t["legendFormat"] for t in panel["targets"]]
        assert len(set(legends)) == len(legends), panel["title"]


def test_admin_add_and_remove_without_restart(client, serving_store, tmp_path):
    from tests.models import write_perturbed

    _, refs = serving_store
    ft = write_perturbed(refs["tiny-lm"], tmp_path / "new-ft", seed=9, scale=0.5)
    body = {"name": "tiny-lm-new", "base": "tiny-lm", "path": str(ft)}
    assert client.post("/v1/admin/variants", json=body, headers=auth()).status_code == 401
    r = client.post("/v1/admin/variants", json=body, headers=auth("admin"))
    assert r.status_code == 201 and r.json()["parent"] == "tiny-lm"
    gen = client.post("/v1/completions", json={"model": "tiny-lm-new", "prompt": "a", "max_tokens": 3},
                      headers=auth())
    assert gen.status_code == 200
    assert client.post("/v1/admin/variants", json=body, headers=auth("admin")).status_code == 400
    assert client.delete("/v1/admin/variants/tiny-lm-new", headers=auth("admin")).status_code == 200
    gone = client.post("/v1/completions", json={"model": "tiny-lm-new", "prompt": "a"}, headers=auth())
    assert gone.status_code == 404
    assert client.delete("/v1/admin/variants/tiny-lm-new", headers=auth("admin")).status_code == 404


def test_corrupt_variant_fails_alone(serving_store, tmp_path):
    """A damaged FM-Delta file: its variant answers 500 with one line; every other model keeps serving."""
    import shutil

    root, _ = serving_store
    copy = tmp_path / "store"
    shutil.copytree(root, copy)
    path = copy / "variants" / "tiny-lm-all" / "delta.fmd"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    config = ServeConfig(store=copy)
    with TestClient(build_http_app(Engine(config), config)) as c:
        bad = c.post("/v1/completions", json={"model": "tiny-lm-all", "prompt": "a", "max_tokens": 2})
        assert bad.status_code == 500 and "checksum mismatch" in bad.json()["error"]["message"]
        for model in ("tiny-lm", "tiny-lm-top"):
            assert c.post("/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 2}).status_code == 200
        assert c.get("/healthz").json() == {"status": "ok"}
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json() == {"status": "ready", "bases": {b: "running" for b in
                                                                                         ("tiny-lm", "minilm")}}


def test_overload_is_429_with_retry_after(serving_store):
    import threading

    root, _ = serving_store
    config = ServeConfig(store=root, batch={"max_queue": 1, "max_batch_size": 1})
    with TestClient(build_http_app(Engine(config), config)) as c:
        codes, headers = [], []

        def call():
            r = c.post("/v1/completions", json={"model": "tiny-lm", "prompt": "a b c", "max_tokens": 30})
            codes.append(r.status_code)
            headers.append(r.headers.get("retry-after"))

        threads = [threading.Thread(target=call) for _ in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert 429 in codes and 200 in codes
    assert all(h == "1" for code, h in zip(codes, headers) if code == 429)
