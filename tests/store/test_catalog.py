"""The catalog (serve/store/catalog.py): snapshots that never change once published, a replace that is a new key,
a notice that looks once, misses that share one look, a timer that looks every refresh_s; and an engine that
serves a replaced adapter's new weights, never the old, with the old key gone from its cache."""

import asyncio
import json
import threading

import pytest

from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams
from serve.errors import VariantNotFound
from serve.store.catalog import Catalog, key_of
from serve.store.store import Store
from serve.variants import variant_kind
from tests.models import write_lora, write_tiny_causal


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalog")
    lm = write_tiny_causal(root / "lm")
    adapters = {seed: write_lora(lm, root / f"lora-{seed}", seed=seed, r=4, targets=["q_proj", "v_proj"])
                for seed in (1, 2, 3)}
    return lm, adapters


@pytest.fixture
def store(tmp_path, models):
    lm, adapters = models
    store = Store(tmp_path / "store", create=True)
    store.add_base("lm", lm)
    variant_kind("lora").add(store, "a", "lm", adapters[1])
    return store


def _looks(catalog: Catalog) -> list[bool]:
    """Every look the catalog takes at the store from now on, as what it found (changed or not)."""
    looks: list[bool] = []
    files = catalog.files
    refresh = files.refresh

    def counted() -> bool:
        looks.append(refresh())
        return looks[-1]

    files.refresh = counted
    return looks


def test_a_snapshot_never_changes_and_a_replace_is_a_new_key(store, models):
    catalog = Catalog(store.root, refresh_s=0)
    first = catalog.snapshot
    old = first.key("a")
    store.remove("a")  # another process replaces the adapter under its name
    variant_kind("lora").add(store, "a", "lm", models[1][2])
    second = asyncio.run(catalog.refresh())
    assert second.number == first.number + 1 and second.key("a") != old
    assert first.holds(old) and first.key("a") == old  # the old snapshot still says what it said
    with pytest.raises(VariantNotFound, match="replaced or removed"):
        second.entry(old)
    assert key_of(second.routed("a")) == second.key("a")


def test_a_notice_looks_once_for_a_new_revision_and_never_for_a_held_one(store, models):
    catalog = Catalog(store.root, refresh_s=0)
    looks = _looks(catalog)
    asyncio.run(catalog.notice(catalog.snapshot.key("a")))
    assert looks == []
    variant_kind("lora").add(store, "b", "lm", models[1][3])  # another process adds; the router saw it first
    new = store.manifest.variants["b"].key
    assert not catalog.snapshot.holds(new)
    assert asyncio.run(catalog.notice(new)).holds(new) and looks == [True]
    asyncio.run(catalog.notice(new))
    assert looks == [True]


def test_requests_that_miss_together_share_one_look(store):
    catalog = Catalog(store.root, refresh_s=0)
    gate, writing = threading.Event(), threading.Event()

    def slow_write(_store):  # holds the catalog's thread while the misses queue behind it
        writing.set()
        assert gate.wait(30)

    async def misses():
        write = asyncio.ensure_future(catalog.write(slow_write))
        await asyncio.to_thread(writing.wait, 30)
        looks = _looks(catalog)
        resolves = [asyncio.ensure_future(catalog.resolve("nope")) for _ in range(5)]
        await asyncio.sleep(0)  # each resolve has queued its look
        gate.set()
        await write
        results = await asyncio.gather(*resolves, return_exceptions=True)
        return looks, results

    looks, results = asyncio.run(misses())
    assert all(isinstance(r, VariantNotFound) for r in results)
    assert len(looks) == 2  # the write's own look after it, and one for the five misses


def test_the_timer_looks_every_refresh_s(store, models):
    catalog = Catalog(store.root, refresh_s=0.01)
    seen = threading.Condition()
    looks: list[bool] = []
    refresh = catalog.files.refresh

    def counted() -> bool:
        with seen:
            looks.append(refresh())
            seen.notify_all()
        return looks[-1]

    with seen:  # counted before the add, so that no look can find it uncounted
        catalog.files.refresh = counted
    variant_kind("lora").add(store, "b", "lm", models[1][3])
    with seen:  # a look after the one that found it: looks run one at a time, so that one had published
        assert seen.wait_for(lambda: True in looks[:-1], timeout=30)
    assert "b" in catalog.snapshot.manifest.variants
    catalog.close()


def test_a_replaced_adapter_is_served_new_and_its_old_key_leaves_the_cache(store, models):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1)
    engine = Engine(ServeConfig(store=store.root))

    def answer(eng: Engine):
        return asyncio.run(eng.complete("a", params, prompt="the cat sat")).logprobs

    before, old = answer(engine), engine.catalog.snapshot.key("a")
    assert engine.cache.residency(old) == "hot"
    store.remove("a")
    variant_kind("lora").add(store, "a", "lm", models[1][2])
    asyncio.run(engine.catalog.refresh())
    after = answer(engine)
    fresh = Engine(ServeConfig(store=store.root))
    assert after == answer(fresh) and after != before
    assert engine.cache.residency(old) == "cold" and engine.cache.residency(engine.catalog.snapshot.key("a")) == "hot"


class _Clock:
    """Monotonic seconds that a test moves on; a microsecond passes between two readings, as on a real clock."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1e-6
        return self.now


def test_random_unknown_names_cost_at_most_one_look_per_refresh_period(store, models):
    """1,000 requests for random names: answered 404 from the negative cache (the snapshot, as of a look begun
    less than refresh_s ago), at most one store look per period; a write here and a notice still look at once."""
    import random

    clock = _Clock()
    catalog = Catalog(store.root, refresh_s=60, clock=clock)  # the timer never fires within the test
    rng = random.Random(0)

    async def flood(n: int) -> int:
        misses = 0
        for _ in range(n):
            try:
                await catalog.resolve(f"x{rng.getrandbits(64):016x}")
            except VariantNotFound:
                misses += 1
        return misses

    opened = catalog.looks
    assert asyncio.run(flood(1000)) == 1000 and catalog.looks == opened  # the open was the period's look
    clock.now += 60
    assert asyncio.run(flood(1000)) == 1000 and catalog.looks == opened + 1  # one look, the first miss's
    variant_kind("lora").add(store, "b", "lm", models[1][2])  # another process adds: known here within refresh_s
    with pytest.raises(VariantNotFound):
        asyncio.run(catalog.resolve("b"))
    assert catalog.looks == opened + 1
    clock.now += 60
    assert asyncio.run(catalog.resolve("b"))[1:] == ("lm", "b") and catalog.looks == opened + 2
    variant_kind("lora").add(store, "c", "lm", models[1][3])  # a new revision named by a router: looked for at once
    assert asyncio.run(catalog.notice(store.manifest.variants["c"].key)).holds(store.manifest.variants["c"].key)
    asyncio.run(catalog.write(lambda s: s.remove("a")))  # a write here is published at once
    assert "a" not in catalog.snapshot.manifest.variants and catalog.looks == opened + 4
    with pytest.raises(VariantNotFound):
        asyncio.run(catalog.resolve("a"))
    assert catalog.looks == opened + 4


def test_the_audit_line_goes_through_the_catalog_without_a_look(store):
    catalog = Catalog(store.root, refresh_s=0)
    looks = catalog.looks
    line = {"time": "2025-01-02T03:04:05.678Z", "key": "ab" * 6, "tenant": None, "route": "DELETE /v1/admin/variants",
            "name": "a", "revision": None, "outcome": {"status": 200, "error": None}}
    asyncio.run(catalog.append_audit(line))
    assert catalog.looks == looks
    assert [json.loads(x) for x in (store.root / "audit" / "2025-01-02.jsonl").read_text().splitlines()] == [line]
