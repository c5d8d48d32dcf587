"""deploy/ as far as it can be checked without Kubernetes or Docker: the RayService's ServeConfig parses, each
pod's memory covers the budgets of the replicas it may hold, a GPU's covers the device budgets, the probes read
/readyz and /healthz, the store's credentials come from a Secret, and the image's CMD names a config it holds."""

import re
from pathlib import Path

import yaml

from serve.config import ServeConfig, load_config, parse_config

DEPLOY = Path(__file__).parent.parent / "deploy"
GIB = 1 << 10  # MiB
GPU_MIB = 80 * GIB
"""The GPU the worker group asks for (an 80 GB H100/A100)."""
BASE_MIB = 16 * GIB
"""The largest base's weights on the device (an 8B model in bf16)."""
PROCESS_MIB = 8 * GIB
"""What a replica's process holds beside its budgets (Python, torch, Ray, a base read from disk)."""


def mib(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Gi|Mi)", quantity).groups()
    return int(number) * (GIB if unit == "Gi" else 1)


def rayservice() -> tuple[dict, ServeConfig]:
    doc = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    app = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]
    return doc, parse_config(app["args"])


def test_each_worker_pod_covers_its_replicas_budgets_and_the_gpu_its_device_budgets():
    doc, config = rayservice()
    d = config.deployment
    host = config.cache.cpu_mib + PROCESS_MIB  # a CUDA replica's host memory: the warm tier and the process
    device = (config.cache.device_mib + config.slots.adapter_mib + config.slots.weights_mib + config.batch.kv_cache_mib
              + BASE_MIB)
    assert config.device == "cuda" and d.num_gpus is None and d.max_replicas_per_node == 1  # a GPU each, as cuda
    (group,) = [g for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "gpu-workers"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == int(group["rayStartParams"]["num-gpus"]) == 1
    assert d.max_replicas_per_node * host <= mib(limits["memory"])
    assert device <= GPU_MIB
    assert float(limits["cpu"]) >= d.num_cpus  # Ray's CPUs for the replica exist in the pod
    assert d.autoscaling.max_replicas <= group["maxReplicas"] * d.max_replicas_per_node  # every replica has a node
    assert doc["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    encoder = config.deployments["minilm"]
    (cpus,) = [g for g in doc["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "cpu-workers"]
    cpu_limits = cpus["template"]["spec"]["containers"][0]["resources"]["limits"]
    on_cpu = (config.cache.cpu_mib + config.cache.device_mib + config.slots.adapter_mib  # every budget is host memory
              + PROCESS_MIB)
    assert encoder.device == "cpu" and "nvidia.com/gpu" not in cpu_limits
    assert encoder.max_replicas_per_node * on_cpu <= mib(cpu_limits["memory"])
    assert encoder.max_replicas_per_node * encoder.num_cpus <= float(cpu_limits["cpu"])
    assert encoder.autoscaling.max_replicas <= cpus["maxReplicas"] * encoder.max_replicas_per_node


def test_probes_read_readiness_and_liveness_and_credentials_come_from_a_secret():
    doc, config = rayservice()
    assert str(config.store).startswith("s3://")
    cluster = doc["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 8000}
    assert head["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 8000}
    containers = [head] + [g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]]
    for c in containers:
        env = {e["name"]: e for e in c["env"]}
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert env[name]["valueFrom"]["secretKeyRef"]["name"] == "manyfold-s3"
        assert env["MANYFOLD_CACHE_DIR"]["value"] == "/cache"
        assert "/cache" in {m["mountPath"] for m in c["volumeMounts"]}


def test_the_images_command_serves_a_config_the_image_holds():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    config_path = re.search(r'CMD \["manyfold", "serve", "--config", "([^"]+)"\]', dockerfile)[1]
    (source,) = re.findall(rf"^COPY (\S+) {re.escape(config_path)}$", dockerfile, flags=re.M)
    config = load_config(Path(__file__).parent.parent / source)
    assert str(config.store).startswith("s3://") and config.host == "0.0.0.0"
