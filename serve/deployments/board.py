"""ResidencyBoard: which variants every model replica holds, so /v1/models shows the whole deployment.

A Ray Serve handle reaches one replica per call, so asking the replicas cannot see them all: instead each
replica reports what its cache holds whenever that changes, and at every health check, and the ingress reads
the board. A replica that stops reporting (gone without a goodbye) drops off after `stale_after_s`.
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

    def report(self, replica: str, held: dict[str, str]) -> None:
        self._reports[replica] = (time.monotonic(), dict(held))

    def forget(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def residency(self) -> dict[str, str]:
        """variant -> the best tier any live replica holds it in (variants no replica holds are absent)."""
        now = time.monotonic()
        out: dict[str, str] = {}
        for replica, (at, held) in list(self._reports.items()):
            if now - at > self.stale_after_s:
                del self._reports[replica]
                continue
            for name, tier in held.items():
                out[name] = best_tier(tier, out.get(name, "cold"))
        return out


REPORT_TIMEOUT_S = 2.0
"""How long one residency report may take before it is given up (one warning line)."""


class Reporter:
    """A replica's side of the board: what its cache holds goes out in the background whenever it changed, one
    report at a time, each bounded; a board that is slow or away costs a stale /v1/models, never an answer's
    time or the replica's health check."""

    def __init__(self, send: Callable[[dict[str, str]], Awaitable[None]], timeout_s: float = REPORT_TIMEOUT_S,
                 before: Callable[[], None] = lambda: None):
        """send(held): the report itself (the board handle's call); before(): a test's fault hook."""
        self._send = send
        self.timeout_s = timeout_s
        self._before = before
        self._reported: dict[str, str] | None = None
        self._task: asyncio.Task | None = None
        self.failures = 0

    def changed(self, held: dict[str, str]) -> None:
        """After a request: report `held` in the background if it differs from the last report (never waits)."""
        if held != self._reported and (self._task is None or self._task.done()):
            self._task = asyncio.ensure_future(self.report(held))

    async def report(self, held: dict[str, str]) -> None:
        """One bounded report (the health check awaits this; it never raises)."""
        try:
            self._before()
            await asyncio.wait_for(self._send(dict(held)), self.timeout_s)
            self._reported = dict(held)
        except Exception as e:  # noqa: BLE001
            self.failures += 1
            why = "timed out" if isinstance(e, TimeoutError) else (str(e).splitlines() or [type(e).__name__])[0]
            log.warning("residency report failed: %s", why or type(e).__name__)
