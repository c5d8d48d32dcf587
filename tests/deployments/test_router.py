"""The router's listing and batch adds with stand-in handles (plain Python, no Ray cluster): /v1/models is built
from the catalog's snapshot once per snapshot, and a batch is split by base, each base's items to one replica call;
a replica or node lost mid-request is a 503 to retry, never a bare 500."""

import asyncio
from pathlib import Path

import pytest
from ray.exceptions import (ActorDiedError, NodeDiedError, ObjectLostError, OutOfMemoryError, RayTaskError,
                            WorkerCrashedError)

from serve.deployments.board import ResidencyBoard
from serve.deployments.router import Router
from serve.engine.types import ModelInfo
from serve.errors import Unavailable, VariantNotFound
from serve.store.catalog import Catalog
from serve.store.manifest import BaseEntry, LoraVariantEntry, StoreManifest, write_manifest
from serve.store.store import Store


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        return self.fn(*args, **kwargs)  # a coroutine: what the router awaits, as it awaits a Ray response


class _Replica:
    def __init__(self, base: str, fails: Exception | None = None):
        self.base, self.fails, self.calls = base, fails, []
        self.add_variants = _Remote(self._add_variants)

    def options(self, **options) -> "_Replica":
        self.routed = options["multiplexed_model_id"]
        return self

    async def _add_variants(self, items):
        self.calls.append(items)
        if self.fails:
            raise self.fails
        return [ModelInfo(name, kind, base, "cold", None) for name, base, _, kind in items]


class _Health:
    async def states(self):
        return {}

    async def require(self, base: str, model: str) -> None:
        pass


class _Board:
    """The real board's counts of store changes behind stand-in handles (one board shared by the ingresses)."""

    def __init__(self, held: dict[str, str] | None = None, board: ResidencyBoard | None = None):
        self.held = held or {}
        self.board = board or ResidencyBoard()
        self.residency = _Remote(self._residency)
        self.stored = _Remote(self._answer(self.board.stored))
        self.writes = _Remote(self._answer(self.board.writes))

    async def _residency(self):
        return self.held

    @staticmethod
    def _answer(fn):
        async def call():
            return fn()
        return call


def _store(root, variants: dict[str, str], aliases: dict[str, str] | None = None) -> Store:
    base = {"architecture": "Tiny", "params": 1, "fingerprint": "0" * 64, "files": []}
    write_manifest(root, StoreManifest(
        bases={b: BaseEntry(name=b, **base) for b in ("a", "b")},
        variants={n: LoraVariantEntry(name=n, base=b, architecture="Tiny", raw_bytes=1, rank=1, target_modules=["m"],
                                      files=[]) for n, b in variants.items()}, aliases=aliases or {}))
    return Store(root)


def test_an_alias_is_listed_under_the_base_that_answers_it_and_routed_to_the_entry_it_names(tmp_path):
    """An upgrade switched t1 to its adapter on base b: /v1/models lists t1 under b (its entry on a, shadowed, is
    not listed), and a request for t1 goes to b's replicas as the entry t1.b, which they run whatever the name
    points at by the time it arrives."""
    store = _store(tmp_path, {"t1": "a", "t1.b": "b", "t2": "a"}, aliases={"t1": "t1.b"})
    replicas = {"a": _Replica("a"), "b": _Replica("b")}
    router = Router(Catalog(tmp_path, refresh_s=0), replicas, _Board(), _Health())
    models = asyncio.run(router.models())
    assert [(m.name, m.base, m.alias_of) for m in models] == [("a", None, None), ("t2", "a", None),
                                                               ("b", None, None), ("t1.b", "b", None),
                                                               ("t1", "b", "t1.b")]
    handle, model = asyncio.run(router._handle("t1"))
    assert handle is replicas["b"] and model == "t1.b"
    assert handle.routed == f"t1.b@{store.manifest.variants['t1.b'].revision}"


def test_models_are_listed_per_base_and_rebuilt_only_when_the_manifest_changes(tmp_path):
    store = _store(tmp_path, {"a-1": "a", "b-1": "b", "a-2": "a"})
    held = {store.manifest.variants["b-1"].key: "hot"}  # replicas report what they hold by entry key
    router = Router(Catalog(tmp_path, refresh_s=0), {"a": _Replica("a"), "b": _Replica("b")}, _Board(held), _Health())
    models = asyncio.run(router.models())
    assert [(m.name, m.base, m.residency) for m in models] == [("a", None, "hot"), ("a-1", "a", "cold"),
                                                               ("a-2", "a", "cold"), ("b", None, "hot"),
                                                               ("b-1", "b", "hot")]
    listing = router._listing()
    asyncio.run(router.models())
    assert router._listing() is listing
    write_manifest(tmp_path, store.manifest.model_copy(update={"variants": {}}))  # another process removes them
    asyncio.run(router.catalog.refresh())  # what the catalog does every store_refresh_s
    assert [m.name for m in asyncio.run(router.models())] == ["a", "b"]


def test_a_batch_goes_to_each_base_in_one_call_and_failures_stay_with_their_items(tmp_path):
    _store(tmp_path, {})
    replicas = {"a": _Replica("a"), "b": _Replica("b", fails=Unavailable("base 'b' is not running"))}
    router = Router(Catalog(tmp_path, refresh_s=0), replicas, _Board(), _Health())
    items = [("x", "a", "/p/x", "lora"), ("y", "b", "/p/y", "lora"), ("z", "nope", "/p/z", "lora"),
             ("w", "a", "/p/w", "pissa")]
    out = asyncio.run(router.add_variants(items))
    assert [(o.name, o.kind) for o in (out[0], out[3])] == [("x", "lora"), ("w", "pissa")]
    assert isinstance(out[1], Unavailable) and isinstance(out[2], VariantNotFound) and "'nope'" in str(out[2])
    assert replicas["a"].calls == [[items[0], items[3]]] and replicas["b"].calls == [[items[1]]]


def test_readiness_says_how_far_a_base_being_fetched_has_come_and_a_board_away_costs_only_that(tmp_path):
    from serve.deployments.health import DeploymentHealth

    _store(tmp_path, {})
    health = DeploymentHealth({"a": "base-a", "b": "base-b"}, lambda: {"base-a": (1, ""), "base-b": (0, "Deploying.")})
    board, asked = _Board(), []

    async def loads():
        asked.append(1)
        return {"a": (5, 10), "b": (3 << 30, 4 << 30)}

    board.loads = _Remote(loads)
    router = Router(Catalog(tmp_path, refresh_s=0), {"a": _Replica("a"), "b": _Replica("b")}, board, health)
    assert asyncio.run(router.readiness()) == (False, {"a": "running", "b": "loading 3.0/4.0 GiB (75%)"})

    async def away():
        raise RuntimeError("board stopping")

    board.loads = _Remote(away)
    assert asyncio.run(router.readiness()) == (False, {"a": "running", "b": "starting: base 'b' has no running "
                                                                             "replica (Deploying)"})
    ready = Router(Catalog(tmp_path, refresh_s=0), {"a": _Replica("a")}, board,
                   DeploymentHealth({"a": "base-a"}, lambda: {"base-a": (1, "")}))
    assert asyncio.run(ready.readiness()) == (True, {"a": "running"}) and asked == [1]  # ready: the board not asked


LOST = [ActorDiedError(), NodeDiedError("the node running it died"), WorkerCrashedError(),
        ObjectLostError("ab" * 14, None, ""), OutOfMemoryError("the node ran out of memory")]


@pytest.mark.parametrize("lost", LOST, ids=[type(e).__name__ for e in LOST])
def test_a_replica_or_its_node_lost_mid_request_is_a_503_to_retry_never_a_500(lost):
    with pytest.raises(Unavailable, match="replica stopped while answering; retry"), Router._replica_errors():
        raise lost


def test_a_failure_of_the_replicas_own_code_stays_what_it_is():
    bug = RayTaskError("generate", "Traceback ...", ValueError("a bug"))
    with pytest.raises(RayTaskError), Router._replica_errors():
        raise bug


class _Stream:
    """What a streaming handle's remote() returns: the deltas, then `fails` raised (None: the stream ends)."""

    def __init__(self, deltas: list[str], fails: Exception | None):
        self.deltas, self.fails, self.cancelled = deltas, fails, False

    async def __aiter__(self):
        for d in self.deltas:
            yield d
        if self.fails:
            raise self.fails

    def cancel(self) -> None:
        self.cancelled = True


class _Lossy(_Replica):
    """A base whose calls go as `outcomes` says in turn: (deltas, error raised after them or None)."""

    def __init__(self, outcomes: list[tuple[list[str], Exception | None]]):
        super().__init__("a")
        self.outcomes, self.streams = list(outcomes), []
        self.complete = _Remote(self._complete)
        self.complete_stream = _Remote(self._stream)

    def options(self, **options) -> "_Lossy":
        return self

    async def _complete(self, model, params, **kwargs):
        deltas, fails = self.outcomes.pop(0)
        if fails:
            raise fails
        return "".join(deltas)

    def _stream(self, model, params, **kwargs):
        self.streams.append(_Stream(*self.outcomes.pop(0)))
        return self.streams[-1]


def _lossy(tmp_path, outcomes) -> tuple[Router, _Lossy, list]:
    _store(tmp_path, {})
    replica, lost = _Lossy(outcomes), []
    router = Router(Catalog(tmp_path, refresh_s=0), {"a": replica}, _Board(), _Health(),
                    lost=lambda model, outcome: lost.append((model, outcome)))
    return router, replica, lost


def test_a_request_whose_replica_is_lost_is_sent_again_once_then_a_503_with_retry_after(tmp_path):
    from serve.errors import ReplicaLost

    router, _, lost = _lossy(tmp_path, [([], NodeDiedError("gone")), (["an answer"], None)])
    assert asyncio.run(router.complete("a", None, prompt="hi")) == "an answer" and lost == [("a", "resent")]
    router, replica, lost = _lossy(tmp_path, [([], ActorDiedError()), ([], WorkerCrashedError()), (["x"], None)])
    with pytest.raises(ReplicaLost) as e:
        asyncio.run(router.complete("a", None, prompt="hi"))
    assert e.value.http_status == 503 and e.value.retry_after_s == 1
    assert lost == [("a", "resent"), ("a", "unavailable")] and len(replica.outcomes) == 1  # sent twice, no more


def _streamed(router: Router) -> tuple[list[str], Exception | None]:
    got: list[str] = []

    async def read():
        async for d in router.complete_stream("a", None, prompt="hi"):
            got.append(d)

    try:
        asyncio.run(read())
    except Exception as e:  # noqa: BLE001
        return got, e
    return got, None


def test_a_stream_lost_before_its_first_delta_is_sent_again_and_one_lost_after_ends_with_a_503():
    import tempfile

    from serve.errors import ReplicaLost

    with tempfile.TemporaryDirectory() as tmp:
        router, replica, lost = _lossy(Path(tmp), [([], ActorDiedError()), (["a", "b"], None)])
        assert _streamed(router) == (["a", "b"], None) and lost == [("a", "resent")]
        assert all(s.cancelled for s in replica.streams)
        router, replica, lost = _lossy(Path(tmp), [(["a"], NodeDiedError("gone")), (["x"], None)])
        got, error = _streamed(router)
        assert got == ["a"] and isinstance(error, ReplicaLost) and lost == [("a", "unavailable")]
        assert len(replica.outcomes) == 1  # what the client had seen was not sent again


def _two_ingresses(tmp_path: Path) -> tuple[Router, Router, _Board]:
    """Two ingresses over one store (a-1, of base a) and one board, their catalogs' negative windows long
    (store_refresh_s). -> (first, second, the board)."""
    _store(tmp_path, {"a-1": "a"})
    board = _Board()
    first, second = (Router(Catalog(tmp_path, refresh_s=3600), {"a": _Replica("a")}, _Board(board=board.board),
                            _Health()) for _ in range(2))
    return first, second, board


def _add_through(router: Router, tmp_path: Path) -> None:
    """a-2 (a copy of a-1) written to the store as the replica writes it, and added through `router`."""
    store = Store(tmp_path)
    entry = store.manifest.variants["a-1"].model_copy(update={"name": "a-2"})
    write_manifest(tmp_path, store.manifest.model_copy(update={"variants": {**store.manifest.variants,
                                                                           "a-2": entry}}))
    asyncio.run(router.add_variants([("a-2", "a", "/p/a-2", "lora")]))


def test_a_variant_added_through_one_ingress_is_served_through_another_at_once(tmp_path):
    """Two ingresses over one store and one board, their catalogs' negative windows long (store_refresh_s): a
    variant stored through the first is routed by the second at its first request, which finds the board's count
    of changes ahead of its own and looks; a name nobody added costs it a call to the board and no look."""
    first, second, board = _two_ingresses(tmp_path)
    with pytest.raises(VariantNotFound):
        asyncio.run(second._handle("a-2"))
    _add_through(first, tmp_path)
    looks = second.catalog.looks
    handle, model = asyncio.run(second._handle("a-2"))
    assert model == "a-2" and second.catalog.looks == looks + 1
    with pytest.raises(VariantNotFound):
        asyncio.run(second._handle("nobody-added-me"))
    assert second.catalog.looks == looks + 1 and board.board.writes() == 1


def test_a_variant_added_through_one_ingress_is_removed_through_another_at_once(tmp_path):
    """The removal's own lookup catches up as a request's does: removed through the second ingress right after the
    first stored it, not a 404 until the second's next look; an unknown name is still a 404."""
    first, second, _ = _two_ingresses(tmp_path)
    with pytest.raises(VariantNotFound):
        asyncio.run(second.remove_variant("a-2"))
    _add_through(first, tmp_path)
    asyncio.run(second.remove_variant("a-2"))
    assert "a-2" not in Store(tmp_path).manifest.variants
    with pytest.raises(VariantNotFound):
        asyncio.run(second.remove_variant("nobody-added-me"))
