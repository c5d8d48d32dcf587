"""The demo's serving path as a new user meets it (`manyfold demo` builds its store, then serves it as `manyfold
serve --store` does), on a small demo store (tests/demo_store.py) with the real demo's three bases (MiniLM, SmolLM2, SmolLM2 in
NeuZip form): with default settings every base is scheduled on this machine's cores and every model /v1/models
lists answers a request; Ctrl-C with requests in flight refuses new ones with 503 and finishes every request in
flight, streams to their [DONE], before it stops, and leaves no process behind. Joining a running cluster, a base
Ray cannot place answers 503 naming why while the others serve, and Ctrl-C leaves the cluster running."""

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

from loadtests.smoke import request_for, smoke
from serve.bench.report import descendants
from tests.test_server import free_port

pytestmark = pytest.mark.slow
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
    ray_processes: set[int]
    process: subprocess.Popen


@contextmanager
def serving(*args: str, own_ray: bool = True) -> Iterator[Served]:
    """`manyfold serve ARGS` until it says it serves; on leaving, Ctrl-C (unless it has exited) and wait for it to
    exit, then check that none of the Ray processes under it is left. own_ray False: it joins a cluster that runs
    without it, so no Ray process is its own."""
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
        assert ray_processes or not own_ray, "no Ray processes under the server"
        yield Served(f"http://127.0.0.1:{port}", log, ray_processes, server)
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
def demo_server(demo_store) -> Iterator[Served]:
    """`manyfold serve --store` on the demo store with default settings, shared by the tests before the drain's,
    which stops it."""
    with serving("--store", str(demo_store)) as served:
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
    """Ctrl-C while six streams and a plain request of SmolLM2 run (it stops the shared server, so it runs before
    the next test, whose `ray stop --force` stops every Ray process of this machine): the drain begins while
    requests are still running (the 503 says how many it is finishing), every one of them ends with all its tokens,
    and the server exits 0."""
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


def test_serve_joins_a_running_cluster_serves_what_it_can_place_and_leaves_the_cluster_running(tmp_path, monkeypatch):
    """`manyfold serve --ray-address` deploys onto a Ray cluster it did not start. A base the cluster cannot place
    (it asks for 64 CPUs) answers 503 naming why, and does not hold back `serving ...` or /readyz, while the
    others serve. Ctrl-C removes its app, the pending replica too, and leaves the cluster and Serve on it
    running."""
    from serve.store.store import Store
    from tests.models import write_tiny_bert, write_tiny_causal

    store = Store(tmp_path / "store", create=True)
    store.add_base("lm", write_tiny_causal(tmp_path / "lm"))
    store.add_base("big", write_tiny_causal(tmp_path / "big", seed=1))
    store.add_base("enc", write_tiny_bert(tmp_path / "enc"))
    config = tmp_path / "serve.json"
    config.write_text(json.dumps({"store": str(store.root), "deployments": {
        "big": {"num_cpus": 64, "graceful_shutdown_timeout_s": 1}}}))
    gcs = free_port()
    # Ray 2.59+ turns token auth on for a head started where a token exists (an earlier local ray.init writes one),
    # and its clients send the token only with RAY_AUTH_MODE=token: this cluster runs without it, on loopback.
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # Serve says a replica cannot be placed once it has waited RAY_SERVE_SLOW_STARTUP_WARNING_S (30 s by default,
    # then every _PERIOD_S): an operator's cluster may set it lower, as this one does, so the test waits 5 s for it.
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_SERVE_SLOW_STARTUP_WARNING_S": "5", "RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S": "5"}
    ray = str(Path(sys.executable).parent / "ray")
    address = f"127.0.0.1:{gcs}"
    subprocess.run([ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs), "--num-cpus", "2",
                    "--include-dashboard", "false", "--disable-usage-stats"], check=True, env=env, capture_output=True)
    try:
        with serving("--config", str(config), "--ray-address", address, own_ray=False) as served, \
                httpx.Client(base_url=served.url, timeout=300) as http:
            log = served.log
            assert any(line.startswith("warning: big is not running") for line in log), log
            ready = http.get("/readyz")
            assert ready.status_code == 200, ready.text  # the bases Ray can place run
            listed = http.get("/v1/models").json()["data"]
            cards = {c["id"]: c["status"] for c in listed}
            for card in [c for c in listed if c["id"] != "big"]:
                card["encoder"] = card["id"] == "enc"
                assert request_for(http, card).status_code == 200
            refused = request_for(http, {"id": "big", "labels": None})
        apps = subprocess.run([sys.executable, "-c", "import ray; from ray import serve; "
                               f"ray.init(address='{address}', logging_level='ERROR'); "
                               "print(sorted(serve.status().applications))"],
                              env=env, capture_output=True, text=True)
        assert apps.returncode == 0 and apps.stdout.strip() == "[]", apps.stderr  # Serve runs, our app is gone
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True)
    assert cards == {"lm": "ready", "enc": "ready", "big": "unavailable"}
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["message"].startswith("model 'big' is unavailable: base 'big' has no running "
                                                         "replica")

