"""The fleet scenario: SmolLM2 and LoRA adapters served from object storage, started on a node whose cache is empty
(cold) and again on the same node once its cache holds them (warm).

    python -m loadtests.run --scenario fleet [--adapters 8] [--repeats 3] [--out bench-results/loadtest]

The store is on an S3 server on loopback (moto's server mode); Ray is a cluster (ray.cluster_utils.Cluster) of a
CPU-less head and one worker node with its own MANYFOLD_CACHE_DIR. Each round deploys the app cold (the node's
cache emptied first), then deletes it and deploys it warm. A phase's start is the deploy call until /readyz answers
200; then every model answers one request (loadtests/smoke.py), the base first. Objects fetched and hit come from
/metrics (manyfold_node_cache_objects_total): the hit ratio is hit / (hit + fetch) over the phase.
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from loadtests.generator import free_port
from loadtests.smoke import smoke
from serve.bench.report import machine

BASE = "smollm2"


def _adapters(base_dir: Path, n: int, out: Path) -> list[Path]:
    """n PEFT LoRA adapters of the base (rank 8 on q_proj and v_proj, random non-zero weights: what is measured is
    moving and loading bytes, not what they learned)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir),
                           LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    dirs = []
    for i in range(n):
        torch.manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(std=0.02)
        model.save_pretrained(out / f"lora-{i}")
        dirs.append(out / f"lora-{i}")
    return dirs


def _store(url: str, adapters: int, work: Path) -> None:
    from serve.data.models import smollm2_dir
    from serve.store.node_cache import NodeCache
    from serve.store.object_store import ObjectStore
    from serve.variants.base import add_batch

    store = ObjectStore(url, create=True, cache=NodeCache(work / "cache-writer", 4 << 30))
    store.add_base(BASE, smollm2_dir())
    items = [(f"{BASE}-t{i}", BASE, str(d), "lora") for i, d in enumerate(_adapters(smollm2_dir(), adapters, work))]
    outcomes = add_batch(store, items)
    failed = [o for o in outcomes if isinstance(o, Exception)]
    if failed:
        raise SystemExit(f"fleet: adding the adapters failed: {failed[0]}")


def _node_cache(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=60).text
    from prometheus_client.parser import text_string_to_metric_families

    family = next(f for f in text_string_to_metric_families(text) if f.name == "manyfold_node_cache_objects")
    return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}


def _phase(name: str, app, url: str, cache: Path) -> dict:
    """Deploy, wait for /readyz, one request per model; -> the phase's figures."""
    from ray import serve

    t0 = time.perf_counter()
    serve.run(app, name="manyfold", route_prefix="/", blocking=False, logging_config={"log_level": "WARNING"})
    with httpx.Client(base_url=url, timeout=10) as http:
        for _ in range(6000):  # bounded: 10 minutes of 0.1 s polls
            try:
                if http.get("/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise SystemExit(f"fleet: {name} start: /readyz never answered 200")
    start_s = time.perf_counter() - t0
    _, rows = smoke(url)
    bad = [r for r in rows if r[1] != 200]
    if bad:
        raise SystemExit(f"fleet: {name}: {bad[0][0]} answered {bad[0][1]}")
    counts = _node_cache(url)
    seconds = {m: s for m, _, s in rows}
    adapters = [s for m, s in seconds.items() if m != BASE]
    serve.delete("manyfold")
    fetched, hit = counts.get("fetch", 0.0), counts.get("hit", 0.0)
    return {"phase": name, "start_s": start_s, "first_base_s": seconds[BASE],
            "first_adapter_s": statistics.median(adapters), "objects_fetched": fetched, "objects_hit": hit,
            "hit_ratio": hit / (hit + fetched) if hit + fetched else float("nan"),
            "node_cache_mib": sum(p.stat().st_size for p in (cache / "objects").iterdir()) / (1 << 20)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=["fleet"], default="fleet")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="cold then warm, this many rounds; medians reported")
    p.add_argument("--out", default="bench-results/loadtest")
    args = p.parse_args(argv)

    import boto3
    from moto.server import ThreadedMotoServer

    import serve.deployments  # noqa: F401  (Ray on loopback: set before ray is imported)
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serve.app import build_app
    from serve.config import ServeConfig

    work = Path(tempfile.mkdtemp(prefix="manyfold-fleet-"))
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    s3.start()
    host, s3_port = s3.get_host_and_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://{host}:{s3_port}", AWS_ACCESS_KEY_ID="fleet",
                      AWS_SECRET_ACCESS_KEY="fleet", AWS_REGION="us-east-1",
                      MANYFOLD_CACHE_DIR=str(work / "cache-driver"))
    bucket = f"manyfold-fleet-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]).create_bucket(Bucket=bucket)
    store = f"s3://{bucket}/store"
    _store(store, args.adapters, work)
    cache = work / "cache-node"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    cluster.add_node(num_cpus=2, env_vars={"MANYFOLD_CACHE_DIR": str(cache)})
    runs = []
    try:
        ray.init(address=cluster.address, logging_level="ERROR")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        config = ServeConfig(store=store, port=port, deployment={"num_cpus": 2})
        for round_ in range(args.repeats):
            shutil.rmtree(cache, ignore_errors=True)
            for phase in ("cold", "warm"):
                runs.append({"round": round_, **_phase(phase, build_app(config), url, cache)})
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        s3.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = [{k: (statistics.median(r[k] for r in runs if r["phase"] == phase) if isinstance(v, float) else v)
             for k, v in next(r for r in runs if r["phase"] == phase).items() if k != "round"}
            for phase in ("cold", "warm")]
    print(f"machine: {machine()}")
    print(f"SmolLM2-135M and {args.adapters} LoRA adapters on S3 (moto on loopback), one worker node; median of "
          f"{args.repeats} rounds")
    print(f"{'phase':<6} {'start s':>8} {'first base s':>13} {'first adapter s':>16} {'fetched':>8} {'hit':>6} "
          f"{'hit ratio':>10} {'node cache MiB':>15}")
    for r in rows:
        print(f"{r['phase']:<6} {r['start_s']:>8.1f} {r['first_base_s']:>13.2f} {r['first_adapter_s']:>16.2f} "
              f"{r['objects_fetched']:>8.0f} {r['objects_hit']:>6.0f} {r['hit_ratio']:>10.1%} "
              f"{r['node_cache_mib']:>15.0f}")
    print("start: deploy until /readyz answers 200; first: one request per model, the base first; fetched / hit: "
          "store objects the replica downloaded / found in the node's cache")
    out = Path(f"{args.out}-fleet.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "adapters": args.adapters, "rows": rows, "runs": runs},
                              indent=2) + "\n")
    print(f"wrote {out}")
    return rows
