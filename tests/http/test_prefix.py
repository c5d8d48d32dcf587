"""Prefix caching through the HTTP app: a tenant's second request with the same system prompt reports the tokens
read from the cache in `usage.prompt_tokens_details.cached_tokens` (and in vLLM's prefix-cache counters); another
tenant sending the same prompt reads none, and no field of a request (vLLM's `cache_salt` included) can change
whose cache it reads: an unknown field is a 422, nothing run."""

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from serve.config import ServeConfig, key_digest
from serve.engine.engine import Engine
from serve.http.app import build_http_app
from serve.store.store import Store
from tests.models import write_tiny_chat_lm

MODEL = "chat-lm"
SYSTEM = "You answer questions about the weather in the city the user names, in one short sentence. " * 3


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    store = Store(root / "store", create=True)
    store.add_base(MODEL, write_tiny_chat_lm(root / MODEL))
    config = ServeConfig(store=root / "store", limits={"max_tokens": 16}, tenants=[
        {"name": "acme", "key_sha256": [key_digest("sk-acme")]},
        {"name": "globex", "key_sha256": [key_digest("sk-globex")]}])
    engine = Engine(config)
    with TestClient(build_http_app(engine, config)) as c:
        c.engine = engine
        yield c


def ask(client, who: str, city: str, **extra):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": f"And in {city}?"}], **extra}
    return client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer sk-{who}"})


def prefix_counters(client) -> dict[str, float]:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return {f.name: s.value for f in families if f.name.startswith("vllm:prefix_cache") for s in f.samples
            if s.labels.get("model_name") == MODEL and s.name.endswith("_total")}


def test_a_tenants_second_request_reads_its_system_prompt_from_the_cache_and_another_tenant_reads_none(client):
    first = ask(client, "acme", "Paris")
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    before = prefix_counters(client)
    second = ask(client, "acme", "Lyon").json()["usage"]
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < second["prompt_tokens"]
    after = prefix_counters(client)
    assert after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"] == cached
    assert after["vllm:prefix_cache_queries"] - before["vllm:prefix_cache_queries"] == second["prompt_tokens"]
    assert ask(client, "globex", "Lyon").json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_no_field_of_a_request_chooses_whose_cache_it_reads(client):
    steps = sum(client.engine.bases[MODEL].step_counts.values())
    for extra in ({"cache_salt": "acme"}, {"prefix_cache_scope": "acme"}):
        r = ask(client, "globex", "Nice", **extra)
        assert r.status_code == 422, r.text
        assert "\n" not in r.json()["error"]["message"] and next(iter(extra)) in r.json()["error"]["message"]
    assert sum(client.engine.bases[MODEL].step_counts.values()) == steps  # nothing ran
