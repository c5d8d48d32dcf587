"""`python -m loadtests.run --scenario nodeloss`: what clients see when a node goes under load (issue 62).

A Ray cluster on this machine (ray.cluster_utils.Cluster): a CPU-less head, which runs the one HTTP proxy (every
node is on this host, so a proxy per node would clash on the port), and two workers of one CPU each. `manyfold serve
--ray-address` deploys the fairness scenario's store (SmolLM2-135M and eight LoRA adapters) onto it as an operator
does: the base at two replicas, one a worker, and an ingress on every node (`ingress_replicas: per-node`, the
default). Each round: 24 greedy completions of 64 tokens in flight over the eight adapters, half of them streamed;
the older worker (its replica holds the adapters: Serve sends an adapter's requests where it is loaded) is removed
as soon as all are sent in one round, once the first streams have begun in the next; the lost node holds an
ingress and a replica each time. Each request's outcome is recorded: 200, 503 with Retry-After, a stream's error
event, another status, a lost connection, or no answer within --timeout (a hang). A new worker then joins, and the
next round starts once the base runs two replicas again. /metrics' manyfold_replica_lost_requests_total
says how many requests were sent again to the surviving replica. The check: no 500, none hangs, every answer a 200
or a 503 with Retry-After (streamed: an error event naming the lost replica). Table on stdout;
bench-results/nodeloss.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

from loadtests.fairness import TENANTS, build_store, model_of
from loadtests.fairness_load import log
from loadtests.generator import free_port
from serve.bench.report import finish, machine

BASE = "smollm2"
REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.run --scenario nodeloss", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["nodeloss"], default="nodeloss")
    p.add_argument("--rounds", type=int, default=6, help="workers removed, one a round")
    p.add_argument("--requests", type=int, default=24, help="in flight when the worker goes")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--begun", type=int, default=4, help="streams that have begun before the worker is removed, in "
                   "every other round (the others remove it as soon as the requests are sent)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds without an answer that count as a hang")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/nodeloss.json")
    return p.parse_args(argv)


class Cli:
    """`manyfold serve ARGS` as a child, serving once it prints `serving ...`; stopped with SIGTERM."""

    def __init__(self, args: list[str], timeout_s: float):
        self.proc = subprocess.Popen([sys.executable, "-m", "serve.cli", "serve", *args], cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        said = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("serving "):
                    said.set()
            said.set()

        threading.Thread(target=read, daemon=True).start()
        said.wait(timeout_s)
        if not any(line.startswith("serving ") for line in self.lines):
            self.stop()
            raise RuntimeError("manyfold serve did not serve:\n" + "".join(self.lines[-40:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def placement() -> dict[str, set[str]]:
    """Node id -> the app's deployments with a replica alive there (Serve names a replica's actor class
    ServeReplica:APP:DEPLOYMENT)."""
    from ray.util.state import list_actors

    from serve.app import APP

    out: dict[str, set[str]] = {}
    for a in list_actors(filters=[("state", "=", "ALIVE")], limit=10000):
        if a.class_name.startswith(f"ServeReplica:{APP}:"):
            out.setdefault(a.node_id, set()).add(a.class_name.rsplit(":", 1)[1])
    return out


def wait_running(replicas: int, timeout_s: float) -> None:
    """Until the base runs `replicas` replicas and no other (bounded; Serve's status every 0.5 s)."""
    from ray import serve

    from serve.app import APP, deployment_name

    tick = threading.Event()
    for _ in range(int(timeout_s / 0.5)):
        app = serve.status().applications.get(APP)
        if app is not None:
            states = app.deployments[deployment_name(BASE)].replica_states
            if states.get("RUNNING", 0) == replicas == sum(states.values()):
                return
        tick.wait(0.5)
    raise RuntimeError(f"the base did not run {replicas} replicas within {timeout_s:g} s")


def lost_counts(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        if family.name == "manyfold_replica_lost_requests":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0.0) + s.value
    return out


async def one(http: httpx.AsyncClient, model: str, prompt: str, stream: bool, max_tokens: int, begun: asyncio.Event,
              started: list[int], need: int, timeout_s: float) -> dict:
    """One request's outcome: status, Retry-After, for a stream whether it had begun and its error event. `begun` is
    set once `need` streams have had their first event (`started` counts them)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    out: dict = {"model": model, "stream": stream}
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("POST", "/v1/completions", json=body) as r:
                out.update(status=r.status_code, retry_after=r.headers.get("retry-after"))
                if not stream or r.status_code != 200:
                    await r.aread()
                    if r.status_code != 200:
                        out["error"] = r.json().get("error", {}).get("message")
                    return out
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        out["error_event"] = event["error"].get("code") or event["error"].get("type")
                        out["error"] = event["error"].get("message")
                    elif not out.get("begun"):
                        out["begun"] = True
                        started.append(1)
                        if len(started) >= need:
                            begun.set()
    except TimeoutError:
        out["status"] = "hang"
    except httpx.HTTPError as e:
        out["status"] = f"connection: {type(e).__name__}"
    return out


def outcome(r: dict) -> str:
    if r["status"] == 200:
        return "stream error event" if r.get("error_event") else "200"
    if r["status"] == 503:
        return "503 Retry-After" if r.get("retry_after") else "503 without Retry-After"
    return str(r["status"])


async def round_of(url: str, args: argparse.Namespace, prompts: list[str], remove, need: int) -> list[dict]:
    """The requests sent, then `remove` run once `need` streams have begun (0: at once); -> their outcomes."""
    begun, started, sent, going = asyncio.Event(), [], asyncio.Event(), []

    async def on_its_way(request: httpx.Request) -> None:
        going.append(request)
        if len(going) == args.requests:
            sent.set()

    models = [model_of(t) for t in TENANTS]
    async with httpx.AsyncClient(base_url=url, timeout=None, event_hooks={"request": [on_its_way]}) as http:
        calls = [asyncio.ensure_future(one(http, models[i % len(models)], prompts[i % len(prompts)], i % 2 == 1,
                                           args.max_tokens, begun, started, need, args.timeout))
                 for i in range(args.requests)]
        async with asyncio.timeout(args.timeout):
            await sent.wait()
        if need:
            try:
                async with asyncio.timeout(args.timeout):
                    await begun.wait()
            except TimeoutError:
                log("too few streams began in time: removing the worker anyway")
        await asyncio.get_running_loop().run_in_executor(None, remove)
        return list(await asyncio.gather(*calls))


def main(argv: list[str] | None = None) -> dict:
    import serve.deployments  # noqa: F401  (Ray on loopback: set before ray is imported)
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from loadtests.tenant_load import fortune_prompts

    args = parse_args(argv)
    t0 = time.perf_counter()
    store = build_store(args.seed)
    prompts = fortune_prompts()[:args.requests]
    work = Path(tempfile.mkdtemp(prefix="mf-loss-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    (work / "config.yaml").write_text(yaml.safe_dump({
        "port": port, "drain_timeout_s": 5, "start_timeout_s": args.start_timeout,
        "deployments": {BASE: {"num_cpus": 1, "num_replicas": 2, "max_replicas_per_node": 1,
                               "graceful_shutdown_timeout_s": 2}}}))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": True})  # list_actors
    workers = {}

    def add_worker(name: str) -> None:
        workers[name] = cluster.add_node(num_cpus=1)

    for name in ("w1", "w2"):
        add_worker(name)
    ray.init(address=cluster.address, logging_level="ERROR")
    rounds, cli = [], None
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        cli = Cli(["--ray-address", cluster.address, "--store", str(store), "--config", str(work / "config.yaml")],
                  args.start_timeout)
        log(f"serving at {url}: {''.join(line for line in cli.lines if line.startswith(('serving', 'warning')))}")
        for k in range(args.rounds):
            wait_running(2, args.start_timeout)
            lost = min(workers, key=lambda w: int(w[1:]))  # the older worker: its replica holds the adapters
            need = 0 if k % 2 == 0 else args.begun
            node_id = workers[lost].node_id
            held = placement()
            before = lost_counts(url)
            t = time.perf_counter()

            def remove(lost=lost) -> None:
                cluster.remove_node(workers.pop(lost))

            results = asyncio.run(round_of(url, args, prompts, remove, need))
            seconds = time.perf_counter() - t
            counts = {o: sum(outcome(r) == o for r in results) for o in sorted({outcome(r) for r in results})}
            after = lost_counts(url)
            resent = {o: after.get(o, 0.0) - before.get(o, 0.0) for o in ("resent", "unavailable")}
            rounds.append({"round": k + 1, "lost": lost, "on_lost_node": sorted(held.get(node_id, ())), "begun": need,
                           "outcomes": counts, "replica_lost": resent, "seconds": seconds, "requests": results})
            log(f"round {k + 1}: removed {lost} (it held {', '.join(sorted(held.get(node_id, ()))) or 'nothing'}) "
                f"once {need} streams had begun: "
                f"{counts}; /metrics replica_lost {resent}")
            add_worker(f"w{3 + k}")
    finally:
        if cli is not None:
            cli.stop()
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    bad = [o for r in rounds for o in r["outcomes"] if o not in ("200", "503 Retry-After", "stream error event")]
    report = {"machine": machine(), "command": "python -m loadtests.run " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv),
              "spec": vars(args), "rounds": rounds, "wall_s": time.perf_counter() - t0,
              "check": {"only_200_or_503_with_retry_after": not bad, "other_outcomes": sorted(set(bad))}}
    return finish(report, Path(args.out), print_table)


def print_table(report: dict) -> None:
    s = report["spec"]
    print(f"\n{s['requests']} requests in flight a round ({s['max_tokens']} tokens, half streamed) over 8 adapters; "
          "one worker removed a round")
    print(f"{'round':<7}{'lost':<6}{'it held':<40}{'begun':>6}{'200':>5}{'503+RA':>8}{'stream err':>11}{'other':>7}"
          f"{'resent':>8}{'s':>7}")
    for r in report["rounds"]:
        o = r["outcomes"]
        other = sum(v for k, v in o.items() if k not in ("200", "503 Retry-After", "stream error event"))
        print(f"{r['round']:<7}{r['lost']:<6}{', '.join(r['on_lost_node']):<40}{r['begun']:>6}{o.get('200', 0):>5}"
              f"{o.get('503 Retry-After', 0):>8}{o.get('stream error event', 0):>11}{other:>7}"
              f"{r['replica_lost']['resent']:>8.0f}{r['seconds']:>7.1f}")
