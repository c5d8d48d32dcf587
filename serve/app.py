"""The Ray Serve application: one EngineReplica deployment per base of the store, behind an HTTP ingress, and
a ResidencyBoard where the replicas say what they hold.

`serve run serve.app:build_app store=/path/to/store` (or a Serve config YAML, see deploy/) calls build_app
with the ServeConfig fields as its arguments.
"""

import asyncio
import math
import os
from collections.abc import Callable

import serve.deployments  # noqa: F401  (first: it keeps Ray on loopback before ray is imported)
from ray import serve
from ray.serve import Application

from serve.config import DeploymentConfig, ServeConfig, parse_config
from serve.deployments.board import ResidencyBoard
from serve.errors import ConfigError
from serve.store.store import open_store


REPLICA_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
"""glibc otherwise raises its mmap threshold as big blocks are freed, and evicted variants' memory stays in the
heap instead of going back to the OS: a fixed threshold keeps every tensor-sized block mmapped."""


BOARD = "residency-board"
APP = "manyfold"
STOP_POLL_S = 0.2
"""How often a stopping replica checks that its requests have ended (Serve's graceful_shutdown_wait_loop_s, 2 s by
default, is slept before the first check: three rows of deployments stopped in turn cost 6 s of every Ctrl-C).
The ingress's drain has already waited for the requests in flight (serve/http/drain.py)."""
RAY_CONNECT_TIMEOUT_S = 10.0
"""How long `manyfold serve --ray-address` waits for the cluster's port to take a connection."""
RAY_CLIENT_PORT = 10001
"""Ray Client's port when a ray:// address names none (Ray's default)."""


def deployment_name(base: str) -> str:
    return f"base-{base}"


def _ingress(config: ServeConfig, bases: list[str]):
    @serve.ingress()
    class Ingress:
        def __init__(self, *replicas):
            """The base deployments are bound here so Serve deploys them with the app; the router
            reaches them by name."""
            from serve.http.drain import DrainGate

            self.gate = DrainGate()
            self.id = serve.get_replica_context().replica_id.unique_id
            self.board = serve.get_deployment_handle(BOARD)
            self.metrics = None

        def __serve_build_asgi_app__(self):
            from serve.deployments.health import DeploymentHealth, ray_nodes, serve_status
            from serve.deployments.router import Router
            from serve.http.app import build_http_app
            from serve.metrics import Metrics
            from serve.store.catalog import Catalog

            handles = {b: serve.get_deployment_handle(deployment_name(b)) for b in bases}
            app = serve.get_replica_context().app_name
            health = DeploymentHealth({b: deployment_name(b) for b in bases}, serve_status(app),
                                      may_idle=idle_bases(config, bases), nodes=ray_nodes)
            catalog = Catalog(config.store, config.store_refresh_s)
            self.metrics = Metrics()
            router = Router(catalog, handles, self.board, health, self.id, lost=self.metrics.lost)
            return build_http_app(router, config, self.gate, self.metrics)

        async def check_health(self) -> None:
            """Serve calls this every health_check_period_s: the heartbeat of this ingress's request counters on
            the board, so that a scrape reaching another ingress counts them too (bounded; never fails)."""
            if self.metrics is not None:
                await _bounded(self.board.ingress.remote(self.id, self.metrics.counters()))

        async def __del__(self):
            """Stopping: the board keeps this ingress's counters among those of ingresses gone."""
            await _bounded(self.board.forget_ingress.remote(self.id))

        async def drain(self, timeout_s: float) -> tuple[str, int]:
            """Close this replica's gate and wait for its requests; -> (replica id, requests still running)."""
            left = await self.gate.close(timeout_s)
            return serve.get_replica_context().replica_id.unique_id, left

    return serve.deployment(Ingress, **ingress_options(config))


async def _bounded(call, timeout_s: float = 2.0) -> None:
    """A call to the board that may not hold up a health check or a stop (the board may be stopping too)."""
    try:
        await asyncio.wait_for(call, timeout_s)
    except Exception:  # noqa: BLE001
        pass


INGRESS_REPORT_S = 1.0
"""How often an ingress's health check reports its request counters to the board: within this, a scrape that
reaches another ingress counts them."""
REPLICA_HEALTH_S = 2.0
"""How often Serve checks a base's replica (10 s by default): a replica that died is noticed, and replaced, within
this rather than ten seconds later; each check is also the replica's residency heartbeat to the board."""


def ingress_options(config: ServeConfig) -> dict:
    """As many ingress replicas as config.ingress_replicas says, spread over the nodes (Serve's default; "per-node":
    one a node at most), since each node's proxy routes to the ingress beside it where there is one."""
    options = {"name": "Ingress", "num_replicas": ingress_replicas(config),
               "max_ongoing_requests": config.ingress_max_ongoing_requests, "ray_actor_options": {"num_cpus": 0},
               "health_check_period_s": INGRESS_REPORT_S, "graceful_shutdown_wait_loop_s": STOP_POLL_S}
    if config.ingress_replicas == "per-node":
        options["max_replicas_per_node"] = 1
    return options


def ingress_replicas(config: ServeConfig) -> int:
    """config.ingress_replicas, "per-node" counted as the Ray nodes alive now (1 when Ray is not started)."""
    import ray

    if config.ingress_replicas != "per-node":
        return config.ingress_replicas
    return max(1, len([n for n in ray.nodes() if n.get("Alive")])) if ray.is_initialized() else 1


def build_app(args: dict | ServeConfig) -> Application:
    from serve.deployments.replica import EngineReplica  # here: the ingress's process imports this module too

    config = args if isinstance(args, ServeConfig) else parse_config(dict(args), "serve application args")
    bases = list(open_store(config.store).manifest.bases)
    board = serve.deployment(ResidencyBoard, name=BOARD, num_replicas=1, ray_actor_options={"num_cpus": 0},
                             graceful_shutdown_wait_loop_s=STOP_POLL_S).bind()
    shares = cpu_shares(config, bases, *cluster_cpus())
    children = []
    for base in bases:
        options, threads = replica_options(config, base, shares[base])
        children.append(EngineReplica.options(**options).bind(config.model_dump(mode="json"), base, board, threads))
    return _ingress(config, bases).bind(*children)


def replica_options(config: ServeConfig, base: str, cpus: float) -> tuple[dict, int]:
    """Ray Serve options of a base's model deployment, its replicas reserving `cpus` each; -> (options, torch
    threads of a replica)."""
    d = config.deployments.get(base, config.deployment)
    actor = {"num_cpus": cpus, "num_gpus": replica_gpus(config, d), "runtime_env": {"env_vars": REPLICA_ENV}}
    if d.memory_target_mib is not None:
        actor["memory"] = d.memory_target_mib << 20
    if d.resources:
        actor["resources"] = dict(d.resources)
    options = {"name": deployment_name(base), "ray_actor_options": actor,
               "max_ongoing_requests": d.max_ongoing_requests or config.batch.rows_held(),
               "max_queued_requests": d.max_queued_requests,
               "graceful_shutdown_timeout_s": d.graceful_shutdown_timeout_s,
               "graceful_shutdown_wait_loop_s": STOP_POLL_S, "health_check_period_s": REPLICA_HEALTH_S}
    if d.max_replicas_per_node is not None:
        options["max_replicas_per_node"] = d.max_replicas_per_node
    if d.autoscaling is not None:
        options["autoscaling_config"] = d.autoscaling.model_dump()
    else:
        options["num_replicas"] = d.num_replicas
    return options, d.torch_threads or max(1, round(cpus))


def replica_gpus(config: ServeConfig, d: DeploymentConfig) -> float:
    """GPUs each replica of a base reserves: its num_gpus, else one on a CUDA device (Ray then places it only on a
    node with a free GPU), else none."""
    if d.num_gpus is not None:
        return d.num_gpus
    return 1.0 if (d.device or config.device).startswith("cuda") else 0.0


def idle_bases(config: ServeConfig, bases: list[str]) -> frozenset[str]:
    """The bases allowed to run no replica (autoscaling with min_replicas 0): their first request starts one."""
    return frozenset(b for b in bases if (d := config.deployments.get(b, config.deployment)).autoscaling is not None
                     and d.autoscaling.min_replicas == 0)


def _replicas(d: DeploymentConfig) -> int:
    return max(1, d.autoscaling.min_replicas) if d.autoscaling is not None else d.num_replicas


def cpu_shares(config: ServeConfig, bases: list[str], cluster: float, largest_node: float) -> dict[str, float]:
    """CPUs per replica of each base. A base that names num_cpus gets it; the CPUs those leave are shared among
    the (first) replicas of the bases that say "auto", at most a node's worth each, so that every base is
    scheduled: three bases on two cores get 0.6667 each, one base gets both."""
    settings = {b: config.deployments.get(b, config.deployment) for b in bases}
    fixed = {b: float(d.num_cpus) for b, d in settings.items() if d.num_cpus != "auto"}
    auto = [b for b in bases if b not in fixed]
    left = cluster - sum(fixed[b] * _replicas(settings[b]) for b in fixed)
    replicas = sum(_replicas(settings[b]) for b in auto)
    share = min(largest_node, max(left, 0.0) / replicas) if replicas else 0.0
    share = max(math.floor(share * 10_000) / 10_000, 0.0001)  # Ray's resolution; never 0: it would mean "none"
    return {**fixed, **{b: share for b in auto}}


def cluster_cpus() -> tuple[float, float]:
    """(CPUs of the whole Ray cluster, of its largest node), from Ray when it runs here, else this machine's."""
    import ray

    if ray.is_initialized():
        nodes = [n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        if nodes and max(nodes) > 0:
            return sum(nodes), max(nodes)
    n = float(os.cpu_count() or 1)
    return n, n


def check_ray_address(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Ray waits minutes for a cluster that is not there, printing its own warnings every few seconds; an operator
    who named one gets one line at once. `auto`, and forms Ray alone reads, are left to Ray (it says at once when
    `auto` finds no cluster)."""
    import socket

    client = address.startswith("ray://")
    if address == "auto" or ("://" in address and not client):
        return
    rest = address.removeprefix("ray://")
    host, sep, port = rest.rpartition(":")
    if not (sep and port.isdigit()):
        if not client:
            return
        host, port = rest, str(RAY_CLIENT_PORT)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"ray_address {address}: no Ray cluster answers at {host}:{port} ({e.strerror or e}); "
                          "start one (`ray start --head`), or leave out --ray-address to start Ray here") from None


def run_server(config: ServeConfig, ready: Callable[[str], None] = print) -> None:
    """Start Ray on this machine (or join config.ray_address), serve the store on config.host:config.port, block
    until SIGINT/SIGTERM, then shut down gracefully (replicas finish their in-flight requests first)."""
    import signal
    import threading

    import ray

    stop = threading.Event()
    bases = list(open_store(config.store).manifest.bases)  # a wrong store is one line before Ray starts, not after
    if config.ray_address:  # a cluster that runs without us: join it, and leave it as it was
        check_ray_address(config.ray_address)
        ray.init(address=config.ray_address, logging_level="WARNING", configure_logging=True)
    else:
        # "local": a new Ray, where no address would join one `ray start` left on this host (or RAY_ADDRESS)
        ray.init(address="local", include_dashboard=False, logging_level="WARNING", configure_logging=True)
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, whose own SIGTERM handler exits at once (no drain)
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        target = serve.RunTarget(target=build_app(config), name=APP, route_prefix="/",
                                 logging_config={"log_level": "WARNING"})
        serve.run_many([target], wait_for_applications_running=False)  # a base Ray cannot place must not hang us
        for line in wait_for_bases(APP, {b: deployment_name(b) for b in bases}, idle_bases(config, bases),
                                   config.start_timeout_s, stop):
            print(line, flush=True)
        if not stop.is_set():
            ready(f"http://{config.host}:{config.port}")
            stop.wait()
        drain(config)
    finally:
        if config.ray_address:
            serve.delete(APP)  # this app only: the cluster's other apps, and Serve itself, stay
        else:
            serve.shutdown()
        ray.shutdown()


def wait_for_bases(app: str, bases: dict[str, str], may_idle: frozenset[str], timeout_s: float, stop) -> list[str]:
    """Until the app is ready as /readyz says (every deployment of `app` running, but bases Ray cannot place and
    bases allowed to idle), at most timeout_s (or until stop is set); -> a warning line for each base then not
    running, whose models answer 503 naming why. bases: base -> its deployment's name."""
    import time

    from serve.deployments.health import base_state, ray_nodes, readiness, serve_status

    read, deadline = serve_status(app), time.monotonic() + timeout_s
    while True:
        status = read()
        others = [name for name in status if name not in bases.values()]  # the ingress and the board
        states = {b: base_state(b, *status[name], ray_nodes) if name in status else None
                  for b, name in bases.items()}
        ready, words = readiness(states, may_idle)
        if (status and ready and all(status[n][0] for n in others)) or time.monotonic() >= deadline or stop.is_set():
            break
        stop.wait(0.5)
    if not ready:
        ready, words = readiness(states, may_idle, board_loads(app))
    return start_warnings(words, timeout_s)


def board_loads(app: str) -> dict[str, tuple[int, int]]:
    """The board's word on the bases being fetched (ResidencyBoard.loads), bounded; {} if it does not answer."""
    try:
        return serve.get_deployment_handle(BOARD, app_name=app).loads.remote().result(timeout_s=2.0)
    except Exception:  # noqa: BLE001
        return {}


def start_warnings(words: dict[str, str], timeout_s: float) -> list[str]:
    """A line for each base not running when `manyfold serve` stops waiting (readiness words); a base still
    loading is not cut: it says how far it has come, and that it goes on."""
    lines = []
    for base, w in words.items():
        if w.startswith("loading"):
            lines.append(f"warning: after start_timeout_s ({timeout_s:g} s), {base} is still {w}; the load goes on, "
                         f"and its models answer 503 until it runs")
        elif not w.startswith(("running", "idle")):
            lines.append(f"warning: {base} is not running; its models answer 503 until it runs ({w})")
    return lines


def drain(config: ServeConfig, app: str = APP) -> None:
    """Before the proxy stops: every ingress replica refuses new requests (503) and finishes those in flight,
    streams to their [DONE], within config.drain_timeout_s. Serve routes a call to any replica, so calls go
    out in rounds until each replica has answered (bounded)."""
    from serve.deployments.health import serve_status

    handle = serve.get_deployment_handle("Ingress", app_name=app)
    running = max(1, serve_status(app)().get("Ingress", (1, ""))[0])
    drained: dict[str, int] = {}
    for _ in range(8):
        calls = [handle.drain.remote(config.drain_timeout_s) for _ in range(2 * running)]
        drained.update(c.result(timeout_s=config.drain_timeout_s + 10) for c in calls)
        if len(drained) >= running:
            break
    left = sum(drained.values())
    print(f"drained {len(drained)} ingress replica(s)" + (f"; {left} requests cut at the grace period" if left else ""))
