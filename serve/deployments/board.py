"""ResidencyBoard: which variants every model replica holds, and every replica's counters, so /v1/models and
/metrics show the whole deployment.

A Ray Serve handle reaches one replica per call, so asking the replicas cannot see them all: instead each
replica reports what its cache holds, with its engine's counters (Engine.snapshot), whenever its residency
changes and at every health check, and the ingress reads the board. A replica that stops reporting (gone
without a goodbye) drops off after `stale_after_s`, and one that leaves says so; either way its counters' last
report is kept in a retired total, so that the sum over the deployment, which /metrics renders, never goes
backwards however replicas come and go.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger("ray.serve")

TIER_RANK: dict[str, int] = {"hot": 2, "warm": 1, "cold": 0}
"""The residencies of serve/engine/types.py, ranked: the best of a variant's replicas is what /v1/models shows."""


def best_tier(*tiers: str) -> str:
    return max(tiers, key=TIER_RANK.__getitem__)


class ResidencyBoard:
    """Deployed as one replica beside the model deployments (see serve.app); plain Python otherwise."""

    def __init__(self, stale_after_s: float = 60.0):
        self.stale_after_s = stale_after_s
        self._reports: dict[str, tuple[float, dict[str, str]]] = {}
        self._counters: dict[str, dict] = {}
        """replica -> its latest snapshot."""
        self._retired: dict = {}
        """The counters (COUNTERS) of replicas gone, added up."""
        self._ingresses: dict[str, tuple[float, dict[str, float]]] = {}
        """ingress replica -> (when, its latest request counters: Metrics.counters)."""
        self._ingresses_retired: dict[str, float] = {}
        self._loading: dict[str, tuple[float, str, int, int]] = {}
        """replica -> (when, the base it is fetching, bytes done, bytes in all), until it reports or leaves."""
        self._writes = 0
        """Changes of the store's manifest made through an ingress (variants added or removed): see `stored`."""

    def report(self, replica: str, held: dict[str, str], snapshot: dict | None = None) -> None:
        self._reports[replica] = (time.monotonic(), dict(held))
        self._loading.pop(replica, None)  # a replica that reports has loaded its base
        if snapshot is not None:
            self._counters[replica] = snapshot

    def loading(self, replica: str, base: str, done: int, total: int) -> None:
        """A replica starting: how far the fetch of its base from object storage has come (serve/store/
        progress.py, at most a line's pace)."""
        self._loading[replica] = (time.monotonic(), base, done, total)

    def loads(self) -> dict[str, tuple[int, int]]:
        """base -> (bytes done, bytes in all) of the replica furthest along fetching it; a replica silent for
        stale_after_s (gone while loading) drops off. /readyz says it of a base not running yet."""
        now = time.monotonic()
        out: dict[str, tuple[int, int]] = {}
        for replica, (at, base, done, total) in list(self._loading.items()):
            if now - at > self.stale_after_s:
                del self._loading[replica]
            elif base not in out or done / max(total, 1) > out[base][0] / max(out[base][1], 1):
                out[base] = (done, total)
        return out

    def stored(self) -> int:
        """An ingress changed the store's manifest and serves the change at once; -> the changes so far. Every other
        ingress reads the count when a model id misses or models are listed (Router._caught_up) and looks for the
        change then, rather than answering 404 until its catalog's next look (store_refresh_s)."""
        self._writes += 1
        return self._writes

    def writes(self) -> int:
        return self._writes

    def forget(self, replica: str) -> None:
        self._reports.pop(replica, None)
        self._loading.pop(replica, None)
        last = self._counters.pop(replica, None)
        if last is not None:
            self._retired = add_counters(self._retired, {k: last[k] for k in COUNTERS if k in last})

    def _live(self) -> dict[str, dict[str, str]]:
        now = time.monotonic()
        for replica, (at, _) in list(self._reports.items()):
            if now - at > self.stale_after_s:
                self.forget(replica)
        return {replica: held for replica, (_, held) in self._reports.items()}

    def residency(self) -> dict[str, str]:
        """variant -> the best tier any live replica holds it in (variants no replica holds are absent)."""
        out: dict[str, str] = {}
        for held in self._live().values():
            for name, tier in held.items():
                out[name] = best_tier(tier, out.get(name, "cold"))
        return out

    def ingress(self, replica: str, counters: dict[str, float]) -> dict[str, float]:
        """An ingress's request counters, reported before it renders /metrics (and at its health checks); -> every
        ingress's latest, added up with those of ingresses gone. Each ingress's counters only grow and the board
        answers one call at a time, so the sum never goes backwards, whichever ingress a scrape reaches."""
        now = time.monotonic()
        self._ingresses[replica] = (now, counters)
        for other, (at, _) in list(self._ingresses.items()):
            if now - at > self.stale_after_s:
                self.forget_ingress(other)
        total = dict(self._ingresses_retired)
        for _, c in self._ingresses.values():
            total = add_counters(total, c)
        return total

    def forget_ingress(self, replica: str) -> None:
        gone = self._ingresses.pop(replica, None)
        if gone is not None:
            self._ingresses_retired = add_counters(self._ingresses_retired, gone[1])

    def snapshots(self) -> list[dict]:
        """Every live replica's latest snapshot, and the retired replicas' counters as one more."""
        live = self._live()
        return [s for r, s in self._counters.items() if r in live] + ([self._retired] if self._retired else [])


COUNTERS = ("cache_hits", "cache_misses", "cache_evictions", "batch_sizes", "load_seconds", "seconds", "steps",
            "step_tokens", "latencies", "node_cache", "tenant_waits", "preemptions", "prefix_tokens")
"""The keys of Engine.snapshot that only grow (the rest are gauges: what is held or waiting now)."""


def add_counters(a: dict, b: dict) -> dict:
    """a + b, key by key, through nested dicts; a histogram's counts add element by element, its bounds stay."""
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value
        elif isinstance(value, dict):
            out[key] = add_counters(out[key], value)
        elif key == "buckets":
            continue
        elif isinstance(value, list | tuple):
            out[key] = [x + y for x, y in zip(out[key], value)]
        else:
            out[key] = out[key] + value
    return out


REFRESH_S = 1.0
"""A replica answering requests reports at least this often (its counters, for /metrics)."""
REPORT_TIMEOUT_S = 2.0
"""How long one residency report may take before it is given up (one warning line)."""


class Reporter:
    """A replica's side of the board: what its cache holds goes out in the background whenever it changed, one
    report at a time, each bounded; a board that is slow or away costs a stale /v1/models, never an answer's
    time or the replica's health check."""

    def __init__(self, send: Callable[[dict[str, str]], Awaitable[None]], timeout_s: float = REPORT_TIMEOUT_S,
                 before: Callable[[], None] = lambda: None):
        """send(held): the report itself (the board handle's call, which adds the replica's counters);
        before(): a test's fault hook."""
        self._send = send
        self.timeout_s = timeout_s
        self._before = before
        self._reported: dict[str, str] | None = None
        self._reported_at = -float("inf")
        self._task: asyncio.Task | None = None
        self.failures = 0

    def changed(self, held: dict[str, str]) -> None:
        """After a request: report in the background if `held` differs from the last report, or the last is
        older than REFRESH_S (the counters move with every request); never waits."""
        due = held != self._reported or time.monotonic() - self._reported_at >= REFRESH_S
        if due and (self._task is None or self._task.done()):
            self._task = asyncio.ensure_future(self.report(held))

    async def report(self, held: dict[str, str]) -> None:
        """One bounded report (the health check awaits this; it never raises)."""
        try:
            self._before()
            await asyncio.wait_for(self._send(dict(held)), self.timeout_s)
            self._reported, self._reported_at = dict(held), time.monotonic()
        except Exception as e:  # noqa: BLE001
            self.failures += 1
            why = "timed out" if isinstance(e, TimeoutError) else (str(e).splitlines() or [type(e).__name__])[0]
            log.warning("residency report failed: %s", why or type(e).__name__)
