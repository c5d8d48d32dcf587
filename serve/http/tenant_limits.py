"""Per-tenant limits at the ingress: requests per second and tokens per minute (token buckets), and requests in
flight. Past one, the request is refused with 429, Retry-After and a message naming the limit and its value;
nothing else is refused, and a refused request takes nothing from any bucket.

Each ingress replica keeps its own buckets (as a gateway without a shared store does): with N ingress replicas a
tenant may get up to N times its limits. The limits are read from the tenant's entry at every request, so a change
through POST /v1/admin/tenants applies to the next request.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

from serve.errors import RateLimited
from serve.metrics import Metrics
from serve.store.manifest import TenantEntry, TenantLimits


@dataclass
class _Bucket:
    """A token bucket: `level` tokens at `at`, refilled at `rate` a second up to `size`."""

    level: float
    at: float

    def refill(self, rate: float, size: float, now: float) -> float:
        self.level = min(size, self.level + (now - self.at) * rate)
        self.at = now
        return self.level


@dataclass
class _Usage:
    requests: _Bucket
    tokens: _Bucket
    in_flight: int = 0


@dataclass
class Ticket:
    """One admitted request, given back once when it ends (done, or the end of a `with` block) with the tokens it
    was served: its place in flight is freed and its tokens are taken from the tenant's bucket."""

    usage: _Usage | None
    tenant: str | None
    metrics: Metrics
    tokens: int = 0
    """Prompt and completion tokens served so far (set by the route once it knows them)."""
    closed: bool = False

    def done(self) -> None:
        if self.closed or self.usage is None:
            return
        self.closed = True
        self.usage.in_flight -= 1
        self.usage.tokens.level -= self.tokens
        self.metrics.tenant_tokens.labels(self.metrics.tenant_label(self.tenant)).inc(self.tokens)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.done()


@dataclass
class TenantGate:
    metrics: Metrics
    clock: Callable[[], float] = time.monotonic
    _usage: dict[str, _Usage] = field(default_factory=dict)

    def admit(self, t: TenantEntry | None) -> Ticket:
        """Let the tenant's request in, or RateLimited naming the first limit it is past."""
        if t is None:
            return Ticket(None, None, self.metrics)
        now = self.clock()
        limits = t.limits
        u = self._usage.get(t.name)
        if u is None:
            u = self._usage[t.name] = _Usage(_Bucket(_requests_size(limits), now),
                                            _Bucket(float(limits.tokens_per_min or 0), now))
        try:
            self._check(t.name, limits, u, now)
        except RateLimited as e:
            self.metrics.tenant_limited.labels(self.metrics.tenant_label(t.name), e.limit).inc()
            raise
        u.in_flight += 1
        if limits.requests_per_s is not None:
            u.requests.level -= 1
        return Ticket(u, t.name, self.metrics)

    @staticmethod
    def _check(tenant: str, limits: TenantLimits, u: _Usage, now: float) -> None:
        if limits.max_concurrent is not None and u.in_flight >= limits.max_concurrent:
            raise _limited(tenant, "max_concurrent", limits.max_concurrent, 1.0)
        if limits.requests_per_s is not None:
            rate = limits.requests_per_s
            level = u.requests.refill(rate, _requests_size(limits), now)
            if level < 1:
                raise _limited(tenant, "requests_per_s", rate, (1 - level) / rate)
        if limits.tokens_per_min is not None:
            rate = limits.tokens_per_min / 60
            level = u.tokens.refill(rate, limits.tokens_per_min, now)
            if level <= 0:
                raise _limited(tenant, "tokens_per_min", limits.tokens_per_min, (1 - level) / rate)


def _requests_size(limits: TenantLimits) -> float:
    """One second's requests, and at least one."""
    return max(1.0, limits.requests_per_s or 0.0)


def _limited(tenant: str, limit: str, value: float, wait_s: float) -> RateLimited:
    return RateLimited(f"tenant '{tenant}' is at its limit {limit} = {value:g}; retry after {wait_s:.1f} s", wait_s,
                       limit)
