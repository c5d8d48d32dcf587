"""End to end: Ray Serve on loopback serving two bases and their FM-Delta variants over real HTTP."""

import shutil
import threading

import httpx
import pytest
import torch

from loadtests.generator import free_port
from serve.config import ServeConfig, key_digest
from tests.engine.test_engine import reference_greedy

pytestmark = [pytest.mark.slow, pytest.mark.ray]
KEY = "sk-e2e"
ADMIN = "sk-e2e-admin"


@pytest.fixture(scope="module")
def server(serving_store, tmp_path_factory):
    """The app with two ingress replicas, as a cluster runs one on each node: a variant added through one is
    requested through either (Router._resolve), one removed is gone from the other within store_refresh_s, and a
    scrape of /metrics reaches either."""
    import serve.deployments  # noqa: F401  (loopback env before ray)
    import ray
    from ray import serve

    from serve.app import build_app

    src, refs = serving_store
    root = tmp_path_factory.mktemp("e2e") / "store"
    shutil.copytree(src, root)
    broken = root / "variants" / "tiny-lm-broken"
    shutil.copytree(root / "variants" / "tiny-lm-all", broken)
    data = bytearray((broken / "delta.fmd").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (broken / "delta.fmd").write_bytes(bytes(data))
    manifest = (root / "manifest.json").read_text()
    import json

    m = json.loads(manifest)
    entry = dict(m["variants"]["tiny-lm-all"], name="tiny-lm-broken")
    entry["files"] = [dict(f, path=f["path"].replace("tiny-lm-all", "tiny-lm-broken")) for f in entry["files"]]
    m["variants"]["tiny-lm-broken"] = entry
    (root / "manifest.json").write_text(json.dumps(m))

    port = free_port()
    config = ServeConfig(store=root, port=port, ingress_replicas=2, store_refresh_s=0.5, deployment={"num_cpus": 0.25},
                         deployments={"tiny-lm": {"num_cpus": 0.25, "num_replicas": 2}},
                         tenants=[{"name": "e2e", "key_sha256": [key_digest(KEY)]}],
                         admin_key_sha256=[key_digest(ADMIN)], limits={"max_request_bytes": 65536},
                         admin={"sources": [str(tmp_path_factory.getbasetemp())]})
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config), name="manyfold", route_prefix="/")
    yield f"http://127.0.0.1:{port}", refs, root
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def tight_server(server):
    """A second app on the same Ray with queues of one: tiny-lm's replica takes one request at a time, so
    Ray's own queue fills first; MiniLM's takes many, so its engine's queue fills first."""
    from ray import serve

    from serve.app import build_app

    url, _, root = server
    config = ServeConfig(store=root, deployment={"num_cpus": 0.25, "max_ongoing_requests": 1,
                                                 "max_queued_requests": 1},
                         deployments={"minilm": {"num_cpus": 0.25, "max_ongoing_requests": 64}},
                         batch={"max_batch_size": 1, "max_queue": 1})
    serve.run(build_app(config), name="tight", route_prefix="/tight")
    yield f"{url}/tight"
    serve.delete("tight")


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def test_openai_client_gets_transformers_identical_greedy_tokens(server):
    from openai import OpenAI

    url, refs, _ = server
    client = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    prompt = "the cat sat on the mat and"
    for model in ("tiny-lm", "tiny-lm-all"):
        c = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
        expected = reference_greedy(refs[model], prompt, 10)
        assert c.usage.completion_tokens == min(len(expected) + 1, 10)  # an end token sampled counts too
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(refs[model])
        ids = tok(prompt)["input_ids"]  # the completion reads as the prompt's continuation (its leading space)
        whole, before = (tok.decode(x, skip_special_tokens=True) for x in (ids + expected, ids))
        assert c.choices[0].text == whole[len(before):]
    chat = client.chat.completions.create(model="tiny-lm-top", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=6, temperature=0)
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")


def test_openai_client_streams_over_ray(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)
    kw = {"model": "tiny-lm-top", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 10,
          "temperature": 0}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_constraints_tools_and_n_cross_ray_to_the_replica(server):
    """What a request carries beyond its prompt reaches the engine through the router and the replica: a choice
    constraint, tools (the model reads them: its prompt grows), n choices with their seeds, a grammar that the
    model's vocabulary cannot write (400 from the replica), continuous usage."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)
    c = client.completions.create(model="tiny-lm", prompt="the cat", max_tokens=6, n=3, temperature=1.0, seed=5,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert [x.text.strip() for x in c.choices] and all(x.text.strip() in ("yes", "no") for x in c.choices)
    ask = [{"role": "user", "content": "the cat"}]
    tool = {"type": "function", "function": {"name": "walk", "parameters": {"type": "object"}}}
    plain = client.chat.completions.create(model="tiny-lm-top", messages=ask, max_tokens=2)
    told = client.chat.completions.create(model="tiny-lm-top", messages=ask, max_tokens=2, tools=[tool])
    assert told.usage.prompt_tokens > plain.usage.prompt_tokens
    with pytest.raises(BadRequestError, match="no token of this model's vocabulary can start it"):
        client.chat.completions.create(model="tiny-lm", messages=ask, max_tokens=2, response_format={
            "type": "json_object"})
    chunks = list(client.completions.create(model="tiny-lm", prompt="the", max_tokens=5, stream=True,
                                            extra_body={"ignore_eos": True, "stream_options": {
                                                "include_usage": True, "continuous_usage_stats": True}}))
    assert all(ch.usage is not None for ch in chunks) and chunks[-1].usage.completion_tokens == 5


def test_classifier_over_http_equals_transformers(server, http):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _, refs, _ = server
    texts = ["what a lovely morning", "terrible service"]
    data = http.post("/v1/classify", json={"model": "minilm-clf", "input": texts}).json()["data"]
    model = AutoModelForSequenceClassification.from_pretrained(refs["minilm-clf"]).eval()
    tok = AutoTokenizer.from_pretrained(refs["minilm-clf"])
    with torch.no_grad():
        for d, text in zip(data, texts):
            ref = model(**tok([text], return_tensors="pt")).logits.softmax(-1)[0]
            assert d["label"] == model.config.id2label[int(ref.argmax())]
            got = torch.tensor([d["probs"][model.config.id2label[i]] for i in range(len(ref))])
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_concurrent_requests_across_bases_and_variants_all_succeed(server):
    url = server[0]
    jobs = [("/v1/completions", {"model": m, "prompt": "one two three", "max_tokens": 4})
            for m in ("tiny-lm", "tiny-lm-top", "tiny-lm-all")] * 4
    jobs += [("/v1/classify", {"model": "minilm-clf", "input": "hi"}),
             ("/v1/embeddings", {"model": "minilm", "input": "hi"})] * 4
    codes = []

    def call(path, body):
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
            codes.append(c.post(path, json=body).status_code)

    threads = [threading.Thread(target=call, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200] * len(jobs)


def test_errors_over_http(server, http):
    url = server[0]
    assert httpx.post(f"{url}/v1/completions", json={"model": "tiny-lm", "prompt": "a"}, timeout=60).status_code == 401
    r = http.post("/v1/completions", json={"model": "tiny-lm-tpo", "prompt": "a"})
    assert r.status_code == 404 and "did you mean" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json={"model": "tiny-lm", "prompt": "a" * 70000}).status_code == 413
    assert http.post("/v1/completions", json={"model": "tiny-lm", "prompt": 5}).status_code == 422


def test_corrupt_variant_fails_alone_over_http(http):
    bad = http.post("/v1/completions", json={"model": "tiny-lm-broken", "prompt": "a", "max_tokens": 2})
    assert bad.status_code == 500 and "checksum mismatch" in bad.json()["error"]["message"]
    assert "\n" not in bad.json()["error"]["message"]
    ok = http.post("/v1/completions", json={"model": "tiny-lm-all", "prompt": "a", "max_tokens": 2})
    assert ok.status_code == 200


def test_admin_add_and_remove_reach_the_replicas(server, http, tmp_path):
    from tests.models import write_perturbed

    _, refs, _ = server
    ft = write_perturbed(refs["tiny-lm"], tmp_path / "ft", seed=11, scale=0.5)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = http.post("/v1/admin/variants", json={"name": "tiny-lm-hot", "base": "tiny-lm", "path": str(ft)},
                  headers=admin)
    assert r.status_code == 201
    hot = {"model": "tiny-lm-hot", "prompt": "a", "max_tokens": 2}
    assert http.post("/v1/completions", json=hot).status_code == 200
    assert http.delete("/v1/admin/variants/tiny-lm-hot", headers=admin).status_code == 200
    assert _gone(http, "tiny-lm-hot")


def _gone(http: httpx.Client, model: str) -> bool:
    """A variant removed through one ingress is a 404 through it at once, through the other once its catalog's
    next look has seen the removal (store_refresh_s): True when a request for it is a 404 within a bounded number
    of requests."""
    for _ in range(2000):
        if http.post("/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 1}).status_code == 404:
            return True
    return False


def test_an_admin_batch_reaches_the_replicas_and_answers_per_item(server, http, tmp_path):
    """Through the router to a tiny-lm replica over Ray: the added variant serves, an unknown base fails alone."""
    from tests.models import write_perturbed

    ft = write_perturbed(server[1]["tiny-lm"], tmp_path / "ft", seed=13, scale=0.5)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    body = {"variants": [{"name": "tiny-lm-batch", "base": "tiny-lm", "path": str(ft)},
                         {"name": "nowhere-batch", "base": "no-such-base", "path": str(ft)}]}
    r = http.post("/v1/admin/variants:batch", json=body, headers=admin)
    try:
        assert r.status_code == 207, r.text
        assert [(d["name"], d["status"]) for d in r.json()["data"]] == [("tiny-lm-batch", 201), ("nowhere-batch", 404)]
        assert http.post("/v1/completions", json={"model": "tiny-lm-batch", "prompt": "a", "max_tokens": 2}
                         ).status_code == 200
        page = http.get("/v1/models", params={"limit": 1}).json()
        assert len(page["data"]) == 1 and page["has_more"] is True
    finally:
        http.delete("/v1/admin/variants/tiny-lm-batch", headers=admin)


def test_models_show_residency_over_every_replica(server, http, tmp_path):
    """tiny-lm has two replicas; /v1/models reaches one of them per call, yet always sees the variant."""
    from tests.models import write_perturbed

    ft = write_perturbed(server[1]["tiny-lm"], tmp_path / "ft", seed=12, scale=0.5)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    body = {"name": "tiny-lm-solo", "base": "tiny-lm", "path": str(ft)}
    assert http.post("/v1/admin/variants", json=body, headers=admin).status_code == 201
    try:
        cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        assert cards["tiny-lm-solo"]["residency"] == "cold"
        assert http.post("/v1/completions", json={"model": "tiny-lm-solo", "prompt": "a", "max_tokens": 2}
                         ).status_code == 200
        for _ in range(8):
            cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
            assert cards["tiny-lm-solo"]["residency"] == "hot"
    finally:
        http.delete("/v1/admin/variants/tiny-lm-solo", headers=admin)


def test_models_and_metrics(http):
    http.post("/v1/classify", json={"model": "minilm-clf", "input": "x"})
    cards = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["bases"] == {"tiny-lm": "running", "minilm": "running"}
    assert cards["minilm-clf"]["residency"] == "hot" and cards["tiny-lm"]["kind"] == "base"
    text = http.get("/metrics").text
    assert 'manyfold_requests_total{model="minilm-clf",route="/v1/classify",status="200"}' in text
    assert "manyfold_cache_events_total" in text and "manyfold_batch_size_bucket" in text


@pytest.mark.parametrize("path, body, refused_by", [
    ("/v1/completions", {"model": "tiny-lm-all", "prompt": "one two three", "max_tokens": 24}, "at capacity"),
    ("/v1/embeddings", {"model": "minilm", "input": ["a long enough sentence to take a while"] * 16},
     "already waiting"),
])
def test_a_flood_gets_429_with_retry_after_and_nothing_breaks(tight_server, path, body, refused_by):
    responses = []

    def call():
        with httpx.Client(base_url=tight_server, timeout=120) as c:
            responses.append(c.post(path, json=body))

    threads = [threading.Thread(target=call) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {r.status_code for r in responses} == {200, 429}
    refused = [r for r in responses if r.status_code == 429]
    assert all(int(r.headers["Retry-After"]) >= 1 for r in refused)
    assert any(refused_by in r.json()["error"]["message"] for r in refused)
    with httpx.Client(base_url=tight_server, timeout=120) as c:
        assert c.post(path, json=body).status_code == 200


def _store_digests(root) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_killed_replica_is_restarted_and_no_request_hangs(server):
    """ray.kill of minilm's only replica while a bounded load runs: every request in flight gets an answer (its
    result or an error, never a hang: httpx's timeout would fail the test), Serve starts a new replica, requests
    after it are served as before, and the store is unchanged (every file's checksum, every entry verified)."""
    import ray

    from serve.store.store import Store

    url, _, root = server
    before = _store_digests(root)
    body = {"model": "minilm-clf", "input": ["what a lovely morning", "terrible service"]}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        expected = c.post("/v1/classify", json=body).json()["data"]
    replica = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith("SERVE_REPLICA::manyfold#base-minilm#"))
    first, statuses = threading.Event(), []

    def call():
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
            statuses.append(c.post("/v1/classify", json=body).status_code)  # a hang raises here: no status
            first.set()

    threads = [threading.Thread(target=call) for _ in range(24)]
    for t in threads:
        t.start()
    assert first.wait(120), "the load never got an answer"
    ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=False)
    for t in threads:
        t.join()
    assert len(statuses) == len(threads) and set(statuses) <= {200, 503}, statuses  # answered; a cut one: retry
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        for _ in range(30):  # each refusal waited for the base within its bound: until the new replica runs
            after = c.post("/v1/classify", json=body)
            if after.status_code == 200:
                break
        assert after.status_code == 200 and after.json()["data"] == expected
    assert not any(a["name"] == replica for a in ray.util.list_named_actors(all_namespaces=True))  # a new one
    assert _store_digests(root) == before
    store = Store(root)
    for entry in [*store.manifest.bases.values(), *store.manifest.variants.values()]:
        if entry.name != "tiny-lm-broken":  # spoilt on purpose by this module's fixture
            store.verify(entry)


def test_metrics_scraped_during_a_load_over_two_replicas_never_go_backwards(server):
    """tiny-lm runs two replicas and the app two ingress replicas; each reports its counters to the board, and
    /metrics sums them, whichever ingress a scrape reaches: twenty scrapes taken while requests come in, every
    counter and histogram sample at least what it was the scrape before, and the requests counted by both
    ingresses once the load has ended."""
    import threading

    from prometheus_client.parser import text_string_to_metric_families

    url = server[0]
    with httpx.Client(base_url=url, timeout=120) as http:
        earlier = _completions_counted(http.get("/metrics").text)  # this module's earlier tests, as far as reported
    stop = threading.Event()
    answered: list[int] = []

    def load():
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
            for i in range(2000):  # bounded; ends when the scrapes do
                if stop.is_set():
                    return
                model = ("tiny-lm", "tiny-lm-top", "tiny-lm-all")[i % 3]
                answered.append(c.post("/v1/completions", json={"model": model, "prompt": "the cat",
                                                                "max_tokens": 2}).status_code)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    scrapes = []
    with httpx.Client(base_url=url, timeout=120) as http:
        try:
            while len(scrapes) < 20:
                text = http.get("/metrics").text
                scrapes.append({(s.name, tuple(sorted(s.labels.items()))): s.value
                                for f in text_string_to_metric_families(text) if f.type in ("counter", "histogram")
                                for s in f.samples})
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=300)
        finals = []
        for _ in range(500):  # bounded: until the other ingress's health check has reported its last requests
            finals.append(_completions_counted(http.get("/metrics").text))
            if finals[-1] >= earlier + len(answered):
                break
    for before, after in zip(scrapes, scrapes[1:]):
        went_back = [k for k, v in before.items() if after.get(k, 0.0) < v]
        assert not went_back, went_back
    assert answered and set(answered) == {200}
    assert finals == sorted(finals) and finals[-1] >= earlier + len(answered)
    steps = [v for (name, labels), v in scrapes[-1].items() if name == "manyfold_generation_steps_total"]
    assert steps and sum(steps) > 0  # the replicas' counters reached /metrics through the board


def _completions_counted(text: str) -> float:
    """manyfold_requests_total of /v1/completions with status 200, over every model."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "manyfold_requests_total" and s.labels.get("route") == "/v1/completions"
               and s.labels.get("status") == "200")
