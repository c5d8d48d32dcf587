"""Which bases have a running replica, as Ray Serve's controller reports it. The ingress asks before it routes a
request, so that a base Ray cannot schedule (or that is restarting) answers 503 with the reason within a bound,
never a request that waits for ever, and /v1/models can say which bases are not running. Readiness (/readyz, and
when `manyfold serve` says it is serving) is every base that can run running: a base Ray cannot place, or one
allowed to scale to zero (min_replicas 0, started by its first request), does not hold it back.

Plain asyncio over a `read` function (serve_status reads Ray Serve's; tests give their own), and a `nodes`
function (ray_nodes reads Ray's) that tells a base Ray cannot place from one waiting for resources others hold.
"""

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from serve.errors import Unavailable
from serve.store.progress import how_far

log = logging.getLogger("ray.serve")

Read = Callable[[], dict[str, tuple[int, str]]]
"""-> deployment name: (replicas running, the controller's message about it)."""
Nodes = Callable[[], list[dict[str, float]]]
"""-> each live node's total resources."""


@dataclass(frozen=True)
class BaseState:
    running: bool
    reason: str = ""
    """Why it is not running, one line."""
    placeable: bool = True
    """False: Ray said it cannot place a replica (the cluster lacks what one needs)."""


def readiness(states: dict[str, BaseState | None], may_idle: frozenset[str] = frozenset(),
              loading: dict[str, tuple[int, int]] | None = None) -> tuple[bool, dict[str, str]]:
    """(whether every base that can run runs, each base's state in words); None: not reported yet. loading: base
    -> (bytes fetched, bytes in all) of a replica fetching it (ResidencyBoard.loads): a base starting says how
    far, "loading 1.2/3.4 GiB (35%)", then, all fetched, that its engine is starting (placing the weights,
    capturing graphs) until the replica runs; either holds readiness back as one starting does."""
    loading = loading or {}
    words = {}
    for base, s in states.items():
        starting = s is None or (not s.running and s.placeable and base not in may_idle)
        if starting and base in loading:
            done, total = loading[base]
            fetched = ": fetched, the engine starting" if done >= total else ""
            words[base] = f"loading {how_far(done, total)}{fetched}"
        elif s is None:
            words[base] = "starting: not reported by Serve's controller yet"
        elif s.running:
            words[base] = "running"
        elif not s.placeable:
            words[base] = f"unplaceable: {s.reason}"
        elif base in may_idle:
            words[base] = "idle: min_replicas is 0, its first request starts a replica"
        else:
            words[base] = f"starting: {s.reason}"
    return all(not w.startswith(("starting", "loading")) for w in words.values()), words


def serve_status(app: str) -> Read:
    def read() -> dict[str, tuple[int, str]]:
        from ray import serve

        status = serve.status().applications.get(app)
        if status is None:
            return {}
        return {name: (int(d.replica_states.get("RUNNING", 0)), d.message) for name, d in status.deployments.items()}

    return read


def ray_nodes() -> list[dict[str, float]]:
    import ray

    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


class DeploymentHealth:
    def __init__(self, deployments: dict[str, str], read: Read, refresh_s: float = 2.0, wait_s: float = 10.0,
                 read_timeout_s: float = 5.0, may_idle: frozenset[str] = frozenset(), nodes: Nodes | None = None):
        """deployments: base -> its deployment's name. A base not running is waited for up to wait_s (a replica
        restarting comes back) before its requests are refused; one in may_idle (min_replicas 0) is not: its
        request goes on, and Serve starts a replica for it. nodes: see base_state."""
        self.deployments = deployments
        self.may_idle = may_idle
        self._read = read
        self._nodes = nodes
        self.refresh_s = refresh_s
        self.wait_s = wait_s
        self.read_timeout_s = read_timeout_s
        self._states: dict[str, BaseState] = {}
        self._read_at = -float("inf")
        self._reading: asyncio.Task | None = None

    async def states(self) -> dict[str, BaseState]:
        """Every base's state, read again when older than refresh_s (one read at a time, bounded; a read that
        fails or times out keeps what was known, and a base never read counts as running)."""
        if time.monotonic() - self._read_at >= self.refresh_s:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(self._refresh())
            await asyncio.shield(self._reading)
        return {b: self._states.get(b, BaseState(True)) for b in self.deployments}

    async def _refresh(self) -> None:
        try:
            self._states = await asyncio.wait_for(asyncio.to_thread(self._read_states), self.read_timeout_s)
        except Exception as e:  # noqa: BLE001  (the controller may be busy or restarting)
            log.warning("deployment status unavailable: %s", (str(e).splitlines() or [type(e).__name__])[0])
        self._read_at = time.monotonic()

    def _read_states(self) -> dict[str, BaseState]:
        raw = self._read()
        return {base: base_state(base, *raw[name], self._nodes) for base, name in self.deployments.items()
                if name in raw}

    async def readiness(self, loading: dict[str, tuple[int, int]] | None = None) -> tuple[bool, dict[str, str]]:
        """readiness() of every base as last read (a base the controller never reported is still starting)."""
        await self.states()
        return readiness({b: self._states.get(b) for b in self.deployments}, self.may_idle, loading)

    async def require(self, base: str, model: str) -> None:
        """Return once `base` runs (or may start for this request); Unavailable naming why if it does not within
        wait_s, or at once if Ray cannot place its replica (waiting would not bring one)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            state = (await self.states()).get(base, BaseState(True))
            if state.running or (base in self.may_idle and state.placeable):
                return
            if time.monotonic() >= deadline or not state.placeable:
                raise Unavailable(f"model '{model}' is unavailable: {state.reason}")
            await asyncio.sleep(min(self.refresh_s, max(0.0, deadline - time.monotonic())))


_UNPLACEABLE = re.compile(r"Resources required for each replica: (\{.*?\}), total resources available: (\{.*?\})")


def base_state(base: str, running: int, message: str, nodes: Nodes | None = None) -> BaseState:
    """A base's state from its deployment's running replicas and the controller's message about it. Serve says a
    replica waited over 30 s to be placed both where no node could ever hold it and where the resources are
    held by other replicas still starting: with nodes, a replica that some node's total resources cover is
    starting, not unplaceable (nodes is read only then)."""
    if running > 0:
        return BaseState(True)
    why = f"base '{base}' has no running replica"
    placed = _UNPLACEABLE.search(message)
    if placed and _fits(placed[1], nodes):
        return BaseState(False, f"{why}: waiting for resources other replicas hold (each replica needs "
                                f"{placed[1]}; {placed[2]} available now)")
    if placed:  # Ray's own words, after 30 s of trying
        return BaseState(False, f"{why}: Ray cannot place it (each replica needs {placed[1]}; the cluster has "
                                f"{placed[2]} available)", placeable=False)
    first = message.split(". ")[0].strip().rstrip(".")
    return BaseState(False, why + (f" ({first})" if first else ""))


def _fits(required: str, nodes: Nodes | None) -> bool:
    """Whether one live node's total resources cover a replica's (as Serve's message writes them, in JSON; a list
    of placement-group bundles is left to Ray's words)."""
    if nodes is None:
        return False
    try:
        need = json.loads(required)
    except ValueError:
        return False
    return isinstance(need, dict) and any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes())
