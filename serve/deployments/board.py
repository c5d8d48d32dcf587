"""ResidencyBoard: which variants every model replica holds, so /v1/models shows the whole deployment.

A Ray Serve handle reaches one replica per call, so asking the replicas cannot see them all: instead each
replica reports what its cache holds whenever that changes, and at every health check, and the ingress reads
the board. A replica that stops reporting (gone without a goodbye) drops off after `stale_after_s`.
"""

import time

TIER_RANK: dict[str, int] = {"device": 2, "cpu": 1, "disk": 0}
"""The residency tiers of serve.engine.cache, best first (not imported from there: the board's process stays
free of torch)."""


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
                out[name] = best_tier(tier, out.get(name, "disk"))
        return out
