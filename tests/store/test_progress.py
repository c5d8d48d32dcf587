"""A fetch's progress lines: bytes, rate and time left, at most one per step or interval (a test's own clock), the
last at 100%; a base fetched from a store at a file:// URL logs them and tells on_fetch, a warm node says nothing."""

import logging
from functools import partial

from serve.store import object_store
from serve.store.node_cache import NodeCache
from serve.store.object_store import ObjectStore
from serve.store.progress import Progress, how_far
from tests.models import write_tiny_causal

GIB = 1 << 30


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "manyfold.store"]


def test_lines_give_bytes_rate_and_time_left_at_most_one_per_step_or_interval(caplog):
    clock, reports = Clock(), []
    p = Progress("base 'lm'", 4 * GIB, lambda done, total: reports.append((done, total)), clock=clock)
    caplog.set_level(logging.INFO, logger="manyfold.store")
    p.found(GIB)  # already on the node: done at once, no line (nothing downloaded), not in the rate
    clock.now = 0.5
    p.update(GIB // 2)  # another 12.5 %, but within MIN_S of the start: no line
    clock.now = 2.0
    p.update(GIB // 2)  # 50 %: a line (1 GiB downloaded in 2 s)
    clock.now = 12.0
    p.update(GIB // 4)  # under a step since the last line, but EVERY_S later: a line
    clock.now = 13.0
    p.update(7 * GIB // 4)  # the end: always a line
    clock.now = 14.0
    p.update(1)  # after the end: nothing more
    assert lines(caplog) == ["fetching base 'lm': 2.0/4.0 GiB (50%), 512 MiB/s, ~4 s left",
                             "fetching base 'lm': 2.2/4.0 GiB (56%), 107 MiB/s, ~17 s left",
                             "fetched base 'lm': 4.0/4.0 GiB (100%), 236 MiB/s, in 13 s"]
    assert p.lines == 3 and reports == [(2 * GIB, 4 * GIB), (9 * GIB // 4, 4 * GIB), (4 * GIB, 4 * GIB)]


def test_a_download_in_one_call_reports_at_its_end_and_a_warm_one_says_nothing(caplog):
    caplog.set_level(logging.INFO, logger="manyfold.store")
    Progress("variant 'sql'", 3 << 20, clock=Clock()).update(3 << 20)
    warm = Progress("variant 'sql'", 3 << 20, clock=Clock())
    warm.found(3 << 20)
    assert lines(caplog) == ["fetched variant 'sql': 3.0/3.0 MiB (100%), in 0 s"] and warm.lines == 0
    assert how_far(0, 0) == "0.0/0.0 B (100%)" and how_far(512, 2048) == "0.5/2.0 KiB (25%)"


def test_a_base_fetched_from_the_store_logs_its_progress_up_to_100_percent(tmp_path, caplog, monkeypatch):
    (tmp_path / "bucket").mkdir()
    url = f"file://{tmp_path}/bucket"
    ObjectStore(url, create=True, cache=NodeCache(tmp_path / "writer", 1 << 30)).add_base(
        "lm", write_tiny_causal(tmp_path / "lm"))
    monkeypatch.setattr(object_store, "Progress", partial(Progress, min_s=0.0))  # a line per step, however fast
    caplog.set_level(logging.INFO, logger="manyfold.store")
    told = []
    reader = ObjectStore(url, cache=NodeCache(tmp_path / "node", 1 << 30))  # a replica on a cold node
    reader.on_fetch = lambda entry, done, total: told.append((entry.name, done, total))
    reader.base_dir("lm")
    total = sum(f.bytes for f in reader.base("lm").files)
    said = lines(caplog)
    assert len(said) >= 2 and all(s.startswith("fetching base 'lm': ") for s in said[:-1])
    assert said[-1].startswith("fetched base 'lm': ") and "(100%)" in said[-1]
    assert told[-1] == ("lm", total, total) and len(told) == len(said)
    assert [done for _, done, _ in told] == sorted(done for _, done, _ in told)
    caplog.clear()
    again = ObjectStore(url, cache=NodeCache(tmp_path / "node", 1 << 30))  # restarted on the same, now warm node
    again.on_fetch = lambda *a: told.append(a)
    again.base_dir("lm")
    assert lines(caplog) == [] and len(told) == len(said)
