"""deploy/ checked without a cluster: each manifest against KubeRay's CRD schema (v1.7.0, vendored under
deploy/schemas/) and Kubernetes' own schemas (kubernetes-validate), each KubeRay rule the RayService depends on
(the source file and line in each docstring: github.com/ray-project/kuberay at tag v1.7.0, commit 59d663ae), and
the serveConfigV2 validated by Ray and by ServeConfig, then deployed from the manifest's own text onto a local Ray
and answered over HTTP (test_deploy_serve.py would split it out if this file grows)."""

import lzma
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from serve.config import ServeConfig, load_config, parse_config

ROOT = Path(__file__).parent.parent
DEPLOY = ROOT / "deploy"
SCHEMAS = DEPLOY / "schemas"
KUBERNETES = "1.33.0"
"""The oldest Kubernetes KubeRay v1.7.0 is tested on that kubernetes-validate still carries strict schemas for."""
MANIFESTS = ("rayservice.yaml", "secrets.example.yaml", "pdb.yaml", "podmonitor.yaml")
CRDS = {("ray.io/v1", "RayService"): "ray.io_rayservices-v1.7.0.yaml.xz",
        ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitors-v0.93.0.yaml.xz"}
"""CRD YAML as the projects publish it, xz-compressed: kuberay v1.7.0 ray-operator/config/crd/bases/
ray.io_rayservices.yaml (sha256 0a8fc325...907ab), prometheus-operator v0.93.0 example/prometheus-operator-crd/
monitoring.coreos.com_podmonitors.yaml (sha256 45a93443...aee5d)."""
GIB = 1 << 10  # MiB
GPU_MIB = 80 * GIB
"""The GPU the worker group asks for (an 80 GB H100/A100)."""
BASE_MIB = 16 * GIB
"""The largest base's weights on the device (an 8B model in bf16)."""
PROCESS_MIB = 8 * GIB
"""What a replica's process holds beside its budgets (Python, torch, Ray, a base read from disk)."""
S3_MIB_S = 50
"""A conservative read rate of one replica from object storage: an 8B base's first load takes BASE_MIB / this."""
RAY_START_S = 60
"""Ray's own start on a new node (raylet, dashboard agent) before any replica loads."""


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def rayservice() -> tuple[dict, ServeConfig]:
    (doc,) = documents("rayservice.yaml")
    app = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]
    return doc, parse_config({**app["args"], "auth_file": None}, "serveConfigV2")


def cluster() -> dict:
    return rayservice()[0]["spec"]["rayClusterConfig"]


def head() -> dict:
    return cluster()["headGroupSpec"]["template"]["spec"]["containers"][0]


def group(name: str) -> dict:
    (g,) = [g for g in cluster()["workerGroupSpecs"] if g["groupName"] == name]
    return g


def templates() -> dict[str, dict]:
    """Each pod template of the RayService, by group ("head" for the head)."""
    c = cluster()
    return {"head": c["headGroupSpec"]["template"], **{g["groupName"]: g["template"] for g in c["workerGroupSpecs"]}}


def mib(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Gi|Mi)", quantity).groups()
    return int(number) * (GIB if unit == "Gi" else 1)


def strict(schema: dict) -> dict:
    """A CRD's structural schema as the API server applies it with strict field validation (kubectl's default):
    an object with `properties` and neither additionalProperties nor x-kubernetes-preserve-unknown-fields takes no
    other field; int-or-string fields take either."""
    if not isinstance(schema, dict):
        return schema
    out = {k: ({p: strict(s) for p, s in v.items()} if k == "properties" else
               [strict(s) for s in v] if isinstance(v, list) else strict(v)) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    return out


def crd_schema(api_version: str, kind: str) -> dict:
    crd = yaml.safe_load(lzma.decompress((SCHEMAS / CRDS[api_version, kind]).read_bytes()))
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if f"{crd['spec']['group']}/{v['name']}" == api_version]
    return strict(version["schema"]["openAPIV3Schema"])


def probe_window_s(probe: dict) -> int:
    """How long a probe may fail before the kubelet acts: the initial delay and failureThreshold periods."""
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def test_every_custom_resource_matches_its_crd_schema():
    """KubeRay's RayService CRD (v1.7.0) and prometheus-operator's PodMonitor CRD (v0.93.0), as the API server
    checks them on `kubectl apply`: a misspelt or misplaced field fails here, not in the cluster."""
    checked = 0
    for name in MANIFESTS:
        for doc in documents(name):
            if (doc["apiVersion"], doc["kind"]) in CRDS:
                errors = [f"{name}: {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in
                          jsonschema.Draft7Validator(crd_schema(doc["apiVersion"], doc["kind"])).iter_errors(doc)]
                assert errors == []
                checked += 1
    assert checked == 2
    broken = rayservice()[0]
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}  # the schema does catch a typo
    assert any("rayStartParam" in e.message for e in
               jsonschema.Draft7Validator(crd_schema("ray.io/v1", "RayService")).iter_errors(broken))


def test_every_manifest_and_pod_template_matches_kubernetes_schemas():
    """Kubernetes' own schemas (kubernetes-validate, strict: unknown fields are errors) for the built-in kinds, and
    for each pod template inside the RayService, checked as the PodTemplate it becomes."""
    for name in MANIFESTS:
        for doc in documents(name):
            if (doc["apiVersion"], doc["kind"]) not in CRDS:
                kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    for group_name, template in templates().items():
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group_name},
                                      "template": template}, KUBERNETES, strict=True)


def test_kuberay_accepts_the_spec():
    """KubeRay's own checks before it creates anything (ray-operator/controllers/ray/utils/validation.go):
    the name a DNS-1035 label of at most 47 characters (632-638; constant.go:375-378), each group's resources in
    rayStartParams or `resources` but not both (60-69), every group with a container and minReplicas <= replicas
    <= maxReplicas (103-140), and the Ray container first, since KubeRay reads Containers[RayContainerIndex]
    (constant.go:51)."""
    doc, _ = rayservice()
    name = doc["metadata"]["name"]
    assert len(name) <= 53 - 6 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
    c = cluster()
    assert "resources" not in c["headGroupSpec"] and head()["name"] == "ray-head"
    for g in c["workerGroupSpecs"]:
        assert "resources" not in g and g["template"]["spec"]["containers"][0]["name"] == "ray-worker"
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]


def test_the_head_names_the_dashboard_port_kuberay_submits_the_serve_config_to():
    """When the head container lists any ports, KubeRay's head Service has exactly those (common/service.go:403-417,
    getServicePorts: the defaults only when none are given), and the RayService controller reaches the dashboard
    through the head Service's port named "dashboard" (rayservice_controller.go:2014 -> utils/util.go:1022-1044,
    "dashboard port is not found" otherwise; constant.go:107,114). The Serve Service is built from the ports named
    "serve" (common/service.go:216-223, constant.go:110,116)."""
    ports = {p["name"]: p["containerPort"] for p in head()["ports"]}
    assert ports["dashboard"] == 8265 and ports["serve"] == 8000 and ports["gcs-server"] == 6379
    serve_config = yaml.safe_load(rayservice()[0]["spec"]["serveConfigV2"])
    assert serve_config["http_options"]["port"] == ports["serve"]
    for name in ("gpu-workers", "cpu-workers"):
        (serve_port,) = group(name)["template"]["spec"]["containers"][0]["ports"]
        assert serve_port == {"containerPort": 8000, "name": "serve"}


def test_the_heads_readiness_is_rays_own_health_so_the_serve_config_can_be_submitted():
    """The RayService controller submits serveConfigV2 only once the head Pod is ready
    (rayservice_controller.go:1995-2007), and nothing listens on the serve port before that: a head readiness on
    /readyz at 8000 never passes. So the head's probes are Ray's own node health, what KubeRay injects for Ray
    >= 2.53 (common/pod.go:721-730 and 744-750: GET /api/healthz on the dashboard agent's port,
    constant.go:109,344); whether the head's proxy serves is KubeRay's ray.io/serve label, not a probe
    (common/pod.go:834-843, rayservice_controller.go:2092)."""
    doc, _ = rayservice()
    assert tuple(map(int, doc["spec"]["rayClusterConfig"]["rayVersion"].split("."))) >= (2, 53, 0)
    for kind in ("readinessProbe", "livenessProbe"):
        assert head()[kind]["httpGet"] == {"path": "/api/healthz", "port": 52365}
    assert "startupProbe" not in head()  # the head loads no base (num-cpus 0)
    assert cluster()["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


def test_worker_readiness_is_the_serve_proxy_the_serve_service_routes_through():
    """KubeRay's rule for RayService workers (common/pod.go:816-827): ready while this node's Serve proxy answers
    /-/healthz on the serve port (constant.go:337), failing at once (ServeReadinessProbeFailureThreshold = 1,
    constant.go:313), so the Serve Service (common/service.go:200-205: pods labelled ray.io/serve=true, which
    workers always are, common/pod.go:838-840) routes only through proxies that route. Written out, since a probe
    given is a probe KubeRay does not inject (common/pod.go:795), and as an HTTP check: KubeRay's injected one
    shells out to wget (constant.go:340), which the images do not carry."""
    for name in ("gpu-workers", "cpu-workers"):
        c = group(name)["template"]["spec"]["containers"][0]
        assert c["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": 8000}
        assert c["readinessProbe"]["failureThreshold"] == 1


def test_liveness_lets_a_new_node_load_a_base():
    """Liveness is Ray's own node health (common/pod.go:775-792), never the serve port, which answers only once
    replicas run. A new worker's first minutes are its first base load (an 8B bf16 base read at S3_MIB_S and
    decoded) while its CPUs and disk are saturated: its startupProbe holds liveness off at least that long, and
    liveness itself then tolerates as long a stall as KubeRay's defaults (constant.go:316-322: 30 s + 120 x 5 s)."""
    load_s = RAY_START_S + BASE_MIB / S3_MIB_S
    kuberay_default_s = 30 + 5 * 120
    for name in ("gpu-workers", "cpu-workers"):
        c = group(name)["template"]["spec"]["containers"][0]
        assert c["startupProbe"]["httpGet"] == c["livenessProbe"]["httpGet"] == {"path": "/api/healthz", "port": 52365}
        assert probe_window_s(c["startupProbe"]) >= load_s
        assert probe_window_s(c["livenessProbe"]) >= kuberay_default_s - 30
    assert probe_window_s(head()["livenessProbe"]) >= kuberay_default_s


def test_the_gpu_group_asks_for_gpus_tolerates_their_taint_and_selects_gpu_nodes():
    """Bases run with device cuda and a GPU each (serve/app.py replica_gpus): the group's pods ask for
    nvidia.com/gpu, tolerate the NoSchedule taint GPU node pools carry, and land only on GPU nodes."""
    g = group("gpu-workers")
    spec = g["template"]["spec"]
    limits = spec["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == int(g["rayStartParams"]["num-gpus"]) == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    cpu = group("cpu-workers")["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu["containers"][0]["resources"]["limits"] and "tolerations" not in cpu


def test_each_worker_pod_covers_its_replicas_budgets_and_the_gpu_its_device_budgets():
    _, config = rayservice()
    d = config.deployment
    host = config.cache.cpu_mib + PROCESS_MIB  # a CUDA replica's host memory: the warm tier and the process
    device = (config.cache.device_mib + config.slots.adapter_mib + config.slots.weights_mib + config.batch.kv_cache_mib
              + BASE_MIB)
    assert config.device == "cuda" and d.num_gpus is None and d.max_replicas_per_node == 1  # a GPU each, as cuda
    gpus = group("gpu-workers")
    limits = gpus["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert d.max_replicas_per_node * host <= mib(limits["memory"])
    assert device <= GPU_MIB
    assert float(limits["cpu"]) >= d.num_cpus  # Ray's CPUs for the replica exist in the pod
    assert d.autoscaling.max_replicas <= gpus["maxReplicas"] * d.max_replicas_per_node  # every replica has a node
    assert cluster()["enableInTreeAutoscaling"] is True
    encoder = config.deployments["minilm"]
    cpus = group("cpu-workers")
    cpu_limits = cpus["template"]["spec"]["containers"][0]["resources"]["limits"]
    on_cpu = config.cache.cpu_mib + config.cache.device_mib + config.slots.adapter_mib + PROCESS_MIB
    assert encoder.device == "cpu"
    assert encoder.max_replicas_per_node * on_cpu <= mib(cpu_limits["memory"])
    assert encoder.max_replicas_per_node * encoder.num_cpus <= float(cpu_limits["cpu"])
    assert encoder.autoscaling.max_replicas <= cpus["maxReplicas"] * encoder.max_replicas_per_node


def test_the_node_cache_is_node_local_and_larger_than_manyfold_cache_mib():
    """Workers keep fetched store objects on a hostPath directory (one per node, kept across pods) on nodes
    labelled as holding more than the cache needs; the head, which reads manifests only, on a bounded emptyDir.
    MANYFOLD_CACHE_MIB stays under either size, so the cache evicts before the kubelet or the disk would."""
    for name, template in templates().items():
        spec = template["spec"]
        c = spec["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == env["MANYFOLD_CACHE_DIR"]]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        if name == "head":
            size_mib = mib(volume["emptyDir"]["sizeLimit"])
        else:
            assert volume["hostPath"]["type"] == "DirectoryOrCreate"
            (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                "nodeSelectorTerms"]
            (rule,) = [r for r in term["matchExpressions"] if r["key"] == "manyfold.io/cache-gib"]
            assert rule["operator"] == "Gt"
            size_mib = (int(rule["values"][0]) + 1) * GIB
            (owner,) = spec["initContainers"]  # hostPath is created root-owned; the server runs as uid 1000
            assert owner["command"] == ["chown", "1000:1000", mount["mountPath"]]
        assert int(env["MANYFOLD_CACHE_MIB"]) < size_mib
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 1000


def test_s3_credentials_come_from_a_secret():
    """Every pod reads the store (the head its manifest, workers its objects): each takes the AWS variables obstore
    reads from the Secret manyfold-s3, optional so that pod identity (IRSA, Workload Identity) can stand in."""
    secret = {d["metadata"]["name"]: d for d in documents("secrets.example.yaml")}["manyfold-s3"]
    assert str(rayservice()[1].store).startswith("s3://")
    for template in templates().values():
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        for name, key in (("AWS_ACCESS_KEY_ID", "access-key-id"), ("AWS_SECRET_ACCESS_KEY", "secret-access-key")):
            assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "manyfold-s3", "key": key, "optional": True}
            assert key in secret["stringData"]
    assert "AKIA" not in (DEPLOY / "rayservice.yaml").read_text()
    assert "serviceAccountName" in (DEPLOY / "README.md").read_text()  # pod identity, documented


def test_tenants_and_the_admin_key_come_from_a_secret(tmp_path):
    """serveConfigV2 names an auth_file that every pod mounts from the Secret manyfold-auth (the build task that
    parses the config may run on any node); the example Secret's file parses into tenants and admin keys."""
    doc, _ = rayservice()
    args = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"][0]["args"]
    path = Path(args["auth_file"])
    assert "tenants" not in args and "admin_key_sha256" not in args
    for template in templates().values():
        spec = template["spec"]
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == str(path.parent)]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == "manyfold-auth" and mount["readOnly"] is True
        assert volume["secret"]["items"] == [{"key": path.name, "path": path.name}]
    secret = {d["metadata"]["name"]: d for d in documents("secrets.example.yaml")}["manyfold-auth"]
    (tmp_path / path.name).write_text(secret["stringData"][path.name])
    config = parse_config({**args, "auth_file": str(tmp_path / path.name)})
    assert [t.name for t in config.tenants] == ["team-a"] and len(config.admin_key_sha256) == 1


def test_each_worker_group_has_a_pod_disruption_budget():
    """A drain evicts one worker of a group at a time; each budget selects exactly its group's pods."""
    budgets = documents("pdb.yaml")
    labels = {name: t["metadata"]["labels"] for name, t in templates().items()}
    for name in ("gpu-workers", "cpu-workers"):
        (budget,) = [b for b in budgets if b["spec"]["selector"]["matchLabels"].items() <= labels[name].items()]
        assert budget["spec"]["maxUnavailable"] == 1
    assert not any(b["spec"]["selector"]["matchLabels"].items() <= labels["head"].items() for b in budgets)


def test_prometheus_scrapes_metrics_on_the_heads_serve_port():
    """One PodMonitor target: the head's `serve` port, /metrics (every ingress's counters added up by the one
    that answers), selected by the head template's labels alone."""
    (monitor,) = documents("podmonitor.yaml")
    labels = {name: t["metadata"]["labels"] for name, t in templates().items()}
    selected = [n for n, lab in labels.items() if monitor["spec"]["selector"]["matchLabels"].items() <= lab.items()]
    assert selected == ["head"]
    ports = {p["name"]: p["containerPort"] for p in head()["ports"]}
    endpoints = {e["port"]: e["path"] for e in monitor["spec"]["podMetricsEndpoints"]}
    assert endpoints["serve"] == "/metrics" and ports["serve"] == 8000 and "metrics" in ports


def dockerfile(image: str) -> str:
    return (DEPLOY / ("Dockerfile" if image == "cpu" else "Dockerfile.cuda")).read_text()


def test_images_are_pinned_non_root_without_demo_data_and_the_cuda_one_has_a_compiler():
    """A base image named by patch release, a numeric non-root USER (runAsNonRoot can check it), none of the
    demo's model or data packages (Makefile DATA_PACKAGES), and gcc in the CUDA image: Triton builds its launcher
    with a C compiler at a kernel's first launch."""
    data = re.search(r"^DATA_PACKAGES := (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)[1].split()
    for image in ("cpu", "cuda"):
        text = dockerfile(image)
        assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?",
                            re.search(r"^FROM (\S+)$", text, re.MULTILINE)[1])
        assert re.findall(r"^USER (\S+)$", text, re.MULTILINE) == ["1000"]
        assert not any(p.split("==")[0] in text for p in data)
    assert re.search(r"apt-get install [^\n]*\bgcc\b", dockerfile("cuda"))
    assert "download.pytorch.org/whl/cpu torch==2.13.0" in dockerfile("cpu")


def test_manifests_name_the_images_an_operator_pushes():
    """Every image in the RayService is the placeholder deploy/README.md's sed replaces, tagged with the project's
    version and the device its group runs on (the GPU group the CUDA image, the head and CPU group the CPU one)."""
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)[1]
    for name, template in templates().items():
        spec = template["spec"]
        device = "cuda" if name == "gpu-workers" else "cpu"
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["image"] == f"registry.example.com/manyfold:{version}-{device}"
    readme = (DEPLOY / "README.md").read_text()
    assert "sed -i \"s#registry.example.com/manyfold#$REGISTRY/manyfold#\" deploy/rayservice.yaml" in readme
    for image in ("cpu", "cuda"):
        assert f"docker push $REGISTRY/manyfold:{version}-{image}" in readme


def test_the_images_command_serves_a_config_the_image_holds():
    for image in ("cpu", "cuda"):
        text = dockerfile(image)
        config_path = re.search(r'CMD \["manyfold", "serve", "--config", "([^"]+)"\]', text)[1]
        (source,) = re.findall(rf"^COPY (\S+) {re.escape(config_path)}$", text, flags=re.MULTILINE)
        config = load_config(ROOT / source)
        assert str(config.store).startswith("s3://") and config.host == "0.0.0.0"


def test_the_readme_applies_every_manifest_it_ships():
    """deploy/README.md's apply steps name every manifest (the Secrets from the command line instead)."""
    readme = (DEPLOY / "README.md").read_text()
    applied = set(re.findall(r"kubectl apply[^\n]* -f deploy/(\S+\.yaml)", readme))
    assert applied == set(MANIFESTS) - {"secrets.example.yaml"}
    assert "kubectl create secret generic manyfold-auth --from-file=auth.yaml" in readme


def test_serve_config_v2_passes_rays_schema_and_serve_config():
    """The text KubeRay submits: Ray's own ServeDeploySchema (what the dashboard's PUT /api/serve/applications/
    parses) and Manyfold's ServeConfig, which build_app parses from the application's args."""
    from ray.serve.schema import ServeDeploySchema

    text = rayservice()[0]["spec"]["serveConfigV2"]
    schema = ServeDeploySchema.parse_obj(yaml.safe_load(text))
    (app,) = schema.applications
    assert app.import_path == "serve.app:build_app" and app.route_prefix == "/"
    assert rayservice()[1].deployments["minilm"].device == "cpu"


KEY, ADMIN = "sk-deploy-tenant", "sk-deploy-admin"


def local_serve_config(text: str, store: Path, auth: Path, port: int) -> dict:
    """serveConfigV2 as this machine runs it: every field from the manifest's text but the few that name the
    cluster (the store, the auth file's path, the bind address, CUDA, the CPUs and memory of its pods: the KV
    cache a GPU's pod holds, 16 GiB, is allocated when a replica starts; and an ingress for each of its pods: this
    machine is one node)."""
    config = yaml.safe_load(text)
    config["http_options"].update(host="127.0.0.1", port=port)
    args = config["applications"][0]["args"]
    args.update(store=str(store), auth_file=str(auth), device="cpu")
    args["deployment"]["num_cpus"] = 0.25
    args["deployments"]["minilm"]["num_cpus"] = 0.25
    args["batch"]["kv_cache_mib"] = 64
    args["ingress_replicas"] = 1
    return config


@pytest.fixture(scope="module")
def deployed(serving_store, tmp_path_factory):
    """The RayService's serveConfigV2 deployed as KubeRay deploys it (the controller's apply_config, which the
    dashboard's PUT calls) onto a local Ray, with the example Secret's auth file rewritten for test keys."""
    import serve.deployments  # noqa: F401  (loopback env before ray)
    import ray
    from ray import serve
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    from loadtests.generator import free_port
    from serve.config import key_digest

    store, _ = serving_store
    auth = tmp_path_factory.mktemp("deploy") / "auth.yaml"
    auth.write_text(yaml.safe_dump({"tenants": [{"name": "team-a", "key_sha256": [key_digest(KEY)]}],
                                    "admin_key_sha256": [key_digest(ADMIN)]}))
    config = local_serve_config(rayservice()[0]["spec"]["serveConfigV2"], store, auth, free_port())
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        client = serve_start(http_options=config["http_options"])
        client.deploy_apps(ServeDeploySchema.parse_obj(config))
        yield f"http://127.0.0.1:{config['http_options']['port']}"
    finally:
        serve.shutdown()
        ray.shutdown()


def ready(url: str) -> bool:
    """/readyz answered 200. Not yet when the proxy is not listening, or when it is but the app's replica, still
    starting on a loaded machine, lets the probe time out (a CI run read that as a failure)."""
    import httpx

    try:
        return httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow
@pytest.mark.ray
def test_serve_config_v2_deployed_from_the_manifest_answers_over_http(deployed):
    import time

    import httpx

    deadline = time.monotonic() + 600  # a bound against a hang, not a speed: a loaded 2-core machine took over 180 s
    while not ready(deployed):
        assert time.monotonic() < deadline, "serveConfigV2 from the manifest did not become ready in 600 s"
        time.sleep(1)
    body = {"model": "tiny-lm", "prompt": "one two", "max_tokens": 3}
    refused = httpx.post(f"{deployed}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 401  # tenants from the auth file
    answer = httpx.post(f"{deployed}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                        timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0  # (text may decode empty)
    metrics = httpx.get(f"{deployed}/metrics", timeout=60)  # its board reads alone may take 3 x 2 s, past httpx's 5
    assert metrics.status_code == 200 and "# TYPE" in metrics.text
