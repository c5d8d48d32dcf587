"""The demo's serving path as a new user meets it (`manyfold demo` builds its store, then serves it as `manyfold
serve --store` does), on a small demo store (tests/demo_store.py) with the real demo's three bases (MiniLM,
SmolLM2, SmolLM2 in NeuZip form): with default settings every base is scheduled on this machine's cores and every
model /v1/models lists answers a request; Ctrl-C with requests in flight refuses new ones with 503 and finishes
every request in flight, streams to their [DONE], before it stops, and leaves no process behind. Joining a running
cluster, with a base no node can place: tests/test_fleet.py."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loadtests.smoke import smoke
from serve.bench.report import descendants
from tests.test_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.ray]
STREAMS, TOKENS = 6, 64


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Served:
    url: str
    log: list[str]
    """Its output so far and to come."""
    process: subprocess.Popen


@contextmanager
def serving(*args: str) -> Iterator[Served]:
    """`manyfold serve ARGS` until it says it serves; on leaving, Ctrl-C (unless it has exited) and wait for it to
    exit, then check that none of the Ray processes under it is left."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "serve.cli", "serve", *args, "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    log: list[str] = []
    ray_processes: set[int] = set()
    try:
        for line in server.stdout:
            log.append(line)
            if line.startswith("serving "):
                break
        assert server.poll() is None, "".join(log)
        threading.Thread(target=lambda: log.extend(server.stdout), daemon=True).start()
        ray_processes = descendants(server.pid)
        assert ray_processes, "no Ray processes under the server:\n" + "".join(log)
        yield Served(f"http://127.0.0.1:{port}", log, server)
    finally:
        ray_processes |= descendants(server.pid)  # replicas started since
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            raise
    left = sorted(p for p in ray_processes | descendants(server.pid) if _alive(p))
    assert not left, f"processes left behind after Ctrl-C: {left}"


@pytest.fixture(scope="module")
def demo_server(demo_store, tmp_path_factory) -> Iterator[Served]:
    """`manyfold serve --store` on the demo store with default settings, shared by the tests before the drain's,
    which stops it. All but the drain's bound: at its 30 s default the drain's seven requests of 64 tokens had to
    end within 30 s, and on a loaded 2-core machine (the suite's other worker) they did not."""
    config = tmp_path_factory.mktemp("demo-serve") / "drain.yaml"
    config.write_text("drain_timeout_s: 600\n")
    with serving("--store", str(demo_store), "--config", str(config)) as served:
        yield served


def test_the_demo_serves_every_model_it_lists_with_default_settings(demo_server):
    url, log = demo_server.url, demo_server.log
    with httpx.Client(base_url=url, timeout=300) as http:
        ready = http.get("/readyz")  # the moment it says it serves, as a client polling /readyz would go on
        assert ready.status_code == 200 and set(ready.json()["bases"].values()) == {"running"}, ready.text
        cards = http.get("/v1/models").json()["data"]
        assert {c["id"] for c in cards if c["kind"] == "base"} == {"minilm", "smollm2", "smollm2-nz"}
        assert all(c["status"] == "ready" for c in cards), cards  # every base scheduled on this machine
        _, answers = smoke(url)
        assert {m: status for m, status, _ in answers} == {c["id"]: 200 for c in cards}, "".join(log[-40:])


def test_sigint_drains_requests_in_flight(demo_server):
    """Ctrl-C while six streams and a plain request of SmolLM2 run (it stops the shared server, so it runs last):
    the drain begins while requests are still running (the 503 says how many it is finishing), every one of them
    ends with all its tokens, and the server exits 0."""
    server, log = demo_server.process, demo_server.log
    body = {"model": "smollm2", "prompt": "the cat sat on", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=demo_server.url, timeout=120) as http:
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
