"""What the ecosystem's clients send: log probabilities and echo, token-id and batched prompts, the chat message
shapes of current clients, and 422s that name the field, the limit and the value (structured outputs, tools and
the sampling controls: test_structured.py)."""

import json

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.http.app import build_http_app


@pytest.fixture(scope="module")
def client(serving_store):
    root, _ = serving_store
    config = ServeConfig(store=root, limits={"max_tokens": 40, "max_inputs": 4})
    with TestClient(build_http_app(Engine(config), config)) as c:
        yield c


@pytest.fixture(scope="module")
def oa(client):
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)


@pytest.fixture(scope="module")
def tok(serving_store):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(serving_store[1]["tiny-lm"])


def sse(response) -> list[dict]:
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_echo_and_logprobs_in_the_shape_the_openai_client_parses(oa):
    c = oa.completions.create(model="tiny-lm-all", prompt="the cat sat on", max_tokens=3, temperature=0,
                              logprobs=2, echo=True)
    choice = c.choices[0]
    lp = choice.logprobs
    n = c.usage.prompt_tokens + c.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert choice.text.startswith("the cat sat on") and choice.text == "".join(lp.tokens)
    for token, offset in zip(lp.tokens, lp.text_offset):
        assert choice.text[offset:offset + len(token)] == token
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 2 <= len(top) <= 3 and top[token] == value  # the token taken is always among them
        assert max(top.values()) >= value
    generated = lp.tokens[c.usage.prompt_tokens:]  # greedy: every generated token is its position's best
    assert all(lp.top_logprobs[c.usage.prompt_tokens + i][t] == max(lp.top_logprobs[c.usage.prompt_tokens + i]
                                                                     .values()) for i, t in enumerate(generated))


def test_streamed_logprobs_join_to_the_whole_answers(client, oa):
    kw = {"model": "tiny-lm-top", "prompt": "one two three", "max_tokens": 6, "temperature": 0, "logprobs": 1,
          "echo": True}
    whole = oa.completions.create(**kw).choices[0]
    chunks = list(oa.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    joined = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    offsets = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.text_offset]
    assert joined == whole.logprobs.tokens and values == whole.logprobs.token_logprobs
    assert offsets == whole.logprobs.text_offset


def test_token_id_and_batched_prompts_are_one_choice_each_in_order(client, tok):
    prompts = ["the cat sat on", "a big red dog and", "hello"]
    singles = [client.post("/v1/completions", json={"model": "tiny-lm-all", "prompt": p, "max_tokens": 5,
                                                    "temperature": 0}).json()["choices"][0]["text"] for p in prompts]
    ids = [tok(p)["input_ids"] for p in prompts]
    for prompt in (prompts, ids):
        r = client.post("/v1/completions", json={"model": "tiny-lm-all", "prompt": prompt, "max_tokens": 5,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2] and [c["text"] for c in choices] == singles
    one = client.post("/v1/completions", json={"model": "tiny-lm-all", "prompt": ids[1], "max_tokens": 5,
                                               "temperature": 0}).json()
    assert one["choices"][0]["text"] == singles[1] and one["usage"]["prompt_tokens"] == len(ids[1])
    r = client.post("/v1/completions", json={"model": "tiny-lm-all", "prompt": prompts, "max_tokens": 5,
                                             "temperature": 0, "stream": True})
    texts = {}
    for event in sse(r):
        for c in event["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert [texts[i] for i in range(3)] == singles


def test_echo_with_max_tokens_zero_scores_the_prompt(client, tok):
    ids = tok("the cat sat on the mat")["input_ids"]
    r = client.post("/v1/completions", json={"model": "tiny-lm", "prompt": [ids, ids[:3]], "max_tokens": 0,
                                             "echo": True, "logprobs": 0, "temperature": 0}).json()
    assert [len(c["logprobs"]["tokens"]) for c in r["choices"]] == [len(ids), 3]
    whole, prefix = (r["choices"][i]["logprobs"]["token_logprobs"] for i in (0, 1))
    assert whole[0] is None and prefix[0] is None
    # the same positions, read in attentions of other lengths: equal up to fp32 rounding
    assert whole[1:3] == pytest.approx(prefix[1:], rel=1e-5)
    assert r["usage"]["completion_tokens"] == 0


def test_chat_logprobs_and_top_logprobs(oa):
    kw = {"model": "tiny-lm-all", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
          "temperature": 0, "logprobs": True, "top_logprobs": 3}
    c = oa.chat.completions.create(**kw)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert "".join(t.token for t in content) == c.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob  # greedy: the best
        assert bytes(t.bytes).decode() == t.token
    streamed = [t for chunk in oa.chat.completions.create(stream=True, **kw) if chunk.choices
                and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_chat_without_max_tokens_runs_past_sixteen(client, tok):
    r = client.post("/v1/chat/completions", json={"model": "tiny-lm-all", "temperature": 0,
                                                  "messages": [{"role": "user", "content": "hello"}]}).json()
    choice, usage = r["choices"][0], r["usage"]
    assert choice["finish_reason"] == "stop" or usage["completion_tokens"] == 40  # an end token, or the limit


def test_current_chat_message_shapes_are_accepted(client):
    plain = client.post("/v1/chat/completions", json={
        "model": "tiny-lm", "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]})
    shaped = client.post("/v1/chat/completions", json={
        "model": "tiny-lm", "max_tokens": 4, "temperature": 0, "logprobs": False, "user": "u1", "store": False,
        "response_format": {"type": "text"},
        "messages": [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                     {"role": "user", "name": "ann", "content": [{"type": "text", "text": "hello "},
                                                                 {"type": "text", "text": "world"}]}]})
    assert plain.status_code == shaped.status_code == 200, shaped.text
    assert shaped.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    dev = client.post("/v1/chat/completions", json={"model": "tiny-lm", "max_tokens": 2, "messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "hello"}]})
    assert dev.status_code == 200, dev.text


@pytest.mark.parametrize("path,body,fragment", [
    ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop: List should have at most 4 items"),
    ("/v1/completions", {"prompt": "a", "n": 9}, "n: Input should be less than or equal to 8"),
    ("/v1/completions", {"prompt": "a", "logprobs": 6}, "logprobs: Input should be less than or equal to 5"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, "prompt: List should have at least 1 item"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt.1: List should have at least 1 item"),
    ("/v1/completions", {"prompt": ["a"] * 5}, "prompt: at most 4 prompts per request, got 5"),
    ("/v1/completions", {"prompt": [999999]}, "prompt: token id 999999 is outside the vocabulary"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
     "tools.0.function: Field required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "audio": {}}, "audio: not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content.0.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
     "top_logprobs: needs logprobs: true"),
    ("/v1/classify", {"model": "minilm-clf", "input": []}, "input: List should have at least 1 item"),
])
def test_refusals_name_the_field_and_the_limit(client, path, body, fragment):
    r = client.post(path, json={"model": "tiny-lm", **body})
    assert r.status_code in (400, 413, 422) and fragment in r.json()["error"]["message"], r.text


def test_a_refused_request_is_one_log_line_with_its_request_id(client, caplog):
    with caplog.at_level("INFO", logger="manyfold.http"):
        r = client.post("/v1/completions", json={"model": "no-such-model", "prompt": "a"},
                        headers={"x-request-id": "req-42"})
    assert r.status_code == 404 and r.headers["x-request-id"] == "req-42"
    lines = [rec for rec in caplog.records if rec.name == "manyfold.http"]
    assert len(lines) == 1 and lines[0].levelname == "INFO" and lines[0].exc_info is None
    assert "404" in lines[0].getMessage() and "req-42" in lines[0].getMessage()


CHAT = {"model": "tiny-lm", "messages": [{"role": "user", "content": "hello"}]}


def words(n: int) -> list[dict]:
    """A chat whose prompt is n + 2 tokens under the tiny model's template ("user:", the words, "assistant:")."""
    return [{"role": "user", "content": " ".join(["the"] * n)}]


@pytest.mark.parametrize("body,status,message", [
    ({**CHAT, "modalities": ["audio"]}, 422, "modalities: not supported by this server"),
    ({**CHAT, "top_logprobs": 2}, 422, "top_logprobs: needs logprobs: true"),
    ({**CHAT, "model": "minilm-clf"}, 400,
     "model 'minilm-clf' is not a causal language model (its base 'minilm' is an encoder)"),
    ({**CHAT, "model": "minilm"}, 400, "model 'minilm' is not a causal language model"),
    ({**CHAT, "messages": words(298)}, 400, "prompt (300 tokens) exceeds the context of 256 tokens"),
    ({**CHAT, "messages": words(254)}, 400,
     "prompt (256 tokens) fills the context of 256 tokens, leaving no room for a completion"),
    ({**CHAT, "messages": words(250), "max_tokens": 5}, 400,
     "prompt (252 tokens) plus max_tokens (5) exceeds the context of 256 tokens"),
])
def test_chat_refusals_read_as_one_plain_sentence(client, body, status, message):
    r = client.post("/v1/chat/completions", json=body)
    assert (r.status_code, r.json()["error"]["message"]) == (status, message)


def test_an_encoder_route_names_the_model_asked_for(client):
    r = client.post("/v1/embeddings", json={"model": "tiny-lm-top", "input": "a"})
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, "model 'tiny-lm-top' is not an encoder (its base 'tiny-lm' is a causal language model)")


def test_a_body_that_is_not_json_says_where_it_breaks(client):
    body = b'{"model": "tiny-lm",\n "prompt": "a" "max_tokens": 2}'
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert (r.status_code, r.json()["error"]["message"]) == (
        422, "request body is not valid JSON: Expecting ',' delimiter at line 2, column 16")


ENDS_AT_ONCE = ["sat two", "sat moon", "on fish", "and fish", "to ten", "house on"]
"""User messages after which the tiny random Llama's first greedy token is its end-of-turn token (found by
trying; the test takes the first of them that still does)."""


def completion_tokens_counted(client) -> float:
    """manyfold_tokens_total{model="tiny-lm", kind="completion"}, read from /metrics."""
    families = text_string_to_metric_families(client.get("/metrics").text)
    return next((s.value for f in families if f.name == "manyfold_tokens" for s in f.samples
                 if s.name == "manyfold_tokens_total" and s.labels == {"model": "tiny-lm", "kind": "completion"}), 0.0)


def test_an_end_token_sampled_at_once_is_one_completion_token_in_usage_logprobs_and_metrics(client):
    body = {"model": "tiny-lm", "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 1}
    for text in ENDS_AT_ONCE:
        before = completion_tokens_counted(client)
        r = client.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": text}]}).json()
        if r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["message"]["content"] == "":
            break
    else:
        pytest.fail("no message of ENDS_AT_ONCE ends at once on the tiny model any more: find others")
    assert r["usage"]["completion_tokens"] == 1 == len(r["choices"][0]["logprobs"]["content"])
    assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + 1
    assert completion_tokens_counted(client) - before == 1
    streamed = sse(client.post("/v1/chat/completions", json={
        **body, "messages": [{"role": "user", "content": text}], "stream": True,
        "stream_options": {"include_usage": True}}))
    assert streamed[-1]["usage"] == r["usage"]
    assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in streamed if c["choices"]) == 1


@pytest.mark.parametrize("prompt", ["the cat sat on", "hello world", "one two three"])
def test_completion_tokens_count_one_per_logprobs_entry(client, prompt):
    r = client.post("/v1/completions", json={"model": "tiny-lm-all", "prompt": prompt, "max_tokens": 12,
                                             "temperature": 0, "logprobs": 1}).json()
    assert r["usage"]["completion_tokens"] == len(r["choices"][0]["logprobs"]["tokens"]) <= 12
