"""ServeConfig: every setting of a running server, in one validated root model loaded from YAML or JSON."""

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from serve.errors import ConfigError, first_error
from serve.store.manifest import TenantEntry


class StrictModel(BaseModel):
    """Settings people write: unknown keys are errors; "8000" for a port is fine."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class CacheConfig(StrictModel):
    device_mib: Annotated[int, Field(ge=0)] = 2048
    """Decoded variant weights held on the engine's device, ready to run."""
    cpu_mib: Annotated[int, Field(ge=0)] = 4096
    """Decoded weights demoted to host memory (on a CPU engine the same memory, kept as a second LRU tier)."""
    pinned: list[str] = []
    """Variants never evicted; they count against the device budget."""


DEFAULT_KV_ROWS = 16
"""Rows of max_model_len whose positions a KV cache holds when batch.kv_cache_mib is not set (the slots the store
held by default before it was paged)."""


class BatchConfig(StrictModel):
    max_batch_size: Annotated[int, Field(ge=1, le=1024)] = 256
    """Rows run together in one engine step at most (a causal base's rows are held to what its KV cache holds)."""
    batch_wait_timeout_s: Annotated[float, Field(ge=0, le=1)] = 0.005
    """How long the scheduler waits for more rows before running a partial batch."""
    max_queue: Annotated[int, Field(ge=1)] = 256
    """Requests waiting beyond this are refused with 429."""
    max_concurrent_groups: Annotated[int, Field(ge=1, le=64)] = 4
    """Variant groups in flight at once: while one waits for its variant's decode, the others run."""
    max_step_tokens: Annotated[int, Field(ge=1, le=1 << 20)] = 512
    """Tokens one generation step runs (vLLM's max_num_batched_tokens): every running row's next token, then the
    admitted prompts' tokens up to this budget, a long prompt over several steps."""
    max_model_len: Annotated[int, Field(ge=16, le=1 << 20)] = 2048
    """Positions a causal row may hold, prompt and generated tokens together (at most the model's own, and the
    KV cache's): the context a request is checked against."""
    fairness: Literal["vtc", "fcfs"] = "vtc"
    """The order waiting rows are taken in, per replica (serve/engine/scheduling/fairness.py). "vtc": by tenant, the one
    served fewest weighted tokens first (S-LoRA's Virtual Token Counter), so one tenant's flood cannot starve the rest;
    with no tenants configured each model is a tenant. "fcfs": first come, first served."""
    vtc_burst_rows: Annotated[int, Field(ge=0, le=1024)] = 8
    """VTC's banked credit, in rows: a tenant back from idle ranks up to this many of its rows' worth (prompt and
    max_tokens, weighted) below the least served tenant waiting, so a tenant within its share is served a burst of
    that many before a flood's rows, however the flood stands; 0 is S-LoRA's VTC, which banks nothing."""
    vtc_far_prompt_tokens: Annotated[int, Field(ge=1, le=1 << 20)] = 32
    """Under vtc, prompt tokens one step writes of the rows of a tenant far ahead of another tenant in the batch
    (served more by more than the credit: vtc_burst_rows + 1 of that tenant's next rows), all its rows together:
    a flood's long prompts are written a little a step, one at a time, so the steps the other tenants' rows wait
    on stay short. The budget's rest stays unused then: latency bought with the far tenant's throughput, never
    another's. On a CPU a prompt token costs about what a decoding row does (SmolLM2, 16 rows decoding: 93 ms a
    step, 144 ms with 16 prompt tokens, 181 ms with 32). Too few leave slots empty: a flood's rows join only as
    fast as their prompts are written, and at 16 a step its 25-token prompts refilled the slots its 16-token
    answers freed too slowly (13.5 rows decoding a step against FCFS's 14.4, bench-results); a GPU's step barely
    grows with a few hundred, and can be given more."""
    vtc_far_recent_s: Annotated[float, Field(ge=0, le=3600)] = 2.0
    """Under vtc, a tenant whose last row was answered this many seconds ago still holds a tenant far ahead of it to
    vtc_far_prompt_tokens a step, as its rows in the batch would: Poisson arrivals leave moments with none of a
    light tenant's rows open, and a flood given the whole budget then made the step a light row arriving next
    waits for several times longer. 0: only tenants with rows open count."""
    kv_cache_mib: Annotated[float, Field(gt=0)] | None = None
    """Memory for a causal base's KV cache, allocated once: the blocks it buys are shared by the running rows, each
    holding the blocks its positions fill (serve/engine/kv/store.py). None: the positions of DEFAULT_KV_ROWS rows of
    max_model_len."""
    kv_block_tokens: Annotated[int, Field(ge=1, le=1 << 20)] = 16
    """Positions a KV block holds (vLLM's block_size): a row wastes less than one block. At max_model_len or more,
    one block a row: the slot store, each row holding a whole context from its start."""
    prefix_caching: bool = True
    """Full KV blocks are kept after their rows end and reused by later rows whose prompts begin with the same
    tokens, on the same base and variant, for the same tenant only (serve/engine/kv/blocks.py)."""

    def permits(self) -> int:
        """Rows the scheduler takes out of its queue at once (serve/engine/scheduling/scheduler.py), each holding
        a permit until it is answered; max_batch_size more may be taken past them to take parked rows' slots."""
        return self.max_batch_size * self.max_concurrent_groups

    def rows_held(self) -> int:
        """Requests an engine holds at most: max_queue waiting, the rows out of the queue with a permit, and the
        max_batch_size taken past the permits; beyond them it refuses."""
        return self.max_queue + self.permits() + self.max_batch_size


class SlotsConfig(StrictModel):
    adapter_mib: Annotated[float, Field(gt=0)] = 256
    """Memory for LoRA / PiSSA adapters in a base's adapter pool on the engine's device
    (serve/engine/families/adapter_pool.py): each costs what its rank costs; rows of adapters beyond it wait until
    others leave. Idle adapters stay until their room is needed (LRU)."""
    weights_mib: Annotated[float, Field(gt=0)] = 2048
    """Memory for full fine-tunes' copies in a base's pool on a CUDA device (serve/engine/families/weight_pool.py),
    where rows of every fine-tune a step holds run in one launch a module: each costs the bytes of the modules it
    changed; rows of fine-tunes beyond it wait until others leave. Idle ones stay until their room is needed (LRU). A
    CPU engine runs the cache's tensors and holds no pool."""
    emr_formed_mib: Annotated[float, Field(ge=0)] = 512
    """Memory for EMR tasks' formed weights (W + lambda M * tau, serve/engine/families/emr_slots.py) kept between
    forwards, per group: a hot task's rows run at dense speed without forming its weights again. 0: formed every
    forward."""
    max_rank: Annotated[int, Field(ge=1, le=1024)] = 64
    """Largest adapter rank a slot takes (a converted PiSSA adapter of rank r has 2r); larger ones are refused."""


class LimitsConfig(StrictModel):
    max_request_bytes: Annotated[int, Field(ge=1024)] = 1 << 20
    max_tokens: Annotated[int, Field(ge=1)] = 512
    """Upper bound on `max_tokens` of one completion."""
    max_inputs: Annotated[int, Field(ge=1)] = 64
    """Texts in one classify or embeddings request."""
    max_input_chars: Annotated[int, Field(ge=1)] = 20_000


class AutoscalingConfig(StrictModel):
    min_replicas: Annotated[int, Field(ge=0)] = 1
    max_replicas: Annotated[int, Field(ge=1)] = 2
    target_ongoing_requests: Annotated[float, Field(gt=0)] = 8.0

    @model_validator(mode="after")
    def _ordered(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas ({self.max_replicas})")
        return self


class DeploymentConfig(StrictModel):
    """Ray Serve settings of one base's model deployment."""

    num_replicas: Annotated[int, Field(ge=1)] = 1
    autoscaling: AutoscalingConfig | None = None
    """When set, Ray Serve scales replicas between its bounds and num_replicas is ignored."""
    num_cpus: Annotated[float, Field(gt=0)] | Literal["auto"] = "auto"
    """CPUs Ray reserves for each replica. "auto": the node's CPUs left by bases that name a number, shared
    among the replicas of the bases that say auto, so that every base is scheduled (serve/app.py cpu_shares)."""
    device: str | None = None
    """The device this base's replicas run on, instead of the config's `device` (an encoder on CPU beside language
    models on CUDA)."""
    num_gpus: Annotated[float, Field(ge=0)] | None = None
    """GPUs Ray reserves for each replica; None: 1 on a CUDA device (so a replica lands only where a GPU is), 0
    otherwise."""
    resources: dict[str, Annotated[float, Field(gt=0)]] = {}
    """Custom Ray resources each replica needs (a node label such as {"a100": 1}: only nodes that offer it)."""
    max_replicas_per_node: Annotated[int, Field(ge=1)] | None = None
    """At most this many of the base's replicas on one node (Ray Serve's option; None: no limit)."""
    torch_threads: Annotated[int, Field(ge=1)] | None = None
    """Threads torch computes with in each replica; None: its CPU share, rounded, at least 1 (Ray itself would
    leave one thread per replica)."""
    max_ongoing_requests: Annotated[int, Field(ge=1)] | None = None
    """Requests one replica takes at once; its engine queues and batches them. None: every request its engine can
    hold (BatchConfig.rows_held), so that requests wait in the engine's queue, in the fairness policy's order, and
    a full queue refuses the flood's (429) rather than a light tenant's. A smaller number makes the requests
    beyond it wait in Ray's queue at the ingress, first come, first served, whatever batch.fairness says."""
    max_queued_requests: Annotated[int, Field(ge=1)] = 1024
    """Requests the ingress holds for this base while every replica is at max_ongoing_requests; beyond
    that, 429 with Retry-After."""
    graceful_shutdown_timeout_s: Annotated[float, Field(ge=0)] = 30.0
    """In-flight requests get this long to finish when a replica stops."""
    stall_timeout_s: Annotated[float, Field(gt=0)] = 300.0
    """A replica whose engine has had requests this long without answering one or taking a generation step fails
    its health check, and Serve replaces it (the longest honest wait: a large variant's first load)."""
    memory_target_mib: Annotated[int, Field(ge=1)] | None = None
    """Memory one replica may hold in all (host memory on CPU, device memory on CUDA); Ray reserves it for the
    replica. With `neuzip_decoded_mib: auto` a NeuZip base keeps decoded what it leaves (serve/engine/memory.py).
    None: Ray's `memory` resource of the replica, when it has one."""


class EngineConfig(StrictModel):
    cuda_graphs: Literal["auto", "off"] = "auto"
    """On CUDA, decode steps are captured as CUDA graphs per row bucket and replayed (serve/engine/step/graphs.py);
    "off": every step runs eagerly. Ignored on CPU."""
    batch_invariant: bool = False
    """A row's logits (so its greedy tokens and log probabilities) bitwise the same whatever else its step holds:
    every matmul in tiles of fixed rows, attention a query at a time (serve/engine/step/invariant.py), no step
    graphs. Off by default: it costs throughput (bench-results/engine-invariant-cpu.json)."""


class StructuredOutputsConfig(StrictModel):
    """Grammars of structured outputs and tool calls (serve/engine/generation/grammars.py), per base."""

    cache_mib: Annotated[float, Field(gt=0)] = 128
    """Compiled grammars kept, the least recently used evicted first (a JSON schema's grammar over a 49k-token
    vocabulary takes about 1.5 MiB)."""
    tenant_share: Annotated[float, Field(gt=0, le=1)] = 0.25
    """The part of cache_mib one tenant's grammars may hold: past it, its own least recently used go first."""
    compile_timeout_s: Annotated[float, Field(gt=0, le=600)] = 10.0
    """A request whose grammar compiles longer is refused (400); the compile goes on, and is kept if it ends."""
    max_compiling: Annotated[int, Field(ge=1, le=1024)] = 16
    """Grammars compiling or waiting to at once; a request with another new one is refused (429)."""


class AdminConfig(StrictModel):
    sources: list[str] = []
    """Where POST /v1/admin/variants may read a variant from besides the store's own `incoming/` folder: local path
    prefixes ("/data/adapters/") and object-storage prefixes ("s3://bucket/adapters/"). A path outside them is
    refused (403) before anything is read."""
    max_add_mib: Annotated[float, Field(gt=0)] = 8192
    """The most one add may copy; a larger one is refused and leaves nothing in the store."""


NEUZIP_DECODED_MIB = 0
"""Default decoded-layer budget of a NeuZip base (see `manyfold bench neuzip` for the trade)."""


class ServeConfig(StrictModel):
    store: Path | str
    """A local directory, or object storage as a URL (s3://BUCKET/PREFIX, gs://, az://, file://; the endpoint from
    AWS_ENDPOINT_URL, credentials from the AWS variables; serve/store/object_store.py)."""
    store_refresh_s: Annotated[float, Field(gt=0, le=3600)] = 2.0
    """How often each process looks for a change of the store that it did not make itself (serve/store/catalog.py):
    every replica serves another process's add or remove within this many seconds."""
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    device: str = "cpu"
    tenants: list[TenantEntry] = []
    """Empty, and none in the store: no authentication (loopback demos). Otherwise every request needs a tenant's
    key. Tenants added at run time live in the store (POST /v1/admin/tenants); one of the same name replaces
    the config's."""
    admin_key_sha256: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = []
    """Keys allowed on /v1/admin routes."""
    auth_file: Path | None = None
    """A YAML file of `tenants` and `admin_key_sha256` (a Kubernetes Secret mounted in every pod), added to the
    lists above when the config is parsed, so that keys stay out of a Serve config anyone may read. Read once:
    the parsed config carries its entries and None here, so replicas that parse it again read nothing."""
    deployment: DeploymentConfig = DeploymentConfig()
    """Defaults for every base's model deployment."""
    deployments: dict[str, DeploymentConfig] = {}
    """Per-base overrides, by base name."""
    ray_address: str | None = None
    """An existing Ray cluster to deploy onto (`ray://HOST:10001`, `HOST:6379`, or `auto`); None: `manyfold serve`
    starts Ray on this machine."""
    ingress_replicas: Annotated[int, Field(ge=1)] | Literal["per-node"] = "per-node"
    """HTTP ingress replicas. "per-node": one on each node alive when the app is deployed (one for a `manyfold serve`
    that starts its own Ray), so that a node lost takes only its own ingress and each node's proxy routes to the
    ingress beside it; or a number (deploy/'s manifest names its pods', whose workers may join after the deploy),
    spread over the nodes by Serve."""
    start_timeout_s: Annotated[float, Field(ge=0, le=3600)] = 120.0
    """`manyfold serve` waits this long for every base to run before it serves; a base still not running then
    is named, and its models answer 503 until it runs."""
    drain_timeout_s: Annotated[float, Field(ge=0, le=3600)] = 30.0
    """On SIGINT/SIGTERM, requests in flight get this long to finish (new ones get 503) before the server stops."""
    ingress_max_ongoing_requests: Annotated[int, Field(ge=1)] = 4096
    """Requests one ingress replica holds at once, for every base together. It only awaits the model replicas,
    so it should hold what they take and queue; Ray Serve's default of 5 would cap every batch at five rows."""
    neuzip_decoded_mib: Annotated[int, Field(ge=0)] | Literal["auto"] = NEUZIP_DECODED_MIB
    """A NeuZip base's decoded-layer budget: weights kept decoded for good (the rest decode on every use). "auto":
    what the replica's memory target leaves once the base, a forward at the largest batch and the caches' and
    slots' budgets are counted (serve/engine/memory.py)."""
    cache: CacheConfig = CacheConfig()
    batch: BatchConfig = BatchConfig()
    engine: EngineConfig = EngineConfig()
    slots: SlotsConfig = SlotsConfig()
    limits: LimitsConfig = LimitsConfig()
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    admin: AdminConfig = AdminConfig()

    @model_validator(mode="before")
    @classmethod
    def _read_auth_file(cls, data: object) -> object:
        if not isinstance(data, dict) or data.get("auth_file") is None:
            return data
        path = Path(data["auth_file"]).expanduser()
        import yaml

        try:
            extra = yaml.safe_load(path.read_text()) or {}
        except OSError as e:
            raise ValueError(f"auth_file {path}: cannot read ({e.strerror})") from e
        except yaml.YAMLError as e:
            raise ValueError(f"auth_file {path}: not valid YAML ({str(e).splitlines()[0]})") from e
        if not isinstance(extra, dict) or set(extra) - {"tenants", "admin_key_sha256"}:
            raise ValueError(f"auth_file {path}: expected a mapping of tenants and admin_key_sha256 only")
        return {**data, "auth_file": None,
                "tenants": [*data.get("tenants", []), *extra.get("tenants", [])],
                "admin_key_sha256": [*data.get("admin_key_sha256", []), *extra.get("admin_key_sha256", [])]}

    @field_validator("store", mode="before")
    @classmethod
    def _path_or_url(cls, v: object) -> object:
        """A URL stays a string (its scheme checked when the store opens); anything else is a local path."""
        if isinstance(v, str) and "://" in v:
            return v
        return Path(v).expanduser() if isinstance(v, str | Path) else v

    @field_validator("neuzip_decoded_mib", mode="before")
    @classmethod
    def _mib_or_auto(cls, v):
        if isinstance(v, str) and v != "auto" and not v.strip().isdigit():
            raise ValueError(f"a number of MiB or auto, got {v!r}")
        return v

    @model_validator(mode="after")
    def _keys_are_unique(self) -> "ServeConfig":
        seen: dict[str, str] = {}
        for t in self.tenants:
            for k in t.key_sha256:
                if k in seen:
                    raise ValueError(f"a key of tenant '{t.name}' is also a key of tenant '{seen[k]}'")
                seen[k] = t.name
        return self


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_config(path: str | Path, **overrides) -> ServeConfig:
    """Read a YAML or JSON file into ServeConfig; one-line ConfigError on any problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from e
    import yaml

    try:
        data = (yaml.safe_load(text) or {}) if path.suffix in (".yaml", ".yml") else json.loads(text)
    except (ValueError, yaml.YAMLError) as e:
        first = str(e).splitlines()[0]
        raise ConfigError(f"{path}: not valid {path.suffix[1:] or 'JSON'} ({first})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return parse_config({**data, **{k: v for k, v in overrides.items() if v is not None}}, str(path))


def parse_config(data: dict, where: str = "config") -> ServeConfig:
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{where}: {first_error(e)}") from e
