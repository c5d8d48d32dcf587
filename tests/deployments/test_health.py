"""Deployment health as the ingress sees it: a base with no running replica is refused with 503 naming why,
within a bound; a controller that does not answer costs nothing but freshness."""

import asyncio

import pytest

from serve.deployments.health import BaseState, DeploymentHealth, readiness
from serve.errors import Unavailable

PENDING = ("Deployment 'base-nz' in application 'manyfold' has 1 replicas that have taken more than 30s to be "
           "scheduled. This may be due to waiting for the cluster to auto-scale or for a runtime environment to be "
           "installed. Resources required for each replica: {\"CPU\": 64.0}, total resources available: "
           "{\"CPU\": 1.9998}. Use `ray status` for more details.")


def test_a_base_that_never_runs_is_refused_naming_why():
    reads = []

    def read():
        reads.append(1)
        return {"base-lm": (1, ""), "base-nz": (0, PENDING)}

    health = DeploymentHealth({"lm": "base-lm", "nz": "base-nz"}, read, refresh_s=0.0, wait_s=0.0)

    async def go():
        await health.require("lm", "lm-lora")  # running: through at once
        with pytest.raises(Unavailable) as e:
            await health.require("nz", "nz-lora")
        return e.value, await health.states()

    err, states = asyncio.run(go())
    assert str(err) == ("model 'nz-lora' is unavailable: base 'nz' has no running replica: Ray cannot place it (each "
                        "replica needs {\"CPU\": 64.0}; the cluster has {\"CPU\": 1.9998} available)")
    assert err.http_status == 503 and states["lm"].running and not states["nz"].running and reads


def test_a_base_still_starting_says_so():
    health = DeploymentHealth({"lm": "base-lm"}, lambda: {"base-lm": (0, "Deploying. Replicas starting.")},
                              wait_s=0.0)
    with pytest.raises(Unavailable, match=r"^model 'lm' is unavailable: base 'lm' has no running replica \(Deploying\)$"):
        asyncio.run(health.require("lm", "lm"))


def test_a_restarting_base_is_waited_for_until_it_runs():
    replies = iter([{"base-lm": (0, "")}, {"base-lm": (0, "")}, {"base-lm": (1, "")}])
    health = DeploymentHealth({"lm": "base-lm"}, lambda: next(replies), refresh_s=0.0, wait_s=3600)
    asyncio.run(health.require("lm", "lm"))  # returns once the third read says it runs
    with pytest.raises(StopIteration):
        next(replies)


def test_a_controller_that_fails_keeps_what_was_known():
    calls = iter([{"base-lm": (0, "starting")}, RuntimeError("controller away")])

    def read():
        reply = next(calls)
        if isinstance(reply, Exception):
            raise reply
        return reply

    health = DeploymentHealth({"lm": "base-lm", "new": "base-new"}, read, refresh_s=0.0)

    async def go():
        return await health.states(), await health.states()

    first, second = asyncio.run(go())
    assert first == second and not first["lm"].running and first["new"].running  # never read: counted running


def test_ready_once_every_base_that_can_run_runs():
    """An unplaceable base and one allowed to scale to zero do not hold readiness back; one starting, or one the
    controller has not reported yet, does."""
    replies = iter([
        {"base-lm": (1, ""), "base-nz": (0, PENDING), "base-idle": (0, "")},  # "base-new" not reported yet
        {"base-lm": (1, ""), "base-nz": (0, PENDING), "base-idle": (0, ""), "base-new": (0, "Deploying.")},
        {"base-lm": (1, ""), "base-nz": (0, PENDING), "base-idle": (0, ""), "base-new": (1, "")},
    ])
    health = DeploymentHealth({b: f"base-{b}" for b in ("lm", "nz", "idle", "new")}, lambda: next(replies),
                              refresh_s=0.0, may_idle=frozenset({"idle"}))

    async def go():
        return [await health.readiness() for _ in range(3)]

    (r1, w1), (r2, w2), (r3, w3) = asyncio.run(go())
    assert (r1, r2, r3) == (False, False, True)
    assert w1["new"] == "starting: not reported by Serve's controller yet"
    assert w2["new"] == "starting: base 'new' has no running replica (Deploying)"
    assert w3 == {"lm": "running", "nz": w3["nz"], "idle": "idle: min_replicas is 0, its first request starts a replica",
                  "new": "running"}
    assert w3["nz"].startswith("unplaceable: base 'nz' has no running replica: Ray cannot place it")


def test_a_request_for_a_base_scaled_to_zero_goes_on_to_start_it():
    health = DeploymentHealth({"idle": "base-idle"}, lambda: {"base-idle": (0, "")}, wait_s=0.0,
                              may_idle=frozenset({"idle"}))
    asyncio.run(health.require("idle", "idle-lora"))  # not refused: Serve starts a replica for it
    unplaceable = DeploymentHealth({"idle": "base-idle"}, lambda: {"base-idle": (0, PENDING)}, wait_s=0.0,
                                   may_idle=frozenset({"idle"}))
    with pytest.raises(Unavailable, match="Ray cannot place it"):
        asyncio.run(unplaceable.require("idle", "idle-lora"))


def test_a_replica_waiting_for_resources_others_hold_is_starting_not_unplaceable():
    """Serve's 30-second message is the same where no node could hold a replica and where the replicas starting
    before it hold the CPUs: only the first lets readiness pass without it."""
    asked = []

    def nodes(totals):
        def read():
            asked.append(totals)
            return [{"CPU": c, "memory": 1e9} for c in totals]
        return read

    def state(totals):
        health = DeploymentHealth({"nz": "base-nz"}, lambda: {"base-nz": (0, PENDING)}, refresh_s=0.0,
                                  nodes=nodes(totals))
        return asyncio.run(health.readiness())

    ready, words = state((2.0, 64.0))  # the second node can hold it once its CPUs are free
    assert not ready and words["nz"].startswith("starting: base 'nz' has no running replica: waiting for resources")
    ready, words = state((2.0, 32.0))  # no node ever could
    assert ready and words["nz"].startswith("unplaceable: base 'nz' has no running replica: Ray cannot place it")
    running = DeploymentHealth({"nz": "base-nz"}, lambda: {"base-nz": (1, "")}, refresh_s=0.0, nodes=nodes((1.0,)))
    asyncio.run(running.readiness())
    assert asked == [(2.0, 64.0), (2.0, 32.0)]  # read only when Serve says a replica waits to be placed


def test_a_base_loading_says_so_and_how_far_and_holds_readiness_back():
    """The board's word on a fetch (ResidencyBoard.loads) turns "starting" into "loading" and how far; it never
    hides a base that runs, nor holds back one Ray cannot place or one allowed to idle."""
    gib = 1 << 30
    starting = BaseState(False, "base 'lm' has no running replica (Deploying)")
    loading = {b: (int(1.2 * gib), int(3.4 * gib)) for b in ("lm", "new", "up", "far", "idle")}
    states = {"lm": starting, "new": None, "up": BaseState(True), "far": BaseState(False, "no room", placeable=False),
              "idle": BaseState(False, "")}
    ready, words = readiness(states, frozenset({"idle"}), loading)
    assert not ready
    assert words["lm"] == words["new"] == "loading 1.2/3.4 GiB (35%)"
    assert words["up"] == "running" and words["far"] == "unplaceable: no room" and words["idle"].startswith("idle")
    assert readiness({"up": BaseState(True), "far": states["far"]}, loading=loading)[0]  # the status rules hold
    fetched = readiness({"lm": starting}, loading={"lm": (3 * gib, 3 * gib)})[1]
    assert fetched == {"lm": "loading 3.0/3.0 GiB (100%): fetched, the engine starting"}


def test_manyfold_serve_says_a_base_still_loading_at_start_timeout_goes_on_loading():
    from serve.app import start_warnings

    words = {"lm": "loading 1.2/3.4 GiB (35%)", "nz": "starting: base 'nz' has no running replica (Deploying)",
             "up": "running", "idle": "idle: min_replicas is 0, its first request starts a replica"}
    assert start_warnings(words, 120.0) == [
        ("warning: after start_timeout_s (120 s), lm is still loading 1.2/3.4 GiB (35%); the load goes on, and its "
         "models answer 503 until it runs"),
        ("warning: nz is not running; its models answer 503 until it runs (starting: base 'nz' has no running "
         "replica (Deploying))")]


def test_a_base_ray_cannot_place_is_refused_at_once_not_after_the_wait():
    """A replica no node can hold will not come within wait_s: its request gets the 503 now, after one read."""
    reads = []
    health = DeploymentHealth({"big": "base-big"}, lambda: reads.append(1) or {"base-big": (0, PENDING)},
                              wait_s=3600.0, nodes=lambda: [{"CPU": 2.0}])
    with pytest.raises(Unavailable, match="Ray cannot place it"):
        asyncio.run(health.require("big", "big"))
    assert len(reads) == 1
