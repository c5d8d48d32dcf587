"""`manyfold bench soak`: does a server stay up, answer everything and keep its memory over a long mixed run?

A small store of every kind on the packaged models (MiniLM: two classifier full fine-tunes and their EMR group;
SmolLM2: a top-layer full fine-tune and a PiSSA adapter, also in NeuZip form), served by Ray Serve on 127.0.0.1
in this process with default settings. A closed loop finds the completed req/s at saturation for the mix
(classify on MiniLM variants, 8-token completions on the SmolLM2 ones); then Poisson arrivals at `load` of it for
`duration_s`, while every `churn_s` a copy of a variant is registered over the admin API and the copy before it
removed (each joins the mix while it exists), and the RSS of every server process is read from /proc.
"""

import asyncio
import importlib.util
import os
import random
import secrets
import socket
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from serve.bench.report import Sampler, finish, machine, percentile, process_tree_rss

CHURN_PREFIX = "soak-churn-"
TEXTS = ("WINNER! You have been selected for a free cruise, call now", "The match ended in a late draw.",
         "I loved this film, the acting was superb.", "Shares fell sharply after the results.")
PROMPTS = ("Give me one short piece of advice.", "Tell me about the sea.", "Name a famous bridge.")


@dataclass(frozen=True)
class SoakSpec:
    duration_s: float = 600.0
    load: float = 0.8
    """Offered rate as a share of the measured saturation rate."""
    churn_s: float = 60.0
    warmup_s: float = 60.0
    """RSS "after warm-up" is the first sample at or past this time (at most a third of the run)."""
    probe_s: float = 30.0
    probe_concurrency: int = 16
    max_in_flight: int = 256
    """Arrivals beyond this many requests in flight are shed at the client and counted."""
    timeout_s: float = 120.0
    """A request unanswered this long counts as hung."""
    sample_s: float = 5.0
    max_tokens: int = 8
    seed: int = 0


def _log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_soak_store(root: Path):
    """The demo builder with small task settings (cached: a built store is reused), minus any copies a killed
    run left behind."""
    from serve.demo import AdapterTask, DemoTask, EmrGroup, LmTask, build_demo_store

    store = build_demo_store(
        root, tasks=(DemoTask("minilm-spam", "spam", 64, 32), DemoTask("minilm-sentiment", "sentiment", 64, 32)),
        lm_tasks=(LmTask("smollm2-fortunes", "fortunes", steps=2, top_layers=1, max_len=32),),
        adapter_tasks=(AdapterTask("smollm2-spam-pissa", "spam", 8, steps=2, max_length=32),),
        emr_groups=(EmrGroup("minilm-emr", "minilm", (("spam", "minilm-spam"), ("sentiment", "minilm-sentiment"))),),
        log=_log)
    for name in [n for n in store.manifest.variants if n.startswith(CHURN_PREFIX)]:
        store.remove(name)
    return store


def churn_sources(store, work: Path) -> list[dict]:
    """What the churn registers: each full variant decoded to a HF directory, and each adapter's stored
    directory; -> admin request bodies without a name."""
    from serve.variants.full import extract_full_variant

    sources: dict[tuple[str, str], dict] = {}
    for v in store.manifest.variants.values():
        if v.kind in ("full", "lora", "pissa") and (v.kind, v.base) not in sources:  # one of each kind per base
            path = extract_full_variant(store, v.name, work / v.name) if v.kind == "full" else store.variant_dir(v.name)
            sources[v.kind, v.base] = {"kind": v.kind, "base": v.base, "path": str(path)}
    return list(sources.values())


def server_rss(root_pid: int, app: str, deployments: set[str]) -> dict[str, float]:
    """MiB of RSS per group: each deployment of `app` (a replica's title is `ServeReplica:APP:NAME`, then
    `.method` while it runs one), Serve's controller and proxy, and the rest of Ray."""
    groups: dict[str, float] = {}
    for cmd, rss in process_tree_rss(root_pid).values():
        if (marker := f"ServeReplica:{app}:") in cmd:
            title = cmd.split(marker, 1)[1].split()[0]
            group = title if title in deployments else title.rsplit(".", 1)[0]
        else:
            group = "controller" if "ServeController" in cmd else "proxy" if "ProxyActor" in cmd else "ray-other"
        groups[group] = groups.get(group, 0.0) + rss / (1 << 20)
    return groups


def request_for(card: dict, rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    """A model card of /v1/models -> (route, body): classify for classifiers, embeddings for encoder bases,
    a short greedy completion otherwise."""
    if card.get("labels"):
        return "/v1/classify", {"model": card["id"], "input": rng.choice(TEXTS)}
    if card["id"] == "minilm" or card.get("parent") == "minilm":
        return "/v1/embeddings", {"model": card["id"], "input": rng.choice(TEXTS)}
    return "/v1/completions", {"model": card["id"], "prompt": rng.choice(PROMPTS), "max_tokens": max_tokens,
                               "temperature": 0}


@dataclass
class Recorder:
    """Every request's (sent at, seconds to its answer, outcome, model); outcome: the status, "hung" or an error."""

    t0: float
    rows: list[tuple[float, float, str, str]] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)

    async def send(self, client: httpx.AsyncClient, card: dict, rng: random.Random, spec: SoakSpec) -> None:
        route, body = request_for(card, rng, spec.max_tokens)
        model, start = card["id"], time.perf_counter()
        self.in_flight[model] = self.in_flight.get(model, 0) + 1
        try:
            async with asyncio.timeout(spec.timeout_s):
                outcome = str((await client.post(route, json=body)).status_code)
        except (TimeoutError, httpx.TimeoutException):
            outcome = "hung"
        except httpx.HTTPError as e:
            outcome = type(e).__name__
        finally:
            self.in_flight[model] -= 1
        self.rows.append((start - self.t0, time.perf_counter() - start, outcome, model))


async def probe(client: httpx.AsyncClient, cards: list[dict], spec: SoakSpec) -> dict:
    """Closed loop of probe_concurrency workers over the mix; completed req/s after the first third."""
    rng, rec = random.Random(spec.seed + 1), Recorder(time.perf_counter())

    async def worker() -> None:
        while time.perf_counter() < rec.t0 + spec.probe_s:
            await rec.send(client, rng.choice(cards), rng, spec)

    await asyncio.gather(*(worker() for _ in range(spec.probe_concurrency)))
    skip = spec.probe_s / 3
    done = [r for r in rec.rows if r[2] == "200" and skip <= r[0] + r[1] <= spec.probe_s]
    return {"concurrency": spec.probe_concurrency, "probe_s": spec.probe_s, "requests": len(rec.rows),
            "completed_rps": len(done) / (spec.probe_s - skip), "errors": sum(r[2] != "200" for r in rec.rows),
            "took_s": time.perf_counter() - rec.t0}


@dataclass
class Soak:
    """What the arrivals and the churn share: the client, the mix of the moment, every request and churn event."""

    client: httpx.AsyncClient
    spec: SoakSpec
    headers: dict
    mix: dict[str, dict]
    rec: Recorder
    events: list[dict] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    shed: int = 0

    async def admin(self, op: str, name: str, **kw) -> dict | None:
        """An admin call that never raises, logged as an event; -> the JSON answer when 2xx."""
        t, url = time.perf_counter(), "/v1/admin/variants" + ("" if op == "add" else f"/{name}")
        try:
            r = await self.client.request("POST" if op == "add" else "DELETE", url, headers=self.headers,
                                          timeout=self.spec.timeout_s, **kw)
            status, answer = str(r.status_code), r.json() if r.is_success else None
        except httpx.HTTPError as e:
            status, answer = type(e).__name__, None
        at = t - self.rec.t0  # "final": after the arrivals, the last copy's removal
        self.events.append({"t_s": at, "op": op, "name": name, "status": status, "took_s": time.perf_counter() - t,
                            "final": at >= self.spec.duration_s, **kw.get("json", {})})
        _log(f"churn: {op} {name}: {status}")
        return answer

    async def churn(self, sources: list[dict]) -> None:
        """Every churn_s: register a copy of a variant under a new name, and remove the copy made before it: out of
        the mix first, then off the server once its requests are answered (bounded)."""
        alive, tick = [], 0
        while await self._next_tick():
            tick += 1
            name = f"{CHURN_PREFIX}{tick:03d}"
            if (card := await self.admin("add", name, json={"name": name, **sources[(tick - 1) % len(sources)]})):
                self.mix[name] = card
                alive.append(name)
            if len(alive) > 1:
                await self.remove(alive.pop(0))
        for name in alive:
            await self.remove(name)

    async def _next_tick(self) -> bool:
        """Wait churn_s; -> False once the arrivals are over, or are by then."""
        try:
            return not await asyncio.wait_for(self.stop.wait(), self.spec.churn_s)
        except TimeoutError:
            return time.perf_counter() < self.rec.t0 + self.spec.duration_s

    async def remove(self, name: str) -> None:
        self.mix.pop(name, None)
        deadline = time.perf_counter() + self.spec.timeout_s
        while self.rec.in_flight.get(name, 0) and time.perf_counter() < deadline:
            await asyncio.sleep(0.1)
        await self.admin("remove", name)

    async def arrivals(self, rate: float, sampler: Sampler) -> None:
        """Poisson arrivals at `rate` for duration_s over the mix of the moment, at most max_in_flight at once."""
        rng, spec, rec = random.Random(self.spec.seed), self.spec, self.rec
        tasks, at, note = set(), rec.t0, spec.duration_s / 10
        while (at := at + rng.expovariate(rate)) < rec.t0 + spec.duration_s:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            if sum(rec.in_flight.values()) >= spec.max_in_flight:
                self.shed += 1
                continue
            task = asyncio.create_task(rec.send(self.client, rng.choice(list(self.mix.values())), rng, spec))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if at - rec.t0 >= note:
                note += spec.duration_s / 10
                rss = sum(sampler.samples[-1]["mib"].values()) if sampler.samples else 0.0
                _log(f"{at - rec.t0:.0f}/{spec.duration_s:.0f} s: {len(rec.rows)} answered, "
                     f"{sum(rec.in_flight.values())} in flight, server RSS {rss:.0f} MiB")
        _log(f"arrivals done; waiting for {len(tasks)} requests in flight (at most {spec.timeout_s:.0f} s)")
        await asyncio.gather(*tasks)


def rss_summary(samples: list[dict], warmup_s: float) -> dict:
    """Per group and in total: MiB at the first sample past warm-up, at the last one, and end / warm-up."""
    warm, end = next((s for s in samples if s["t_s"] >= warmup_s), samples[-1]), samples[-1]
    groups = sorted({g for s in samples for g in s["mib"]})
    out = {g: {"warm_mib": warm["mib"].get(g, 0.0), "end_mib": end["mib"].get(g, 0.0)} for g in groups}
    out["total"] = {"warm_mib": sum(warm["mib"].values()), "end_mib": sum(end["mib"].values())}
    for row in out.values():
        row["end_over_warm"] = row["end_mib"] / row["warm_mib"] if row["warm_mib"] else float("nan")
    return {"warm_t_s": warm["t_s"], "end_t_s": end["t_s"], "groups": out}


def request_summary(rec: Recorder, shed: int, spec: SoakSpec) -> dict:
    """Counts by outcome, latency percentiles of the answered-200 requests, rates and per-window p99."""
    outcomes = dict(Counter(r[2] for r in rec.rows))
    ok = [r[1] for r in rec.rows if r[2] == "200"]
    wall = max((r[0] + r[1] for r in rec.rows), default=spec.duration_s)
    window = max(10.0, spec.duration_s / 10)
    windows = []
    for i in range(int(-(-spec.duration_s // window))):
        rows = [r for r in rec.rows if i * window <= r[0] < (i + 1) * window]
        lat = [r[1] for r in rows if r[2] == "200"]
        windows.append({"start_s": i * window, "sent": len(rows), "ok": len(lat), "p99_s": percentile(lat, 0.99)})
    count = lambda test: sum(n for k, n in outcomes.items() if test(k))  # noqa: E731
    return {"sent": len(rec.rows), "answered": count(str.isdigit), "ok": len(ok), "shed_at_client": shed,
            "outcomes": outcomes, "errors_4xx": count(lambda k: k[0] == "4"),
            "errors_5xx": count(lambda k: k[0] == "5"), "hung": outcomes.get("hung", 0),
            "transport_errors": count(lambda k: not k.isdigit() and k != "hung"),
            "p50_s": percentile(ok, 0.5), "p95_s": percentile(ok, 0.95), "p99_s": percentile(ok, 0.99),
            "offered_rps": (len(rec.rows) + shed) / spec.duration_s, "completed_rps": len(ok) / wall,
            "wall_s": wall, "window_s": window, "windows": windows}


def print_report(report: dict) -> None:
    """The soak as small tables: what was asked, the requests, the churn, RSS per group."""
    r, s, sat, c, rss = (report[k] for k in ("requests", "spec", "saturation", "churn", "rss"))
    print(f"machine: {report['machine']}\nmodels: {', '.join(report['models'])}")
    print(f"saturation {sat['completed_rps']:.2f} req/s completed (closed loop, {sat['concurrency']} in flight, "
          f"{sat['probe_s']:.0f} s); soak at {s['load']:.0%} of it for {s['duration_s']:.0f} s, churn every "
          f"{s['churn_s']:.0f} s; " + ", ".join(f"{k} {v:.0f} s" for k, v in report["timings"].items()))
    cols = [("sent", "sent", "d"), ("answered", "answered", "d"), ("ok", "ok", "d"), ("4xx", "errors_4xx", "d"),
            ("5xx", "errors_5xx", "d"), ("hung", "hung", "d"), ("other", "transport_errors", "d"),
            ("shed", "shed_at_client", "d"), ("offered/s", "offered_rps", ".2f"), ("done/s", "completed_rps", ".2f"),
            ("p50 s", "p50_s", ".2f"), ("p95 s", "p95_s", ".2f"), ("p99 s", "p99_s", ".2f")]
    print(" ".join(f"{h:>9}" for h, _, _ in cols) + "\n" + " ".join(f"{r[k]:>9{f}}" for _, k, f in cols))
    print(f"outcomes: {', '.join(f'{k} {n}' for k, n in sorted(r['outcomes'].items()))}")
    print(f"churn: {c['adds_ok']}/{c['adds']} adds, {c['removes_ok']}/{c['removes']} removes answered 2xx (+"
          f"{c['final_removes']} after the run), slowest add {c['add_s_max']:.1f} s; requests to the copies: "
          f"{c['ok_to_copies']}/{c['requests_to_copies']} ok")
    print(f"{'RSS MiB':<20} {'at %.0f s' % rss['warm_t_s']:>10} {'at %.0f s' % rss['end_t_s']:>10} {'change':>8}")
    for g, row in rss["groups"].items():
        print(f"{g:<20} {row['warm_mib']:>10.0f} {row['end_mib']:>10.0f} {row['end_over_warm'] - 1:>+8.1%}")
    print(f"answered: any HTTP status; ok: 200; hung: no answer within {s['timeout_s']:.0f} s; other: transport "
          f"errors; shed: arrivals dropped at the client's cap of {s['max_in_flight']} in flight; latency of the ok "
          "requests; RSS from /proc of every process under this one (the load generator itself not counted)")


def plot(report: dict, path: Path) -> None:
    """RSS over time per group and in total, churn marked; p99 latency per window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    samples = report["rss_samples"]
    t = [s["t_s"] for s in samples]
    for g in sorted({g for s in samples for g in s["mib"]}):
        a.plot(t, [s["mib"].get(g, 0.0) for s in samples], label=g)
    a.plot(t, [sum(s["mib"].values()) for s in samples], label="total", color="black", linewidth=2)
    for e in report["churn"]["events"]:
        a.axvline(e["t_s"], color="#3b7" if e["op"] == "add" else "#c44", alpha=0.3, linewidth=1)
    a.set(ylabel="RSS (MiB)", title="server RSS per deployment (green: a variant added, red: removed)")
    a.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    w = report["requests"]["windows"]
    b.plot([x["start_s"] + report["requests"]["window_s"] / 2 for x in w], [x["p99_s"] for x in w], marker="o")
    b.set(ylabel=f"p99 latency (s) per {report['requests']['window_s']:.0f} s",
          xlabel="time since the soak started (s)")
    fig.suptitle(f"soak: {report['spec']['load']:.0%} of {report['saturation']['completed_rps']:.2f} req/s for "
                 f"{report['spec']['duration_s']:.0f} s; {report['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def churn_summary(events: list[dict], rec: Recorder) -> dict:
    """Adds and removes during the run (and the copies removed after it), and how their requests fared."""
    during = [e for e in events if not e["final"]]
    adds, removes = [e for e in during if e["op"] == "add"], [e for e in during if e["op"] == "remove"]
    copies = [r for r in rec.rows if r[3].startswith(CHURN_PREFIX)]
    return {"adds": len(adds), "adds_ok": sum(e["status"] == "201" for e in adds), "removes": len(removes),
            "removes_ok": sum(e["status"] == "200" for e in removes), "final_removes": len(events) - len(during),
            "add_s_max": max((e["took_s"] for e in adds), default=0.0), "requests_to_copies": len(copies),
            "ok_to_copies": sum(r[2] == "200" for r in copies), "events": events}


async def drive(url: str, key: str, sources: list[dict], spec: SoakSpec, app: str, deployments: set[str]) -> dict:
    """Warm every model, probe saturation, then soak at `load` of it with churn beside, sampling RSS."""
    limits = httpx.Limits(max_connections=spec.max_in_flight + 4)  # + the admin calls
    async with httpx.AsyncClient(base_url=url, timeout=spec.timeout_s, limits=limits) as client:
        cards = (await client.get("/v1/models")).json()["data"]
        _log(f"warming {len(cards)} models, one request each")
        warm = Recorder(time.perf_counter())
        for card in cards:  # every variant decoded and every code path run before a clock starts
            await warm.send(client, card, random.Random(spec.seed), spec)
        if failed := [f"{r[3]}: {r[2]}" for r in warm.rows if r[2] != "200"]:
            _log(f"warm-up failures: {', '.join(failed)}")
        _log(f"saturation probe: closed loop, {spec.probe_concurrency} in flight, {spec.probe_s:.0f} s")
        sat = await probe(client, cards, spec)
        rate = spec.load * sat["completed_rps"]
        _log(f"saturation {sat['completed_rps']:.2f} req/s; soak at {rate:.2f} req/s for {spec.duration_s:.0f} s")
        sampler = Sampler(lambda: {"mib": server_rss(os.getpid(), app, deployments)}, spec.sample_s)
        run = Soak(client, spec, {"Authorization": f"Bearer {key}"}, {c["id"]: c for c in cards}, Recorder(sampler.t0))
        churner = asyncio.create_task(run.churn(sources))
        try:
            await run.arrivals(rate, sampler)
        finally:
            run.stop.set()
            await churner
            sampler.stop()
    return {"models": [c["id"] for c in cards], "saturation": sat, "requests": request_summary(run.rec, run.shed, spec),
            "churn": churn_summary(run.events, run.rec), "rss_samples": sampler.samples,
            "rss": rss_summary(sampler.samples, min(spec.warmup_s, spec.duration_s / 3))}


def serve_and_drive(store, spec: SoakSpec, sources: list[dict]) -> dict:
    """Ray Serve in this process on a free loopback port, default settings plus an admin key for this run."""
    import serve.deployments  # noqa: F401  (Ray on loopback: before ray is imported)
    import ray
    from ray import serve as ray_serve

    from serve.app import APP, build_app
    from serve.config import ServeConfig, key_digest

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = secrets.token_urlsafe(24)
    config = ServeConfig(store=store.root, port=port, admin_key_sha256=[key_digest(key)],
                         admin={"sources": sorted({s["path"] for s in sources})})
    _log(f"starting Ray Serve on 127.0.0.1:{port} ({len(store.manifest.bases)} bases)")
    t = time.perf_counter()
    ray.init(include_dashboard=False, logging_level="ERROR")
    try:
        quiet = {"log_level": "WARNING"}
        ray_serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet)
        ray_serve.run(build_app(config), name=APP, route_prefix="/", logging_config=quiet)
        start_s = time.perf_counter() - t
        deployments = set(ray_serve.status().applications[APP].deployments)
        return {**asyncio.run(drive(f"http://127.0.0.1:{port}", key, sources, spec, APP, deployments)),
                "server_start_s": start_s}
    finally:
        ray_serve.shutdown()
        ray.shutdown()


def run_soak_bench(store_dir: Path | None, out: Path, spec: SoakSpec = SoakSpec()) -> dict:
    """Build or reuse the store, serve it, soak it; print the table, write the JSON and the PNG beside it."""
    from serve.data.cache import home
    from serve.errors import ConfigError

    if importlib.util.find_spec("matplotlib") is None:  # found now, not after the whole run
        raise ConfigError("the soak's plot needs matplotlib: pip install 'manyfold[bench]'")
    t = time.perf_counter()
    store = build_soak_store(store_dir or home() / "soak-store")
    timings = {"store_s": time.perf_counter() - t}
    with tempfile.TemporaryDirectory(prefix="soak-sources-") as work:
        result = serve_and_drive(store, spec, churn_sources(store, Path(work)))
    timings.update(server_start_s=result.pop("server_start_s"), probe_s=result["saturation"]["took_s"])
    report = {"machine": machine(), "spec": asdict(spec), "timings": timings, **result}
    finish(report, out, print_report)
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.png')}")
    return report
