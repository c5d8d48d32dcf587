"""The one GPU check: what a lent GPU session runs, as one call that ends within 8 minutes on a cold machine and
writes its JSON whatever finishes.

A lent session has 15 minutes of device time in all, its machine's cold start included, on an image that holds
torch and Triton but not every package Manyfold imports (DEVICE_IMAGE): those travel as wheels (WHEELS). Here,
once, in the repository's root:

    echo /.whl/ >> .git/info/exclude
    manyfold bench gpu-check --download .whl

Then one device call, carrying .whl:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && python3 -m serve.bench.gpu_check --out $OUT

Its phases, in order, each bounded and each written to OUT/gpu-check.json as it ends (a phase that would not end
within the budget left is skipped, and says so):
  imports       every module the run needs imports, on CUDA; the versions the image gives
  cuda_tests    pytest of the kernels (every Triton kernel against its twin) and tests/engine/test_cuda.py (every
                kind's graphed step, prompt chunks included, against eager)
  paged_decode  decode attention at 64 rows of the 1B shape over block tables of 16 against one block a row (the
                slot layout: each row's keys in one place), the same kernel; goal within 1.1x
  engine_steps  `bench engine`'s decode steps on the 1B shape at 64 rows: base, LoRA, mixed and the four-kind step
                (issue 47's goal: 4 ms), its floor, and the steps' graph counts
  logprobs      `bench logprobs` on CUDA: every kind's log probabilities against transformers in fp32
`manyfold bench gpu-check` with no GPU runs the CPU half, which `make test` runs too: the imports as the device's
image would satisfy them (DEVICE_IMAGE and WHEELS alone; anything else refused), and the phases on tiny shapes
with the torch twins, so an import error or a broken phase shows here rather than in a lent session.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

PYTHON = "3.12"
"""The device image's Python."""
WHEELS = ("pydantic==2.14.3", "pydantic-core==2.50.4", "annotated-types==0.8.0", "typing-inspection==0.4.5",
          "obstore==0.12.1", "zstandard==0.25.0", "xgrammar==0.2.8", "apache-tvm-ffi==0.1.15.post2",
          "transformers==5.23.0", "regex==2026.11.19")
"""What the run imports that the image lacks, or holds at another version than this project pins (transformers;
regex, which transformers 5.23 checks at import): about 30 MB."""
DEVICE_IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())
"""The Python packages of the lent machines' image ('cuda'), as the device tool's notes list them (read
2026-11-17)."""
MODULES = ("serve.bench.gpu_check", "serve.bench.engine", "serve.bench.logprobs_check", "serve.engine.engine",
           "tests.engine.test_cuda", "tests.kernels.conftest")
"""What the run imports (its phases', and pytest's of the tests it runs)."""
CUDA_TESTS = ("tests/kernels", "tests/engine/test_cuda.py")
PHASES = ("imports", "cuda_tests", "paged_decode", "engine_steps", "logprobs")
ESTIMATE_S = {"imports": 30, "cuda_tests": 150, "paged_decode": 20, "engine_steps": 150, "logprobs": 90}
"""What each phase is planned to take on a lent machine (its Triton compiles included): a phase starts only
while the budget left holds it."""


def normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def allowed() -> set[str]:
    return set(DEVICE_IMAGE) | {normalized(w.split("==")[0]) for w in WHEELS} | {"manyfold"}


IMAGE_IMPORTS = """
import importlib.abc, importlib.metadata as md, sys
allowed = set(sys.argv[1].split(","))
owners = md.packages_distributions()
norm = lambda n: n.lower().replace("_", "-").replace(".", "-")

OURS = ("serve", "kernels", "tests", "loadtests")

def importer():  # the top-level package of the module whose import statement runs (past importlib's frames)
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen_importlib")):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "").split(".")[0] if frame is not None else ""

class Image(importlib.abc.MetaPathFinder):
    # refuses what this project's own modules import from a package the image lacks and no wheel brings (what a
    # package imports for itself depends on its version there, which this machine does not have)
    def find_spec(self, name, path=None, target=None):
        dists = owners.get(name.split(".")[0])
        if dists and not any(norm(d) in allowed for d in dists) and importer() in OURS:
            raise ModuleNotFoundError(f"No module named '{name}' (not on the device's image nor in WHEELS)", name=name)
        return None

sys.meta_path.insert(0, Image())
failed = []
for module in sys.argv[2].split(","):
    try:
        __import__(module)
    except Exception as e:
        failed.append(f"{module}: {type(e).__name__}: {e}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def image_imports() -> list[str]:
    """The run's modules imported in a fresh interpreter that refuses what they import from a package outside
    DEVICE_IMAGE and WHEELS, as the lent machine would; -> what failed, one line each (an optional import that its
    importer guards is no failure, as on the machine)."""
    out = subprocess.run([sys.executable, "-c", IMAGE_IMPORTS, ",".join(sorted(allowed())), ",".join(MODULES)],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=300)
    return [line for line in out.stdout.splitlines() if line] or ([out.stderr.strip()[-500:]] if out.returncode else [])


def download(out: Path) -> None:
    """WHEELS for the device image's Python, into `out` (pip download, binary only)."""
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                                              "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    f"--python-version={PYTHON}", "--implementation=cp", *platforms, "-d", str(out), *WHEELS],
                   check=True)
    wheels = list(out.glob("*.whl"))
    print(f"{len(wheels)} wheels in {out}, {sum(f.stat().st_size for f in wheels) >> 20} MiB")


def paged_decode(device: torch.device, rows: int, context: int, heads: int, kv_heads: int, dim: int,
                 repeats: int) -> dict:
    """decode_attention at `rows` rows of `context` keys: blocks of 16 scattered over the cache, against one block
    of the whole context a row (the slot layout), the same kernel; median ms of `repeats` launches each."""
    from kernels import decode_attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.randn(rows, heads, dim, device=device, dtype=dtype)
    lengths = torch.full((rows,), context, device=device)
    out = {}
    for name, block in (("blocks_16", 16), ("one_block_a_row", context)):
        width = context // block
        k = torch.randn(rows * width + 1, block, kv_heads, dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        g = torch.Generator().manual_seed(0)
        tables = torch.randperm(rows * width, generator=g).view(rows, width).to(device)
        decode_attention(q, k, v, tables, lengths, dim ** -0.5, context)  # compiles
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                decode_attention(q, k, v, tables, lengths, dim ** -0.5, context)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                decode_attention(q, k, v, tables, lengths, dim ** -0.5, context)
                times.append(1e3 * (time.perf_counter() - t))
        out[f"{name}_ms"] = sorted(times)[len(times) // 2]
    out["blocks_over_one_block"] = out["blocks_16_ms"] / out["one_block_a_row_ms"]
    return {"rows": rows, "context": context, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, **out}


def cuda_tests(budget_s: float, out: Path) -> dict:
    """pytest of the kernels and the CUDA engine tests, bounded; -> the summary line and the exit status. Its whole
    output, the engine's logged errors with their tracebacks included, goes to OUT/cuda-tests.txt: a failure's
    first cause is seldom in the tail (a failure seen once on an H200 showed only its last exception)."""
    log = out / "cuda-tests.txt"
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "log_cli=true",
                              "--log-cli-level=ERROR", *CUDA_TESTS], capture_output=True, text=True,
                             timeout=budget_s, cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        log.write_text(text)
        return {"status": "timed out", "tail": text[-2000:]}
    log.write_text(run.stdout + run.stderr)
    lines = run.stdout.strip().splitlines()
    return {"returncode": run.returncode, "summary": lines[-1] if lines else "",
            "failures": [line for line in lines if line.startswith(("FAILED ", "ERROR tests/"))][:20],
            "tail": "" if run.returncode == 0 else (run.stdout + run.stderr)[-3000:]}


def engine_steps(device: torch.device, work: Path, repeats: int) -> list[dict]:
    from serve.bench.engine import bandwidth_of, bench_steps
    from serve.bench.engine_models import build_model_dir

    shape = "llama-3.2-1b" if device.type == "cuda" else "tiny"
    model_dir = build_model_dir(shape, work / shape, device)
    return bench_steps(model_dir, device, 512 if device.type == "cuda" else 16, repeats, bandwidth_of(device),
                       rows_list=(64,) if device.type == "cuda" else (4,), neuzip=False)


def logprobs(device: torch.device, work: Path, out: Path) -> dict:
    from serve.bench.logprobs_check import run_logprobs_check

    cuda = device.type == "cuda"
    return run_logprobs_check(out / "logprobs.json", work / "logprobs", str(device), "smollm2-135m" if cuda else "tiny",
                              rows=4 if cuda else 1, new_tokens=16 if cuda else 2)


def run(out: Path, work: Path, budget_s: float, device: torch.device) -> dict:
    """Every phase that fits the budget, in order; the report rewritten after each."""
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": str(device), "budget_s": budget_s, "phases": {}}
    cpu = device.type == "cpu"

    def left() -> float:
        return budget_s - (time.perf_counter() - started)

    phases = {
        "imports": lambda: {"torch": torch.__version__, "cuda": torch.version.cuda,
                            "gpu": torch.cuda.get_device_name(device) if not cpu else None,
                            "modules": [m for m in MODULES if __import__(m) is not None]},
        "cuda_tests": lambda: cuda_tests(max(30.0, left() - sum(ESTIMATE_S[p] for p in PHASES[2:])), out),
        "paged_decode": lambda: paged_decode(device, *((64, 1024, 32, 8, 64, 50) if not cpu else (4, 64, 4, 2, 16, 3))),
        "engine_steps": lambda: engine_steps(device, work, 11 if not cpu else 2),
        "logprobs": lambda: logprobs(device, work, out),
    }
    for name in PHASES:
        if cpu and name == "cuda_tests":
            report["phases"][name] = {"skipped": "no GPU: the CPU half runs these tests' CPU forms in make test"}
            continue
        if left() < ESTIMATE_S[name] and not cpu:
            report["phases"][name] = {"skipped": f"{left():.0f} s of the budget left, {ESTIMATE_S[name]} planned"}
            continue
        t = time.perf_counter()
        try:
            result = {"result": phases[name]()}
        except Exception as e:  # a phase that breaks is reported; the next ones still run
            result = {"error": f"{type(e).__name__}: {e}"}
        report["phases"][name] = {**result, "seconds": round(time.perf_counter() - t, 1)}
        report["seconds"] = round(time.perf_counter() - started, 1)
        (out / "gpu-check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"[gpu-check] {name}: {json.dumps(report['phases'][name], default=str)[:400]}", flush=True)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(prog="python3 -m serve.bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "bench-results/gpu-check"))
    p.add_argument("--work", default="/tmp/gpu-check", help="models and stores it builds")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for every phase together")
    p.add_argument("--download", metavar="DIR", help="only fetch WHEELS into DIR (here, before a session)")
    args = p.parse_args(argv)
    if args.download:
        download(Path(args.download))
        return None
    return run(Path(args.out), Path(args.work), args.budget_s,
               torch.device("cuda" if torch.cuda.is_available() else "cpu"))


if __name__ == "__main__":
    main()
