"""Plain counters the engine keeps for metrics, free of any metrics library (the HTTP layer renders them)."""

import bisect
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field


@dataclass
class Distribution:
    """A fixed-bucket histogram: counts[i] observations <= buckets[i]; the last count is above them all."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def to_dict(self) -> dict:
        return asdict(self)


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
"""Seconds between two tokens of a request (vLLM's buckets for vllm:inter_token_latency_seconds)."""


@dataclass
class Latencies:
    """A base's request latencies and token counts, as vLLM exports them: to the first token, between tokens, end
    to end, waiting to join a batch; prompt and generated tokens."""

    first_token: Distribution = field(default_factory=lambda: Distribution(SECONDS_BUCKETS))
    inter_token: Distribution = field(default_factory=lambda: Distribution(TOKEN_BUCKETS))
    end_to_end: Distribution = field(default_factory=lambda: Distribution(SECONDS_BUCKETS))
    queue: Distribution = field(default_factory=lambda: Distribution(SECONDS_BUCKETS))
    """From arrival until the request's row joined a running generation (vllm:request_queue_time_seconds)."""
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def arrived(self, seen: int, new: int, since_queued: float, since_last: float) -> None:
        """`new` tokens of a request that had `seen`: the first token is timed from the request's arrival, each
        later one from the token before (tokens that come together share their wait; any that come with the
        first, none)."""
        if seen == 0:
            self.first_token.observe(since_queued)
            for _ in range(new - 1):
                self.inter_token.observe(0.0)
        else:
            for _ in range(new):
                self.inter_token.observe(since_last / new)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TenantWaits:
    """An authenticated tenant's requests by phase, what a fair order is judged by: from arrival until the row joined
    a running generation (queue), and until its first token (first_token; after joining: its prompt's steps)."""

    queue: Distribution = field(default_factory=lambda: Distribution(SECONDS_BUCKETS))
    first_token: Distribution = field(default_factory=lambda: Distribution(SECONDS_BUCKETS))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Seconds:
    """Seconds of work per part, summed since start (a counter: a reader subtracts two readings). Host time: on a
    GPU a part's kernels may still run after it returns."""

    parts: dict[str, float] = field(default_factory=dict)

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + seconds

    @contextmanager
    def timing(self, part: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - t0)
