"""How far a fetch from object storage has come, as log lines from the download loop itself (no thread):

    fetching base 'lm': 1.2/3.4 GiB (35%), 85 MiB/s, ~26 s left
    fetched base 'lm': 3.4/3.4 GiB (100%), 84 MiB/s, in 41 s

The node cache (node_cache.py) counts each chunk as it is written, and each object it already holds as done at
once; the rate is over the bytes downloaded, so a warm cache never inflates it. A fetch that downloads nothing
says nothing.
"""

import logging
import time
from collections.abc import Callable

log = logging.getLogger("manyfold.store")

EVERY_S = 10.0
"""Seconds between two lines of a slow fetch."""
STEP = 0.1
"""A fraction of the bytes that brings a line sooner, but not within MIN_S of the last."""
MIN_S = 1.0
"""A fetch faster than this logs only its last line."""

Report = Callable[[int, int], None]
"""report(bytes done, bytes in all), called with each line (a replica puts it on the residency board)."""

UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))


def _unit(n: float) -> tuple[int, str]:
    return next((size, name) for size, name in UNITS if n >= size or size == 1)


def how_far(done: int, total: int) -> str:
    """"1.2/3.4 GiB (35%)": both in the unit of the total."""
    size, name = _unit(total)
    percent = 100 * min(done, total) // total if total else 100
    return f"{done / size:.1f}/{total / size:.1f} {name} ({percent}%)"


def _rate(bytes_per_s: float) -> str:
    size, name = _unit(bytes_per_s)
    return f"{bytes_per_s / size:.3g} {name}/s"


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 100 else f"{s / 60:.0f} min"


class Progress:
    def __init__(self, what: str, total_bytes: int, report: Report | None = None, every_s: float = EVERY_S,
                 step: float = STEP, min_s: float = MIN_S, clock: Callable[[], float] = time.monotonic):
        """what: the thing fetched, as the lines name it ("base 'lm'"); clock: monotonic seconds (a test's own)."""
        self.what = what
        self.total_bytes = total_bytes
        self.done_bytes = 0
        """Bytes downloaded or found on the node."""
        self.fetched_bytes = 0
        """Bytes downloaded: what the rate is over."""
        self.lines = 0
        self._report = report
        self.every_s, self.step, self.min_s = every_s, step, min_s
        self._clock = clock
        self._started = self._line_at = clock()
        self._line_done = 0

    def update(self, n: int) -> None:
        """n more bytes downloaded."""
        self.fetched_bytes += n
        self._advance(n)

    def found(self, n: int) -> None:
        """n bytes already on the node: done at once."""
        self._advance(n)

    def _advance(self, n: int) -> None:
        self.done_bytes += n
        if not self.fetched_bytes or self._line_done >= self.total_bytes:  # nothing downloaded, or said done
            return
        now = self._clock()
        since = now - self._line_at
        finished = self.done_bytes >= self.total_bytes
        stepped = self.done_bytes - self._line_done >= self.step * self.total_bytes and since >= self.min_s
        if finished or since >= self.every_s or stepped:
            self._line(now, finished)

    def _line(self, now: float, finished: bool) -> None:
        elapsed = now - self._started
        words = [f"{'fetched' if finished else 'fetching'} {self.what}: {how_far(self.done_bytes, self.total_bytes)}"]
        rate = self.fetched_bytes / elapsed if elapsed > 0 else 0.0
        if rate > 0:
            words.append(_rate(rate))
        if finished:
            words.append(f"in {_seconds(elapsed)}")
        elif rate > 0:
            words.append(f"~{_seconds((self.total_bytes - self.done_bytes) / rate)} left")
        log.info("%s", ", ".join(words))
        self.lines += 1
        self._line_at, self._line_done = now, self.done_bytes
        if self._report is not None:
            self._report(self.done_bytes, self.total_bytes)
