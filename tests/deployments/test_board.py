"""The ResidencyBoard's merge of replica reports, as /v1/models shows it (plain Python, no Ray)."""

import time

from serve.deployments.board import ResidencyBoard


def test_a_variant_shows_the_best_tier_any_live_replica_holds():
    board = ResidencyBoard(stale_after_s=60)
    board.report("r1", {"a": "warm", "b": "hot"})
    board.report("r2", {"a": "hot"})
    assert board.residency() == {"a": "hot", "b": "hot"}
    board.report("r2", {})  # r2 evicted a
    assert board.residency() == {"a": "warm", "b": "hot"}
    board.forget("r1")
    assert board.residency() == {}


def test_a_replica_that_stops_reporting_drops_off():
    board = ResidencyBoard(stale_after_s=0.05)
    board.report("gone", {"a": "hot"})
    time.sleep(0.1)
    board.report("alive", {"b": "warm"})
    assert board.residency() == {"b": "warm"}


def test_reports_go_out_in_the_background_and_a_board_that_hangs_costs_one_warning(caplog):
    import asyncio

    from serve.deployments.board import Reporter

    sent, hang = [], asyncio.Event()

    async def send(held):
        sent.append(held)
        if len(sent) == 1:
            await hang.wait()  # the first report never comes back

    async def go():
        reporter = Reporter(send, timeout_s=0.05)
        reporter.changed({"a": "hot"})  # returns at once: an answer never waits for the board
        assert sent == [] and not reporter._task.done()
        await reporter._task  # bounded by the timeout
        reporter.changed({"a": "hot", "b": "warm"})
        await reporter._task
        reporter.changed({"a": "hot", "b": "warm"})  # unchanged since the last report: nothing sent
        return reporter

    reporter = asyncio.run(go())
    assert reporter.failures == 1 and sent == [{"a": "hot"}, {"a": "hot", "b": "warm"}]
    assert [r.getMessage() for r in caplog.records] == ["residency report failed: timed out"]


def test_a_report_that_raises_never_reaches_the_request():
    import asyncio

    from serve.deployments.board import Reporter
    from serve.engine import faults

    async def send(held):
        raise AssertionError("the fault comes first")

    reporter = Reporter(send, before=lambda: faults.hit("report", ["lm"]))
    with faults.injected("report", "lm"):
        asyncio.run(reporter.report({"x": "hot"}))  # no exception escapes
    assert reporter.failures == 1 and faults.hits["report"] >= 1


def snapshot(hits: int, steps: int, queue: int) -> dict:
    from serve.engine.stats import Distribution, Latencies, TenantWaits

    lat, waits = Latencies(), TenantWaits()
    for _ in range(steps):
        lat.end_to_end.observe(0.2)
        waits.queue.observe(0.1)
    batches = Distribution((1, 2, 4))
    batches.observe(2)
    return {"cache_hits": hits, "cache_misses": 1, "cache_evictions": 0, "queue_depth": queue,
            "cache_bytes": {"hot": 10, "warm": 0, "recycled": 0, "slots": 0}, "batch_sizes": batches.to_dict(),
            "load_seconds": Distribution((1.0,)).to_dict(), "seconds": {"step": 0.5 * steps},
            "steps": {"lm": {"eager:cpu": steps}}, "latencies": {"lm": lat.to_dict()}, "load": {},
            "tenant_waits": {"acme": waits.to_dict()}, "preemptions": {"lm": steps},
            "prefix_tokens": {"lm": {"queries": 10 * steps, "hits": steps}}}


def counters(text: str) -> dict[tuple, float]:
    """Every sample of a counter or histogram, by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            if f.type in ("counter", "histogram") for s in f.samples}


def test_the_deployments_counters_never_go_backwards_as_replicas_come_and_go():
    """/metrics sums every replica's last report; a replica that leaves (or stops reporting) leaves its counters
    behind in a retired total, so no scrape shows less than the one before."""
    from serve.metrics import Metrics

    board = ResidencyBoard(stale_after_s=60)
    metrics = Metrics()
    timeline = [("report", "r1", snapshot(3, 2, 1)), ("report", "r2", snapshot(5, 4, 0)),
                ("forget", "r1", None), ("report", "r3", snapshot(0, 0, 2)), ("report", "r2", snapshot(9, 7, 3)),
                ("forget", "r2", None), ("report", "r3", snapshot(1, 1, 0))]
    last: dict[tuple, float] = {}
    for what, replica, snap in timeline:
        board.report(replica, {}, snap) if what == "report" else board.forget(replica)
        now = counters(metrics.render(board.snapshots(), []).decode())
        assert all(now.get(k, 0.0) >= v for k, v in last.items()), [k for k, v in last.items() if now.get(k, 0) < v]
        last = now
    hits = last[("manyfold_cache_events_total", (("event", "hit"),))]
    assert hits == 3 + 9 + 1  # r1's and r2's last reports, retired, and r3's
    e2e = last[("vllm:e2e_request_latency_seconds_count", (("model_name", "lm"),))]
    assert e2e == 2 + 7 + 1
    assert last[("manyfold_tenant_queue_seconds_count", (("tenant", "acme"),))] == 2 + 7 + 1


def test_ingresses_request_counters_add_up_and_outlive_an_ingress():
    """Each ingress reports its request counters (Metrics.counters) and gets every ingress's added up; an ingress
    that stops leaves its counters in the total, so the sum a scrape shows never goes backwards."""
    import time as clock

    from serve.metrics import Metrics

    a, b = Metrics(), Metrics()
    a.count("lm", "/v1/completions", 200)
    b.count("lm", "/v1/completions", 200)
    b.count("lm", "/v1/completions", 200)
    b.time("lm", "/v1/completions", 200, clock.perf_counter())
    board = ResidencyBoard()
    board.ingress("a", a.counters())
    total = board.ingress("b", b.counters())

    def requests(counters: dict) -> float:
        text = a.render([], [], ingresses=counters).decode()
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("manyfold_requests_total{"))

    assert requests(total) == 3
    board.forget_ingress("b")
    assert requests(board.ingress("a", a.counters())) == 3
    assert 'manyfold_request_latency_seconds_bucket{le="0.005",model="lm",route="/v1/completions"} 1.0' in \
        a.render([], [], ingresses=total).decode()


def test_a_base_loading_shows_its_furthest_replica_until_that_replica_reports_or_leaves():
    board = ResidencyBoard(stale_after_s=60)
    board.loading("r1", "lm", 10, 100)
    board.loading("r2", "lm", 40, 100)
    board.loading("r3", "nz", 0, 50)
    assert board.loads() == {"lm": (40, 100), "nz": (0, 50)}
    board.loading("r1", "lm", 70, 100)
    assert board.loads()["lm"] == (70, 100)
    board.report("r1", {})  # r1 runs: it has loaded
    board.forget("r3")  # r3 failed while loading
    assert board.loads() == {"lm": (40, 100)}
