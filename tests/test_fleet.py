"""Manyfold as a fleet, on this machine: the store on an S3 server on loopback (moto's server mode), a Ray cluster
(ray.cluster_utils.Cluster) of a CPU-less head and worker nodes that each have their own MANYFOLD_CACHE_DIR, and
the app deployed onto it as an operator does, by `manyfold serve --ray-address ADDR --store s3://BUCKET/store
--config fleet.yaml`, serving the bucket with a base of two replicas, one per node.

Checked as a platform relies on it: both nodes serve adapters from S3, each through its own cache; an admin add
is served by both nodes at once and a delete is a 404; a tenant added through the API is served on both
nodes without a restart; two admins adding at once lose nothing; a variant being
replaced is answered as the old or the new, never a mix; a node removed under load leaves no request hanging and
the base comes back on a new node, filling its cache from the store; a replica restarted where the cache is warm
reads nothing from the store (the node-cache counters of /metrics, and the cache's files, say so). The bucket also
holds a base no node can place (its replica asks for 64 CPUs): `manyfold serve` names it and serves the rest, its
requests get 503 naming why, and on SIGTERM its app goes, the pending replica too, while the cluster and Serve on it
stay."""

import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from serve.config import key_digest
from tests.models import write_lora, write_tiny_causal
from tests.test_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.ray]

ADMIN = "sk-fleet-admin"
PROMPT = {"prompt": "the cat sat on the", "max_tokens": 24, "temperature": 0, "logprobs": 1}


@dataclass
class Fleet:
    url: str
    store: str
    cluster: object
    nodes: dict
    """Worker name -> its Ray node."""
    caches: dict[str, Path]
    """Worker name -> its MANYFOLD_CACHE_DIR."""
    adapters: dict[int, str]
    """Seed -> an adapter directory on S3 (s3://...), as an admin names it."""
    root: Path

    def add_worker(self, name: str) -> None:
        self.caches[name] = self.root / f"cache-{name}"
        self.nodes[name] = self.cluster.add_node(num_cpus=1, env_vars={"MANYFOLD_CACHE_DIR": str(self.caches[name])})


def _upload(local: Path, url: str) -> str:
    from serve.store.objects import Objects

    objects = Objects(url)
    for p in sorted(local.rglob("*")):
        if p.is_file():
            objects.put_file(str(p.relative_to(local)), p)
    return url


@contextmanager
def _serving(args: list[str], env: dict[str, str], timeout_s: float = 300.0,
             stop_timeout_s: float = 120.0) -> Iterator[list[str]]:
    """`manyfold serve ARGS` (the console script beside this Python) until it prints `serving ... at http://...`
    -> its output so far and to come. Bounded: if it exits first, or says nothing of the kind in timeout_s, this
    fails with its output. On leaving: SIGTERM (as Kubernetes stops a pod), and within stop_timeout_s it must have
    drained and exited 0 (it removes its app and leaves the cluster running)."""
    cli = subprocess.Popen([str(Path(sys.executable).parent / "manyfold"), "serve", *args], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env={**env, "PYTHONUNBUFFERED": "1"})
    log: list[str] = []
    said = threading.Event()

    def read() -> None:
        for line in cli.stdout:  # ends when the CLI exits
            log.append(line)
            if line.startswith("serving "):
                said.set()
        said.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        said.wait(timeout_s)
        assert any(line.startswith("serving ") for line in log), \
            f"`manyfold serve` did not say it serves in {timeout_s:g} s (exit code {cli.poll()}):\n{''.join(log)}"
        yield log
    finally:
        cli.send_signal(signal.SIGTERM)
        try:
            code = cli.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            cli.kill()
            code = f"none: killed after {stop_timeout_s:g} s"
            cli.wait()
        reader.join(10)
    assert code == 0 and any(line.startswith("drained ") for line in log), \
        f"`manyfold serve` on SIGTERM: exit code {code} (expected 0, after a `drained` line):\n{''.join(log)}"


@pytest.fixture(scope="module")
def fleet(s3_server, tmp_path_factory):
    import uuid

    import boto3

    import serve.deployments  # noqa: F401  (loopback env before ray)
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serve.store.object_store import ObjectStore
    from serve.store.node_cache import NodeCache
    from serve.variants import variant_kind

    root = tmp_path_factory.mktemp("fleet")
    bucket = f"manyfold-fleet-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    store = f"s3://{bucket}/store"
    lm = write_tiny_causal(root / "lm")
    writer = ObjectStore(store, create=True, cache=NodeCache(root / "cache-admin", 1 << 30))
    writer.add_base("lm", lm)
    writer.add_base("big", write_tiny_causal(root / "big", seed=1))
    variant_kind("lora").add(writer, "lm-a", "lm", write_lora(lm, root / "lora-1", seed=1, r=4,
                                                               targets=["q_proj", "v_proj"]))
    adapters = {seed: _upload(write_lora(lm, root / f"lora-{seed}", seed=seed, r=4, targets=["q_proj", "v_proj"]),
                              f"s3://{bucket}/uploads/lora-{seed}") for seed in (2, 3, 4, 5)}
    os.environ["MANYFOLD_CACHE_DIR"] = str(root / "cache-driver")  # the CLI's driver reads the manifest
    # Serve says a replica cannot be placed once it has waited RAY_SERVE_SLOW_STARTUP_WARNING_S (30 s by default,
    # then every _PERIOD_S): an operator's cluster may set it lower, as this one's nodes do (serve/README.md).
    os.environ.update(RAY_SERVE_SLOW_STARTUP_WARNING_S="5", RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S="5")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": True,
                                                            "dashboard_port": free_port()})  # another Ray may run
    fleet = Fleet("", store, cluster, {}, {}, adapters, root)
    for name in ("w1", "w2"):
        fleet.add_worker(name)
    ray.init(address=cluster.address, logging_level="ERROR")  # this driver kills nodes and reads serve.status()
    port = free_port()
    fleet.url = f"http://127.0.0.1:{port}"
    config = root / "fleet.yaml"  # the store is named by --store only: a URL the CLI must not fold into a path
    config.write_text(yaml.safe_dump({
        "port": port, "store_refresh_s": 1.0, "admin_key_sha256": [key_digest(ADMIN)],
        "admin": {"sources": [f"s3://{bucket}/uploads/"]}, "deployment": {"num_cpus": 0.25},
        "start_timeout_s": 600,  # the CLI waits for both replicas: a loaded 2-core machine took over the 120 s default
        "deployments": {"lm": {"num_cpus": 0.25, "num_replicas": 2, "max_replicas_per_node": 1,
                               "max_ongoing_requests": 1},
                        "big": {"num_cpus": 64, "graceful_shutdown_timeout_s": 1}}}))
    try:
        # One proxy, on the head: every node is on this host, so a proxy per node would clash on the port. The
        # CLI's serve.start then finds Serve running with the same HTTP options, and only deploys the app.
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        with _serving(["--ray-address", cluster.address, "--store", store, "--config", str(config)],
                      env=dict(os.environ), timeout_s=660) as log:
            said = [line for line in log if line.startswith(("serving ", "warning: "))]
            assert len(said) == 2 and said[0].startswith("warning: big is not running"), "".join(log)
            assert said[1] == f"serving {store} at {fleet.url}  (Ctrl-C to stop)\n", "".join(log)
            assert not any("HTTP config differs" in line for line in log), "".join(log)
            yield fleet
        assert serve.status().applications == {}  # its app is gone, the pending replica too; Serve runs on
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        for name in ("MANYFOLD_CACHE_DIR", "RAY_SERVE_SLOW_STARTUP_WARNING_S",
                     "RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S"):
            os.environ.pop(name, None)


def _complete(url: str, model: str, headers: dict | None = None) -> tuple[int, object]:
    """-> (status, the greedy answer's tokens and log probabilities, or the error)."""
    with httpx.Client(base_url=url, timeout=120, headers=headers) as c:
        r = c.post("/v1/completions", json={"model": model, **PROMPT})
    body = r.json()
    return r.status_code, body["choices"][0]["logprobs"] if r.status_code == 200 else body["error"]["message"]


def _together(url: str, model: str, n: int, headers: dict | None = None) -> list[tuple[int, object]]:
    """n requests for `model` at once: with one request at a time per replica, both replicas take some."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: _complete(url, model, headers), range(n)))


def _entries(cache: Path, name: str) -> bool:
    """Whether a node's cache holds an entry of that name (its directory is named <name>-<content>)."""
    return any(d.name.rsplit("-", 1)[0] == name for d in (cache / "entries").glob(f"{name}-*"))


def _served_by_every_node(fleet: Fleet, model: str, workers: list[str], rounds: int = 8,
                          headers: dict | None = None) -> set:
    """Requests for `model` until every worker's cache holds it (each replica has loaded it), at most `rounds`
    rounds of 8 at once; every answer must be a 200. -> the distinct answers."""
    answers = set()
    for _ in range(rounds):
        for status, answer in _together(fleet.url, model, 8, headers):
            assert status == 200, answer
            answers.add(repr(answer))
        if all(_entries(fleet.caches[w], model) for w in workers):
            return answers
    raise AssertionError(f"'{model}' was not loaded on every node: "
                         f"{ {w: _entries(fleet.caches[w], model) for w in workers} } "
                         f"{ {w: sorted(p.name for p in (fleet.caches[w] / 'entries').iterdir()) for w in workers if (fleet.caches[w] / 'entries').exists()} }")


def _replicas() -> set[str]:
    """The actor names of the base's replicas alive now."""
    import ray

    from serve.app import APP, deployment_name

    prefix = f"SERVE_REPLICA::{APP}#{deployment_name('lm')}#"
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def _wait_running(replicas: int, old: set[str], kept: int, also=lambda: True, timeout_s: float = 120.0) -> None:
    """Until the base's deployment runs `replicas` replicas, `kept` of them from `old` (Serve may count a replica
    that is lost or killed as running until it notices), and also() holds; bounded: Serve's status read every
    0.2 s."""
    from ray import serve

    from serve.app import APP, deployment_name

    tick = threading.Event()
    for _ in range(int(timeout_s / 0.2)):
        states = serve.status().applications[APP].deployments[deployment_name("lm")].replica_states
        alive = _replicas()
        if states.get("RUNNING", 0) == replicas == sum(states.values()) == len(alive) and len(alive & old) == kept \
                and also():
            return
        tick.wait(0.2)
    raise AssertionError(f"the base did not come back to {replicas} new running replicas in {timeout_s:g} s: "
                         f"{states}")


def _admin(fleet: Fleet):
    return httpx.Client(base_url=fleet.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)


def _node_cache_objects(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "manyfold_node_cache_objects")
    return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}


def _objects(cache: Path) -> dict[str, int]:
    """A node cache's objects, each with its inode: a download writes a new file, so a new inode."""
    return {p.name: p.stat().st_ino for p in (cache / "objects").iterdir() if not p.name.startswith(".")}


def test_both_nodes_serve_adapters_from_s3_each_through_its_own_cache(fleet):
    answers = _served_by_every_node(fleet, "lm-a", ["w1", "w2"])
    assert len(answers) == 1  # the same greedy answer from either node
    assert all(_entries(fleet.caches[w], "lm") for w in ("w1", "w2"))  # each replica read the base on its node


def test_a_base_no_node_can_place_answers_503_naming_why_while_the_others_serve(fleet):
    with httpx.Client(base_url=fleet.url, timeout=120) as http:
        assert http.get("/readyz").status_code == 200  # the bases Ray can place run
        cards = {c["id"]: c["status"] for c in http.get("/v1/models").json()["data"]}
        refused = http.post("/v1/completions", json={"model": "big", **PROMPT})
    assert cards["big"] == "unavailable" and cards["lm"] == "ready", cards
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["message"].startswith(
        "model 'big' is unavailable: base 'big' has no running replica: Ray cannot place it"), refused.text


def test_an_admin_add_is_served_by_both_nodes_and_a_delete_is_a_404_on_both(fleet):
    with _admin(fleet) as admin:
        r = admin.post("/v1/admin/variants", json={"name": "lm-b", "base": "lm", "path": fleet.adapters[2],
                                                   "kind": "lora"})
        assert r.status_code == 201, r.text
        assert len(_served_by_every_node(fleet, "lm-b", ["w1", "w2"])) == 1
        assert admin.delete("/v1/admin/variants/lm-b").status_code == 200
    after = _together(fleet.url, "lm-b", 8)
    assert [s for s, _ in after] == [404] * 8, after


def test_a_tenant_added_through_the_api_is_served_on_both_nodes_without_a_restart(fleet):
    """The operator adds a tenant; its own admin key adds its adapter from the allowed bucket prefix; its API key
    is served by the replicas on both nodes, and refused what it was not granted. Removed again, the fleet is
    open as before (no tenants: no keys asked)."""
    acme, acme_admin = {"Authorization": "Bearer sk-acme"}, {"Authorization": "Bearer sk-acme-admin"}
    tenant = {"name": "acme", "key_sha256": [key_digest("sk-acme")], "admin_key_sha256": [key_digest("sk-acme-admin")],
              "models": ["acme-*"]}
    with _admin(fleet) as admin:
        assert admin.post("/v1/admin/tenants", json=tenant).status_code == 201
        try:
            r = admin.post("/v1/admin/variants", headers=acme_admin, json={"name": "acme-a", "base": "lm",
                                                                           "kind": "lora", "path": fleet.adapters[2]})
            assert r.status_code == 201, r.text
            assert len(_served_by_every_node(fleet, "acme-a", ["w1", "w2"], headers=acme)) == 1
            assert _complete(fleet.url, "lm-a", acme)[0] == 403 and _complete(fleet.url, "acme-a")[0] == 401
        finally:
            admin.delete("/v1/admin/variants/acme-a", headers=acme_admin)
            assert admin.delete("/v1/admin/tenants/acme").status_code == 200
    assert _complete(fleet.url, "lm-a")[0] == 200


def test_two_admins_adding_at_once_lose_nothing(fleet):
    def add(seed: int) -> int:
        with _admin(fleet) as admin:
            return admin.post("/v1/admin/variants", json={"name": f"lm-w{seed}", "base": "lm", "kind": "lora",
                                                          "path": fleet.adapters[seed]}).status_code

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(add, (3, 4))) == [201, 201]
    listed = {m["id"] for m in httpx.get(f"{fleet.url}/v1/models", timeout=60).json()["data"]}
    assert {"lm-w3", "lm-w4"} <= listed
    for seed in (3, 4):
        assert {s for s, _ in _together(fleet.url, f"lm-w{seed}", 2)} == {200}


def test_a_variant_being_replaced_is_answered_as_the_old_or_the_new_never_a_mix(fleet):
    """lm-r is removed and added again with other weights, three times, while clients ask for it: every 200
    answer is exactly what the old adapter or the new one answers alone; between them a 404 may come."""
    with _admin(fleet) as admin:
        expected = {}
        for seed in (3, 5):
            assert admin.post("/v1/admin/variants", json={"name": "lm-r", "base": "lm", "kind": "lora",
                                                          "path": fleet.adapters[seed]}).status_code == 201
            expected[seed] = _complete(fleet.url, "lm-r")[1]
            assert admin.delete("/v1/admin/variants/lm-r").status_code == 200
        assert expected[3] != expected[5]
        stop, seen = threading.Event(), []

        def ask():
            for _ in range(200):  # bounded; ends when the replacing does
                if stop.is_set():
                    return
                seen.append(_complete(fleet.url, "lm-r"))

        readers = [threading.Thread(target=ask) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            for seed in (3, 5, 3):
                assert admin.post("/v1/admin/variants", json={"name": "lm-r", "base": "lm", "kind": "lora",
                                                              "path": fleet.adapters[seed]}).status_code == 201
                assert _complete(fleet.url, "lm-r") == (200, expected[seed])
                assert admin.delete("/v1/admin/variants/lm-r").status_code == 200
        finally:
            stop.set()
            for t in readers:
                t.join()
    assert seen and all(s == 404 or answer in expected.values() for s, answer in seen), seen
    assert {s for s, _ in seen} <= {200, 404}


def test_a_node_removed_under_load_hangs_no_request_and_the_base_returns_on_a_new_node(fleet):
    """A worker (its ingress and one of the base's replicas; not the board's) is removed while clients send
    requests: each gets an answer, a 200 (a request its replica had not answered is sent again to the other) or a
    503 with Retry-After, never a hang or a 500; a new node joins, and the base's second replica starts there,
    filling that node's cache from the store, and serves."""
    from ray.util.state import list_actors

    from serve.app import APP, BOARD

    actors = list_actors(filters=[("state", "=", "ALIVE")])
    ingresses = {a.node_id for a in actors if a.class_name == f"ServeReplica:{APP}:Ingress"}
    board = {a.node_id for a in actors if a.class_name == f"ServeReplica:{APP}:{BOARD}"}
    node_ids = {w: n.node_id for w, n in fleet.nodes.items()}
    assert set(node_ids.values()) <= ingresses  # an ingress on every node (ingress_replicas: per-node)
    lost = next(w for w in ("w1", "w2") if node_ids[w] not in board)
    before = _replicas()
    first, statuses = threading.Event(), []

    def call():
        for _ in range(6):
            statuses.append(_complete(fleet.url, "lm-a")[0])  # a hang would raise httpx's timeout here
            first.set()

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    assert first.wait(120), "the load never got an answer"
    fleet.cluster.remove_node(fleet.nodes.pop(lost))
    for t in threads:
        t.join()
    assert len(statuses) == 36 and set(statuses) <= {200, 503}, statuses
    shutil.rmtree(fleet.caches.pop(lost), ignore_errors=True)
    fleet.add_worker("w3")
    _wait_running(2, old=before, kept=1, also=lambda: _entries(fleet.caches["w3"], "lm"))  # its base, from S3
    kept = next(w for w in fleet.caches if w not in ("w3",))
    _served_by_every_node(fleet, "lm-a", [kept, "w3"])


def test_a_replica_restarted_where_the_cache_is_warm_reads_nothing_from_the_store(fleet):
    """One replica of the base is killed; Serve starts another on the node it left (one replica per node), whose
    cache holds the base: not one object is downloaded (the caches' files are the same files, and the fetch count
    of /metrics, summed over live and gone replicas, does not move) while its hits grow."""
    import ray

    _served_by_every_node(fleet, "lm-a", list(fleet.caches))
    before = {w: _objects(c) for w, c in fleet.caches.items()}
    counted = _node_cache_objects(fleet.url)
    replica = min(_replicas())
    ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
    _wait_running(2, old={replica}, kept=0)
    for _ in range(30):  # the new replica reports its counters to the board when it answers (at least 1/s)
        assert {status for status, _ in _together(fleet.url, "lm-a", 8)} == {200}
        now = _node_cache_objects(fleet.url)
        if now["hit"] > counted["hit"]:
            break
    assert now["fetch"] == counted["fetch"] and now["hit"] > counted["hit"], (counted, now)
    assert {w: _objects(c) for w, c in fleet.caches.items()} == before
