import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if not os.path.exists("/dev/nvidiactl"):
    # Triton's interpreter is chosen when kernels/ is first imported, which any engine test may do before
    # tests/kernels runs; serving itself stays on the torch twins on CPU tensors whatever this says.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that start Ray (a test marked `ray`) go first: `make test` runs modules whole on two xdist
    workers (`-n 2 --dist loadfile`), and these are the longest, most of their time spent waiting on Ray rather than
    on the cores, so the other worker's modules fill that time instead of trailing after."""
    ray = {item.module.__name__ for item in items if item.get_closest_marker("ray")}
    items.sort(key=lambda item: item.module.__name__ not in ray)


@pytest.fixture
def rng() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def tiny_state(gen: torch.Generator, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A tiny 2-layer model's tensors: what a base looks like to the codec."""
    out = {"embed.weight": torch.randn(50, 8, generator=gen) * 0.02}
    for i in range(2):
        out[f"layers.{i}.attn.weight"] = torch.randn(24, 8, generator=gen) * 0.05
        out[f"layers.{i}.mlp.weight"] = torch.randn(32, 8, generator=gen) * 0.05
        out[f"layers.{i}.norm.weight"] = torch.ones(8)
    return {k: v.to(dtype) for k, v in out.items()}


def finetune_of(base: dict[str, torch.Tensor], gen: torch.Generator, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    """A plausible fine-tune: small dense updates, one frozen tensor, a new head."""
    out = {}
    for k, v in base.items():
        if k == "layers.0.norm.weight":
            out[k] = v.clone()
        else:
            out[k] = (v.float() + torch.randn(v.shape, generator=gen) * scale).to(v.dtype)
    out["head.weight"] = torch.randn(3, 8, generator=gen).to(next(iter(base.values())).dtype)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and a.contiguous().reshape(-1).view(torch.uint8).equal(b.contiguous().reshape(-1).view(torch.uint8)))


@pytest.fixture(scope="session")
def serving_store(tmp_path_factory):
    """A store with two bases (a tiny Llama, the real MiniLM) and full variants of each, plus the
    fine-tune directories they were made from (the references served outputs must equal)."""
    from serve.data.models import minilm_dir
    from serve.store.store import Store
    from serve.variants.full import add_full_variant
    from tests.models import write_perturbed, write_tiny_causal

    root = tmp_path_factory.mktemp("serving")
    store = Store(root / "store", create=True)
    lm = write_tiny_causal(root / "tiny-lm")
    store.add_base("tiny-lm", lm)
    store.add_base("minilm", minilm_dir())
    refs = {
        "tiny-lm": lm,
        "minilm": minilm_dir(),
        "tiny-lm-top": write_perturbed(lm, root / "tiny-lm-top", seed=1, scale=0.5, only="layers.1."),
        "tiny-lm-all": write_perturbed(lm, root / "tiny-lm-all", seed=2, scale=0.5),
        "minilm-clf": write_perturbed(minilm_dir(), root / "minilm-clf", seed=3, labels=["neg", "pos", "other"]),
    }
    for name in ("tiny-lm-top", "tiny-lm-all"):
        add_full_variant(store, name, "tiny-lm", refs[name])
    add_full_variant(store, "minilm-clf", "minilm", refs["minilm-clf"])
    return store.root, refs


@pytest.fixture(scope="session")
def demo_store(tmp_path_factory, worker_id):
    """tests/demo_store.py's store, built once a run: under pytest-xdist in the run's directory that every worker
    shares, the first worker to need it building it and the others waiting on a file lock (xdist's own recipe for a
    session fixture run once); test_demo and test_demo_serve, on two workers, had each built it (37 s). Nothing
    writes to it after. -> its root."""
    from filelock import FileLock

    from tests.demo_store import build_small_demo_store

    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent
    root = shared / "demo" / "store"
    with FileLock(shared / "demo.lock"):
        build_small_demo_store(root)  # a store built already is found whole: nothing written
    return root


@pytest.fixture(scope="session")
def s3_server():
    """An S3-compatible server on loopback (moto's server mode, as s3fs's own tests run one), its endpoint and
    credentials in the environment as a platform sets them. -> its URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    url = f"http://{host}:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                             "AWS_REGION")}
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="manyfold-test", AWS_SECRET_ACCESS_KEY="manyfold-test",
                      AWS_REGION="us-east-1")
    try:
        yield url
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_server, request) -> str:
    """A new, empty bucket on the loopback S3 server. -> s3://BUCKET."""
    import uuid

    import boto3

    name = f"manyfold-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return f"s3://{name}"
