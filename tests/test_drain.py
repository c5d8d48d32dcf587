"""SIGINT with requests in flight: `manyfold serve` refuses new requests with 503 and finishes every request in
flight, streams to their [DONE], before it stops."""

import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tests.test_server import free_port

pytestmark = pytest.mark.slow
STREAMS, TOKENS = 6, 400


def test_sigint_drains_requests_in_flight(tmp_path):
    """The model is a small random Llama big enough that 400 tokens take seconds: the drain begins while
    every request is still running (the 503 says how many it is finishing)."""
    from serve.store.store import Store
    from tests.models import write_tiny_causal

    lm = write_tiny_causal(tmp_path / "lm", hidden=128, layers=4, positions=1024)
    weights = load_file(lm / "model.safetensors")
    weights["model.embed_tokens.weight"][2] = 0  # the end-of-text token's logit is 0, far below the best: rows
    save_file(weights, lm / "model.safetensors", metadata={"format": "pt"})  # run to max_tokens
    store = Store(tmp_path / "store", create=True)
    store.add_base("lm", lm)
    port = free_port()
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"store": str(store.root), "port": port, "drain_timeout_s": 120,
                                  "limits": {"max_tokens": TOKENS}}))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen([sys.executable, "-m", "serve.cli", "serve", "--config", str(config)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log: list[str] = []
    try:
        for line in server.stdout:  # ends when the server exits
            log.append(line)
            if f"127.0.0.1:{port}" in line and "serving" in line:
                break
        assert server.poll() is None, "".join(log)
        threading.Thread(target=lambda: log.extend(server.stdout), daemon=True).start()
        url = f"http://127.0.0.1:{port}"
        body = {"model": "lm", "prompt": "the cat sat on", "max_tokens": TOKENS, "temperature": 0}
        with httpx.Client(base_url=url, timeout=120) as http:
            whole = [None]
            streams = [http.stream("POST", "/v1/completions", json={**body, "stream": True, "seed": i})
                       for i in range(STREAMS)]
            responses = [s.__enter__() for s in streams]
            lines = [r.iter_lines() for r in responses]
            for it in lines:  # every stream has started: its first event is here
                assert next(it).startswith("data: ")
            plain = threading.Thread(target=lambda: whole.__setitem__(0, http.post("/v1/completions", json=body)))
            plain.start()
            in_flight = 0
            for _ in range(1000):  # until the plain request is in flight too (this /metrics call counts itself)
                metrics = http.get("/metrics").text
                in_flight = int(float(re.search(r"^manyfold_requests_in_flight (\S+)", metrics, re.M).group(1)))
                if in_flight >= STREAMS + 2:
                    break
            assert in_flight >= STREAMS + 2
            server.send_signal(signal.SIGINT)
            for _ in range(1000):  # until the gate has closed
                refused = http.post("/v1/completions", json={**body, "max_tokens": 1})
                if refused.status_code == 503:
                    break
            assert refused.status_code == 503 and refused.headers["retry-after"]
            finishing = int(re.search(r"finishing (\d+)", refused.json()["error"]["message"]).group(1))
            assert finishing >= 1  # requests were still running when the drain began
            for it in lines:
                events = [line.removeprefix("data: ") for line in it if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                last = json.loads(events[-2])
                assert last["choices"][0]["finish_reason"] == "length", last  # all TOKENS of it
            plain.join()
            assert whole[0].status_code == 200 and whole[0].json()["usage"]["completion_tokens"] == TOKENS
            for s in streams:
                s.__exit__(None, None, None)
        assert server.wait(timeout=120) == 0, "".join(log)
        assert any("drained 1 ingress replica" in line for line in log), "".join(log)
    finally:
        if server.poll() is None:
            server.kill()
