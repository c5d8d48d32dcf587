"""A row that fails inside the engine is a 500 naming the model and the request, one log line at the ingress;
rows of other models go on, and the next request for the same model is served."""

from fastapi.testclient import TestClient

from serve.config import ServeConfig
from serve.engine import faults
from serve.engine.engine import Engine
from serve.http.app import build_http_app


def test_a_failed_row_is_a_500_naming_the_model_and_the_request(serving_store):
    config = ServeConfig(store=serving_store[0])
    body = {"model": "tiny-lm-top", "prompt": "the cat sat", "max_tokens": 3, "temperature": 0}
    with TestClient(build_http_app(Engine(config), config)) as c:
        with faults.injected("prefill", "tiny-lm-top"):
            failed = c.post("/v1/completions", json=body, headers={"x-request-id": "req-7"})
            other = c.post("/v1/completions", json={**body, "model": "tiny-lm"})
            streamed = c.post("/v1/completions", json={**body, "stream": True}, headers={"x-request-id": "req-8"})
        again = c.post("/v1/completions", json=body)
    assert failed.status_code == 500 and failed.json()["error"] == {
        "message": "model 'tiny-lm-top': its generation failed (InjectedFault: injected fault at prefill) "
                   "(request req-7)",
        "type": "internal_error", "code": "internal_error", "param": None}
    assert other.status_code == 200 and again.status_code == 200
    assert again.json()["choices"][0]["text"] != ""
    assert streamed.status_code == 500 and streamed.json()["error"]["message"].endswith("(request req-8)")
