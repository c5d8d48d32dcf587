"""What tenants' programs send, through the HTTP app and the official client: JSON by schema (parse()), JSON mode,
vLLM's structured_outputs and its older guided_* names, tool calls (required, named, streamed), n choices with
seeds, ignore_eos with continuous usage, GET /health; and each bad input refused in one line with nothing run.

The model is a tiny random Llama with SmolLM2's real tokenizer: what it writes is noise, so whatever parses
and validates does so because every token was sampled under the constraint's grammar."""

import json
import threading
from typing import Literal

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.http.app import build_http_app
from serve.store.store import Store
from tests.models import write_tiny_chat_lm

MODEL = "chat-lm"


class Ticket(BaseModel):
    category: Literal["billing", "bug", "account"]
    priority: int = Field(ge=1, le=5)
    summary: str = Field(max_length=16)


class Weather(BaseModel):
    city: str = Field(max_length=12)
    unit: Literal["c", "f"]


class Clock(BaseModel):
    zone: str = Field(max_length=8)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": Weather.model_json_schema()}},
         {"type": "function", "function": {"name": "get_time", "parameters": Clock.model_json_schema()}}]
ARGS = {"get_weather": Weather, "get_time": Clock}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    store = Store(root / "store", create=True)
    store.add_base(MODEL, write_tiny_chat_lm(root / MODEL))
    config = ServeConfig(store=root / "store", limits={"max_tokens": 128})
    engine = Engine(config)
    with TestClient(build_http_app(engine, config)) as c:
        c.engine = engine
        yield c


@pytest.fixture(scope="module")
def oa(client):
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)


def events(response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(e) for e in lines[:-1]]


def grammar_events(client) -> dict[str, float]:
    families = text_string_to_metric_families(client.get("/metrics").text)
    return {s.labels["event"]: s.value for f in families if f.name == "manyfold_grammar_events" for s in f.samples
            if s.name.endswith("_total") and s.labels["base"] == MODEL}


def steps_run(client) -> int:
    return sum(client.engine.bases[MODEL].step_counts.values())


def test_parse_gives_an_object_of_the_pydantic_model_and_a_second_request_compiles_nothing(client, oa):
    for seed in range(2):
        before = grammar_events(client)
        r = oa.beta.chat.completions.parse(model=MODEL, messages=ASK, response_format=Ticket, temperature=1.0,
                                           seed=seed, max_tokens=100)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Ticket)
        after = grammar_events(client)
        if seed:  # the same schema again: found in the cache, nothing compiled
            assert after["compile"] == before["compile"] and after["hit"] == before["hit"] + 1


def test_json_mode_answers_a_json_object(client):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 60, "seed": 2,
                                                  "response_format": {"type": "json_object"}})
    body = r.json()
    assert r.status_code == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


@pytest.mark.parametrize("field,value,check", [
    ("choice", ["positive", "negative", "neutral"], lambda t: t in ("positive", "negative", "neutral")),
    ("regex", "[0-9]{3}-[a-z]{2}", lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-" and t[4:].isalpha()),
    ("grammar", 'root ::= "yes" | "no" | ("maybe " [0-9])', lambda t: t in ("yes", "no") or t[:6] == "maybe "),
    ("json", Clock.model_json_schema(), lambda t: Clock.model_validate_json(t) is not None),
])
def test_structured_outputs_and_the_older_guided_names_constrain_completions_alike(client, field, value, check):
    texts = {}
    for name, extra in (("structured_outputs", {"structured_outputs": {field: value}}),
                        ("guided", {f"guided_{field}": value})):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Answer:", "max_tokens": 40,
                                                 "temperature": 1.0, "seed": 7, "n": 2, **extra})
        assert r.status_code == 200, r.text
        texts[name] = [c["text"] for c in r.json()["choices"]]
        assert all(c["finish_reason"] == "stop" for c in r.json()["choices"])
    assert texts["structured_outputs"] == texts["guided"]
    assert all(check(t) for t in texts["guided"]), texts


def test_a_schema_cut_by_max_tokens_ends_with_length_and_streams_as_text(client):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 3, "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": Ticket.model_json_schema()}}})
    chunks = events(r)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks).startswith('{"')


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_has_arguments_that_validate_against_its_function(client, oa, stream):
    for seed in range(2):
        kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=80, temperature=1.0, seed=seed)
        if stream:
            calls: dict[int, dict] = {}
            for chunk in oa.chat.completions.create(stream=True, **kw):
                for d in chunk.choices[0].delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"name": "", "arguments": "", "id": d.id})
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
                reason = chunk.choices[0].finish_reason or ""
            calls = list(calls.values())
        else:
            r = oa.chat.completions.create(**kw)
            reason = r.choices[0].finish_reason
            calls = [{"name": c.function.name, "arguments": c.function.arguments, "id": c.id}
                     for c in r.choices[0].message.tool_calls]
        assert reason == "tool_calls" and len(calls) == 1 and calls[0]["id"].startswith("call_")
        ARGS[calls[0]["name"]].model_validate_json(calls[0]["arguments"])


def test_a_named_function_is_called_with_arguments_that_validate_and_results_go_back(client, oa):
    r = oa.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, seed=3,
                                   tool_choice={"type": "function", "function": {"name": "get_time"}})
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    Clock.model_validate_json(call.function.arguments)
    again = oa.chat.completions.create(model=MODEL, max_tokens=4, tools=TOOLS, messages=[
        *ASK, r.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "14:05"}])
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_the_deprecated_functions_answer_with_function_call(client):
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 60, "seed": 1,
        "functions": [t["function"] for t in TOOLS], "function_call": {"name": "get_weather"}})
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "function_call", r.text
    assert choice["message"]["function_call"]["name"] == "get_weather" and not choice["message"]["tool_calls"]
    Weather.model_validate_json(choice["message"]["function_call"]["arguments"])


def test_n_choices_draw_from_seed_plus_their_index(client):
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 6, "temperature": 1.0, "top_k": 50, "seed": 40}
    together = client.post("/v1/completions", json={**body, "n": 3}).json()
    alone = [client.post("/v1/completions", json={**body, "seed": 40 + j}).json()["choices"][0]["text"]
             for j in range(3)]
    assert [c["text"] for c in together["choices"]] == alone and [c["index"] for c in together["choices"]] == [0, 1, 2]
    one = client.post("/v1/completions", json=body).json()["usage"]
    assert together["usage"]["prompt_tokens"] == one["prompt_tokens"]  # the prompt counts once


def test_ignore_eos_with_continuous_usage_gives_exactly_max_tokens_and_usage_in_every_chunk(client):
    r = client.post("/v1/completions", json={
        "model": MODEL, "prompt": "Hello", "max_tokens": 64, "ignore_eos": True, "stream": True,
        "logit_bias": {"2": 100}, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = events(r)
    assert all(c["usage"] is not None for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 64 and chunks[-1]["usage"]["total_tokens"] == 64 + 1
    assert client.get("/health").status_code == 200


BAD = [
    ({"prompt": "a", "frobnicate": 1}, 422, "frobnicate: Extra inputs are not permitted"),
    ({"prompt": "a", "top_k": -2}, 422, "top_k: Input should be greater than or equal to -1"),
    ({"prompt": "a", "n": 9}, 422, "n: Input should be less than or equal to 8"),
    ({"prompt": "a", "min_tokens": 5, "max_tokens": 4}, 422, "min_tokens: 5 is more than max_tokens (4)"),
    ({"prompt": "a", "logit_bias": {"99999": 3}}, 400,
     "logit_bias: token id 99999 is outside the vocabulary (0 to 49151)"),
    ({"prompt": "a", "logit_bias": {"the": 3}}, 422, "logit_bias: keys are token ids, got 'the'"),
    ({"prompt": "a", "stop_token_ids": [50000]}, 400,
     "stop_token_ids: token id 50000 is outside the vocabulary (0 to 49151)"),
    ({"prompt": "a", "structured_outputs": {"regex": "(ab"}}, 400,
     "structured output (regex): the grammar library refuses it: Regex parsing error at position 4: "
     "The parenthesis is not closed."),
    ({"prompt": "a", "guided_json": {"type": "frobnicate"}}, 400,
     'structured output (json): the grammar library refuses it: Unsupported type "frobnicate"'),
    ({"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 422,
     "structured_outputs: set exactly one of json, regex, choice, grammar, json_object"),
    ({"prompt": "a", "guided_regex": "a", "guided_choice": ["b"]}, 422,
     "guided_choice: set only one of guided_regex, guided_choice"),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 422,
     "tool_choice: function 'nope' is not in tools"),
    ({"messages": ASK, "tool_choice": "required"}, 422, "tool_choice: needs tools"),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, 422,
     "response_format: not with tool_choice required"),
    ({"messages": ASK, "response_format": {"type": "json_schema"}}, 422,
     "response_format: json_schema: given exactly when type is json_schema"),
]


@pytest.mark.parametrize("body,status,message", BAD)
def test_a_bad_input_is_refused_in_one_line_and_nothing_runs(client, body, status, message):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    steps = steps_run(client)
    r = client.post(path, json={"model": MODEL, "max_tokens": 4, **body})
    assert (r.status_code, r.json()["error"]["message"]) == (status, message)
    assert steps_run(client) == steps


def test_a_compile_past_the_bound_is_a_400_and_the_grammar_is_kept_once_compiled(client, monkeypatch):
    """The compile is held until the request has its answer: on a loaded machine the worker thread could finish
    it before the bound of a microsecond was even checked."""
    grammars = client.engine.grammars[MODEL]
    bound, compile_, release = grammars.config, grammars._compile, threading.Event()

    def held(key):
        release.wait(60)
        return compile_(key)

    monkeypatch.setattr(grammars, "_compile", held)
    grammars.config = bound.model_copy(update={"compile_timeout_s": 1e-6})
    try:
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 4,
                                                 "guided_regex": "[a-f]{3}z"})
    finally:
        grammars.config = bound
        release.set()
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, "structured output (regex): compiling its grammar took longer than 1e-06 s")
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 4,
                                                "guided_regex": "[a-f]{3}z"}).status_code == 200
