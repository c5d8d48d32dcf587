"""Prometheus metrics: request counters and histograms kept here, engine counters rendered from snapshots.

Engines may live in other processes (Ray replicas), so their state arrives as plain snapshots
(Engine.snapshot) and residency lists, and is rendered at scrape time. Label cardinality is bounded: at most
MAX_MODEL_LABELS model names get their own series; the rest share "other", unknown names are "unknown". Of
thousands of variants, the residency gauge shows those held in memory first, then others up to the same cap.
"""

import json
import time
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from serve.engine.stats import SECONDS_BUCKETS
from serve.engine.types import Residency

MAX_MODEL_LABELS = 256


def _histogram(name: str, doc: str, dist: dict) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=_cumulative(dist), sum_value=dist["total"])


def _merge(dists: list[dict]) -> dict:
    out = {"buckets": dists[0]["buckets"], "counts": [0] * len(dists[0]["counts"]), "total": 0.0}
    for d in dists:
        out["counts"] = [a + b for a, b in zip(out["counts"], d["counts"])]
        out["total"] += d["total"]
    return out


VLLM_LATENCIES = (
    ("vllm:time_to_first_token_seconds", "first_token", "Seconds from a request's arrival to its first token"),
    ("vllm:inter_token_latency_seconds", "inter_token", "Seconds between two tokens of a request"),
    ("vllm:e2e_request_latency_seconds", "end_to_end", "Seconds from a request's arrival to its answer"),
    ("vllm:request_queue_time_seconds", "queue", "Seconds from a request's arrival until it joined a running batch"),
)
"""vLLM's names for what every dashboard built for vLLM reads, with its label `model_name` (here: the base)."""


def _tenant_waits(snapshots: list[dict]) -> list[HistogramMetricFamily]:
    """Each authenticated tenant's generation requests by phase, summed over the replicas (Scheduler.tenant_waits)."""
    out = []
    for name, key, doc in (("manyfold_tenant_queue_seconds", "queue", "Seconds from a tenant's request's arrival "
                            "until it joined a running batch"),
                           ("manyfold_tenant_first_token_seconds", "first_token", "Seconds from a tenant's "
                            "request's arrival to its first token")):
        family = HistogramMetricFamily(name, doc, labels=["tenant"])
        waits = [s.get("tenant_waits", {}) for s in snapshots]
        for tenant in sorted({t for w in waits for t in w}):
            dist = _merge([w[tenant][key] for w in waits if tenant in w])
            family.add_metric([tenant], _cumulative(dist), sum_value=dist["total"])
        out.append(family)
    return out


def _vllm(snapshots: list[dict]) -> list:
    """vLLM-compatible families: latencies, tokens, preemptions, running and waiting requests, the KV store's use,
    the LoRA adapters of each."""
    out = []
    by_base = [s.get("latencies", {}) for s in snapshots]
    bases = sorted({b for lat in by_base for b in lat})
    for name, key, doc in VLLM_LATENCIES:
        family = HistogramMetricFamily(name, doc, labels=["model_name"])
        for base in bases:
            dists = [lat[base][key] for lat in by_base if key in lat.get(base, {})]
            if dists:
                dist = _merge(dists)
                family.add_metric([base], _cumulative(dist), sum_value=dist["total"])
        out.append(family)
    for name, key, doc in (("vllm:prompt_tokens", "prompt_tokens", "Prompt tokens of requests that joined a batch"),
                           ("vllm:generation_tokens", "generation_tokens", "Tokens generated")):
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        for base in bases:
            family.add_metric([base], sum(lat.get(base, {}).get(key, 0) for lat in by_base))
        out.append(family)
    preempted = CounterMetricFamily("vllm:num_preemptions", "Running requests parked for another tenant's or for want "
                                    "of KV blocks (their keys and values kept, resumed later)", labels=["model_name"])
    counts = [s.get("preemptions", {}) for s in snapshots]
    for base in sorted(set(bases) | {b for c in counts for b in c}):
        preempted.add_metric([base], sum(c.get(base, 0) for c in counts))
    out.append(preempted)
    prefix = [s.get("prefix_tokens", {}) for s in snapshots]
    for key, doc in (("queries", "Prompt tokens of requests admitted to a batch, looked up in the prefix cache"),
                     ("hits", "Prompt tokens found in the prefix cache (their keys and values not computed again)")):
        family = CounterMetricFamily(f"vllm:prefix_cache_{key}", doc, labels=["model_name"])
        for base in sorted({b for p in prefix for b in p}):
            family.add_metric([base], sum(p.get(base, {}).get(key, 0) for p in prefix))
        out.append(family)
    kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Share of the KV cache's blocks held by running rows (1: "
                           "every block)", labels=["model_name"])
    blocks = [s.get("kv_blocks", {}) for s in snapshots]
    for base in sorted({b for by in blocks for b in by}):
        total = sum(by[base]["blocks"] for by in blocks if base in by)
        kv.add_metric([base], sum(by[base]["used"] for by in blocks if base in by) / total if total else 0.0)
    out.append(kv)
    running = GaugeMetricFamily("vllm:num_requests_running", "Requests in a generation batch", labels=["model_name"])
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests not yet answered nor in a generation batch",
                                labels=["model_name"])
    lora = GaugeMetricFamily("vllm:lora_requests_info", "The LoRA adapters of running and waiting requests "
                             "(value: when this was read)", labels=["running_lora_adapters",
                                                                    "waiting_lora_adapters", "max_lora"])
    loads = [s.get("load", {}) for s in snapshots]
    for base in sorted({b for load in loads for b in load}):
        running.add_metric([base], sum(load.get(base, {}).get("running", 0) for load in loads))
        waiting.add_metric([base], sum(load.get(base, {}).get("waiting", 0) for load in loads))
    names = {k: sorted({v for load in loads for by in load.values() for v in by.get(f"{k}_variants", [])})
             for k in ("running", "waiting")}
    most = max((s.get("max_batch_size", 0) for s in snapshots), default=0)
    lora.add_metric([",".join(names["running"]), ",".join(names["waiting"]), str(most)], time.time())
    return [*out, running, waiting, lora]


def _cumulative(dist: dict) -> list[tuple[str, float]]:
    out, running = [], 0
    for bound, count in zip([*dist["buckets"], float("inf")], dist["counts"]):
        running += count
        out.append(("+Inf" if bound == float("inf") else str(bound), running))
    return out


def _engine_histograms(snapshots: list[dict]) -> list[HistogramMetricFamily]:
    out = []
    for name, doc, key in (("manyfold_batch_size", "Rows per forward pass", "batch_sizes"),
                           ("manyfold_variant_load_seconds", "Decode time of a cold variant", "load_seconds")):
        dists = [s[key] for s in snapshots if key in s]
        if dists:
            out.append(_histogram(name, doc, _merge(dists)))
    return out


def _by_base(name: str, doc: str, snapshots: list[dict], key: str) -> GaugeMetricFamily:
    """A gauge of each base's figure snapshot[key][base], summed over the replicas."""
    gauge = GaugeMetricFamily(name, doc, labels=["base"])
    for base in sorted({b for s in snapshots for b in s.get(key, {})}):
        gauge.add_metric([base], sum(s.get(key, {}).get(base, 0) for s in snapshots))
    return gauge


def _node_cache(snapshots: list[dict]) -> CounterMetricFamily:
    """hit / (hit + fetch) is the node caches' hit ratio: a replica that starts where its base is cached adds hits
    alone."""
    objects = CounterMetricFamily("manyfold_node_cache_objects", "Store objects the replicas looked up in their "
                                  "node's cache (object storage): hit (on the node already), fetch (downloaded and "
                                  "checked)", labels=["outcome"])
    for outcome, key in (("hit", "hits"), ("fetch", "fetches")):
        objects.add_metric([outcome], sum(s.get("node_cache", {}).get(key, 0) for s in snapshots))
    return objects


def _steps(snapshots: list[dict]) -> list[CounterMetricFamily]:
    """Generation steps, and their decode and prompt tokens, by how they ran."""
    steps = CounterMetricFamily("manyfold_generation_steps", "Generation steps by how they ran: graphed (a CUDA graph "
                                "replayed) or eager, with the reason (cpu, graphs off, echo: a prompt's logits of "
                                "every position, or the family of rows that cannot be captured)",
                                labels=["base", "mode", "reason"])
    tokens = CounterMetricFamily("manyfold_generation_step_tokens", "Tokens of generation steps by kind (decode: a "
                                 "running row's next token; prompt: a prompt chunk's) and how their step ran",
                                 labels=["base", "kind", "mode"])
    for family, key in ((steps, "steps"), (tokens, "step_tokens")):
        counts: dict[tuple[str, str, str], int] = {}
        for s in snapshots:
            for base, by in s.get(key, {}).items():
                for how, n in by.items():
                    first, _, second = how.partition(":")
                    counts[(base, first, second)] = counts.get((base, first, second), 0) + n
        for labels, n in sorted(counts.items()):
            family.add_metric(list(labels), n)
    return [steps, tokens]


def _grammars(snapshots: list[dict]) -> list[Metric]:
    """Structured outputs' grammars, by base: compiled, found (in the cache, or compiling for another request),
    evicted, refused (by the library, or past the compile bound); and the bytes the cache holds."""
    events = CounterMetricFamily("manyfold_grammar_events", "Grammars of structured outputs: compile (compiled), hit "
                                 "(in the cache or compiling already: nothing compiled), eviction, refused (the "
                                 "library refused it, or it compiled past the bound: a 400)", labels=["base", "event"])
    held = GaugeMetricFamily("manyfold_grammar_cache_bytes", "Bytes of compiled grammars each base keeps",
                             labels=["base"])
    stats = [s.get("grammars", {}) for s in snapshots]
    for base in sorted({b for by in stats for b in by}):
        for event, key in (("compile", "compiles"), ("hit", "hits"), ("eviction", "evictions"),
                           ("refused", "refused")):
            events.add_metric([base, event], sum(by.get(base, {}).get(key, 0) for by in stats))
        held.add_metric([base], sum(by.get(base, {}).get("bytes", 0) for by in stats))
    return [events, held]


def _residency(models: list) -> GaugeMetricFamily:
    """Bounded as model labels are: the models held in memory first, then others, up to MAX_MODEL_LABELS."""
    resident = GaugeMetricFamily("manyfold_variant_resident", "1 at the tier where a model's weights are: hot "
                                 "(the fast tier), warm (host memory), cold (on disk only)", labels=["model", "tier"])
    held_first = sorted(models, key=lambda m: m.residency == "cold")  # stable: the store's order within each
    for m in held_first[:MAX_MODEL_LABELS]:
        for tier in get_args(Residency):
            resident.add_metric([m.name, tier], 1.0 if m.residency == tier else 0.0)
    return resident


def _bounded(seen: set[str], name: str) -> str:
    """`name`, or "other" once MAX_MODEL_LABELS names have series of their own: a label's cardinality is bounded."""
    if name not in seen:
        if len(seen) >= MAX_MODEL_LABELS:
            return "other"
        seen.add(name)
    return name


def _sample_order(sample) -> tuple:
    """A series' samples together, a histogram's buckets in the order of their bounds."""
    labels = sorted((k, v) for k, v in sample.labels.items() if k != "le")
    return labels, sample.name, float(sample.labels.get("le", 0))


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self._labelled: set[str] = set()
        r = self.registry
        self.requests = Counter("manyfold_requests", "HTTP requests", ["model", "route", "status"], registry=r)
        self.tokens = Counter("manyfold_tokens", "Tokens processed", ["model", "kind"], registry=r)
        self.latency = Histogram("manyfold_request_latency_seconds", "Request latency", ["model", "route"],
                                 buckets=SECONDS_BUCKETS, registry=r)
        self._tenants: set[str] = set()
        self.tenant_requests = Counter("manyfold_tenant_requests", "HTTP requests by tenant", ["tenant", "status"],
                                       registry=r)
        self.tenant_tokens = Counter("manyfold_tenant_tokens", "Prompt and completion tokens served, by tenant",
                                     ["tenant"], registry=r)
        self.tenant_limited = Counter("manyfold_tenant_limited", "Requests refused at a tenant's limit",
                                      ["tenant", "limit"], registry=r)
        self.replica_lost = Counter("manyfold_replica_lost_requests", "Requests whose base's replica went away (its "
                                    "actor, worker or node) before answering in full: resent to a live replica, or "
                                    "answered 503 with Retry-After (unavailable: lost again, or a stream had begun)",
                                    ["model", "outcome"], registry=r)

    def model_label(self, name: str | None, status: int = 200) -> str:
        if not name:
            return "none"
        if status == 404:
            return "unknown"
        return _bounded(self._labelled, name)

    def tenant_label(self, name: str | None) -> str:
        """Bounded as model labels are: MAX_MODEL_LABELS tenants get their own series, the rest share "other"."""
        return _bounded(self._tenants, name) if name else "none"

    def time(self, model: str | None, route: str, status: int, started_s: float) -> None:
        """Latency to the start of the response (a stream's first byte, not its end)."""
        self.latency.labels(self.model_label(model, status), route).observe(time.perf_counter() - started_s)

    def count(self, model: str | None, route: str, status: int, tenant: str | None = None) -> None:
        """One request, once it has ended, under the status it ended with (499: the client left first), and under
        its tenant's when it has one."""
        self.requests.labels(self.model_label(model, status), route, str(status)).inc()
        if tenant is not None:
            self.tenant_requests.labels(self.tenant_label(tenant), str(status)).inc()

    def lost(self, model: str, outcome: str) -> None:
        """A request whose replica went away: "resent" or "unavailable" (serve/deployments/router.py)."""
        self.replica_lost.labels(self.model_label(model), outcome).inc()

    def counters(self) -> dict[str, float]:
        """This ingress's counters and histograms as plain data, one entry a sample (the key names its family, type,
        sample and labels), so that ingresses' counters add up key by key (serve/deployments/board.py)."""
        out = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    key = json.dumps([family.name, family.type, sample.name, sorted(sample.labels.items())])
                    out[key] = sample.value
        return out

    def _ingress_families(self, totals: dict[str, float]) -> list[Metric]:
        """The families of `totals` (counters() of every ingress, added up), with this process's help texts."""
        docs = {f.name: f.documentation for f in self.registry.collect()}
        families: dict[str, Metric] = {}
        for key, value in totals.items():
            name, kind, sample, labels = json.loads(key)
            family = families.get(name)
            if family is None:
                family = families[name] = Metric(name, docs.get(name, name), kind)
            family.add_sample(sample, dict(labels), value)
        for family in families.values():
            family.samples.sort(key=_sample_order)
        return list(families.values())

    def render(self, snapshots: list[dict], models: list, in_flight: int = 0,
               ingresses: dict[str, float] | None = None) -> bytes:
        """The ingresses' request metrics (`ingresses`: every ingress's counters(), added up; None: this process's
        alone) plus the engines' snapshots (every replica's; counters of replicas gone come as a snapshot of
        counters alone) and every model's residency."""
        extra = CollectorRegistry()
        families = [GaugeMetricFamily("manyfold_requests_in_flight", "HTTP requests this ingress is answering "
                                      "(streams until their last event), this one included", value=in_flight)]
        events = CounterMetricFamily("manyfold_cache_events", "Variant cache lookups and evictions", labels=["event"])
        for event in ("hit", "miss", "eviction"):
            key = {"hit": "cache_hits", "miss": "cache_misses", "eviction": "cache_evictions"}[event]
            events.add_metric([event], sum(s.get(key, 0) for s in snapshots))
        families.append(events)
        used = GaugeMetricFamily("manyfold_cache_bytes", "Bytes of decoded variants per tier (hot: the fast tier, "
                                 "warm: host memory); recycled: buffers of evicted variants kept for the next decode",
                                 labels=["tier"])
        for tier in ("hot", "warm", "recycled"):
            used.add_metric([tier], sum(s.get("cache_bytes", {}).get(tier, 0) for s in snapshots))
        families.append(used)
        seconds = CounterMetricFamily("manyfold_engine_seconds", "Engine time by part: step (a generation step "
                                      "on the compute thread), forward (model forwards), lora / weights / emr "
                                      "(corrections inside forwards), staging (writing variants into slots), "
                                      "scheduling (event loop between steps)", labels=["part"])
        for part in sorted({p for s in snapshots for p in s.get("seconds", {})}):
            seconds.add_metric([part], sum(s.get("seconds", {}).get(part, 0.0) for s in snapshots))
        families.append(seconds)
        families.append(GaugeMetricFamily("manyfold_queue_depth", "Rows waiting for a scheduler",
                                          value=sum(s.get("queue_depth", 0) for s in snapshots)))
        families.append(_by_base("manyfold_base_weight_bytes", "Resident bytes of each base's weights (a NeuZip base: "
                                 "its coded streams, the weights kept decoded, its decode buffers)", snapshots,
                                 "base_bytes"))
        families.append(_by_base("manyfold_kv_store_bytes", "Bytes of each causal base's KV store, allocated once",
                                 snapshots, "kv_bytes"))
        families += _steps(snapshots)
        families += _grammars(snapshots)
        families.append(_node_cache(snapshots))
        families += _vllm(snapshots)
        families += _tenant_waits(snapshots)
        plans = [s["memory_plan"] for s in snapshots if s.get("memory_plan")]
        if plans:  # neuzip_decoded_mib: auto
            plan = GaugeMetricFamily("manyfold_memory_plan_bytes", "The replicas' memory plan: target, resident with "
                                     "nothing decoded, working (a forward at the largest batch), reserved (caches "
                                     "and slots), decoded (NeuZip weights kept decoded)", labels=["part"])
            for part in ("target", "resident", "working", "reserved", "decoded"):
                plan.add_metric([part], sum(p[part] for p in plans))
            families.append(plan)
        families += _engine_histograms(snapshots)
        families.append(_residency(models))
        families += self._ingress_families(self.counters() if ingresses is None else ingresses)

        class _Snapshot:
            def collect(self):
                return families

        extra.register(_Snapshot())
        return generate_latest(extra)
