"""The tenants scenario's adapters: a few LoRA adapters of SmolLM2 really trained with PEFT, and N per-tenant
adapters derived from them by small seeded Gaussian perturbations, written as PEFT adapter directories and
registered into a store of their own with one `manyfold store add --from-dir` (cached in
MANYFOLD_HOME/tenants/<workload>-n<N>/, with what the build measured in built.json).

Throughput does not depend on what an adapter learned, only on its shapes; the perturbation only makes every
tenant's weights differ, so no system can share one tenant's tensors with another's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from serve.data.cache import home

BASE = "smollm2"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BUILT = "built.json"
CORPUS = "bbc-news"
"""What the trained adapters learn: BBC News articles (packaged), next-token prediction on each article's first
max_length tokens, so that the end-of-text token is never learned. The API has no ignore_eos, and adapters that
learned to stop (fortunes, headlines, spam answers: tried first) ended most requests after 0-10 tokens instead of
the 16-64 asked; these run to max_tokens."""


@dataclass(frozen=True)
class Workload:
    name: str
    targets: tuple[str, ...]
    ranks: tuple[int, ...]
    """Tenant i gets ranks[i % len(ranks)]: the ranks in equal shares."""
    max_tenants: int
    """The largest N this workload is measured at (S-LoRA's S2 stops at 100 too)."""


WORKLOADS = {
    "S1": Workload("S1", ("q_proj", "v_proj"), (8, 16), 2000),
    "S2": Workload("S2", ("q_proj", "k_proj", "v_proj", "o_proj"), (64, 32, 16, 8), 100),
}


@dataclass(frozen=True)
class TrainSpec:
    steps: int = 24
    lr: float = 1e-3
    batch_size: int = 4
    max_length: int = 64
    examples: int = 256


def tenant_name(workload: Workload, i: int) -> str:
    return f"{workload.name.lower()}-t{i:04d}-r{tenant_rank(workload, i)}"


def tenant_rank(workload: Workload, i: int) -> int:
    return workload.ranks[i % len(workload.ranks)]


def tenant_seed(workload: Workload, i: int, seed: int = 0) -> int:
    """A per-tenant seed fixed by the workload, the tenant's index and the run's seed."""
    return zlib.crc32(f"{workload.name}/{i}/{seed}".encode())


def train_source(base_dir: Path, workload: Workload, rank: int, out: Path, spec: TrainSpec = TrainSpec(),
                 log: Callable[[str], None] = print) -> Path:
    """One really trained adapter of the workload's targets at `rank` (cached: an existing one is reused)."""
    if (out / ADAPTER_WEIGHTS).is_file():
        return out
    from serve.adapters.data import TextExample
    from serve.adapters.train import train_adapter
    from serve.data.datasets import bbc_topics

    log(f"training {workload.name} rank {rank} on {', '.join(workload.targets)}: {spec.steps} steps of {CORPUS}")
    examples = [TextExample(text=e.text) for e in bbc_topics("train").examples[:spec.examples]]
    result = train_adapter(base_dir, examples, out, init="lora", rank=rank, steps=spec.steps, lr=spec.lr,
                           batch_size=spec.batch_size, max_length=spec.max_length, seed=rank,
                           target_modules=list(workload.targets), progress=lambda step, loss: None)
    log(f"  loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} in {result.train_seconds:.0f} s")
    return out


def derive_adapter(source: Path, out: Path, seed: int, noise: float = 0.1) -> Path:
    """source's adapter with every A and B moved by Gaussian noise of `noise` times the tensor's own std
    (seeded): same config, ranks and targets; weights that differ per seed. -> out."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = load_file(source / ADAPTER_WEIGHTS)
    derived = {}
    for key in sorted(tensors):
        t = tensors[key]
        std = t.float().std().item() or 1e-3  # an untrained B is all zeros: give it a small spread of its own
        derived[key] = (t + noise * std * torch.randn(t.shape, generator=gen, dtype=t.dtype)).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source / ADAPTER_CONFIG, out / ADAPTER_CONFIG)
    save_file(derived, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return out


def derive_tenants(sources: dict[int, Path], workload: Workload, n: int, out_dir: Path, seed: int = 0,
                   noise: float = 0.1) -> list[str]:
    """out_dir/<tenant name>/ for the first n tenants, each derived from the trained adapter of its rank."""
    names = []
    for i in range(n):
        name = tenant_name(workload, i)
        derive_adapter(sources[tenant_rank(workload, i)], out_dir / name, tenant_seed(workload, i, seed), noise)
        names.append(name)
    return names


def register(store_root: Path, from_dir: Path) -> dict:
    """Every adapter directory under from_dir, each under its directory's name, with ONE command:
    `manyfold store add --kind lora --base smollm2 --from-dir DIR` (one manifest write for the lot);
    -> {"command", "seconds" (the whole command, Python start-up included), "output" (its last line)}."""
    cmd = [sys.executable, "-m", "serve.cli", "store", "add", "--store", str(store_root), "--kind", "lora",
           "--base", BASE, "--from-dir", str(from_dir)]
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    seconds = time.perf_counter() - t
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return {"command": f"manyfold store add --kind lora --base {BASE} --from-dir DIR", "seconds": seconds,
            "output": (done.stdout.strip().splitlines() or [""])[-1]}


def trained_dir(workload: Workload, rank: int, spec: TrainSpec = TrainSpec()) -> Path:
    return home() / "tenants" / "trained" / f"{workload.name.lower()}-r{rank}-{CORPUS}-{spec.steps}steps"


def trained_sources(workload: Workload, spec: TrainSpec = TrainSpec(),
                    log: Callable[[str], None] = print) -> dict[int, Path]:
    """rank -> the workload's trained adapter of that rank (trained once, cached)."""
    from serve.data.models import smollm2_dir

    return {r: train_source(smollm2_dir(), workload, r, trained_dir(workload, r, spec), spec, log)
            for r in workload.ranks}


def store_root(workload: Workload, n: int) -> Path:
    return home() / "tenants" / f"{workload.name.lower()}-n{n}"


def built_record(workload: Workload, n: int, seed: int = 0, noise: float = 0.1,
                 spec: TrainSpec = TrainSpec()) -> dict | None:
    """built.json of the (workload, N) store when it was built with these settings; None otherwise."""
    built = store_root(workload, n) / BUILT
    if not built.is_file():
        return None
    record = json.loads(built.read_text())
    same = (record.get("seed"), record.get("noise"), record.get("train_steps"), record.get("trained_on"))
    return record if same == (seed, noise, spec.steps, CORPUS) else None


def build_tenant_store(workload: Workload, n: int, seed: int = 0, noise: float = 0.1, spec: TrainSpec = TrainSpec(),
                       log: Callable[[str], None] = print) -> dict:
    """The store of N tenants of a workload, built once: -> built.json's record (store path, names, what the
    registration took). The derived sources are removed once registered: the store keeps each as a PEFT
    directory, which the baselines load."""
    from serve.data.models import smollm2_dir
    from serve.store.store import Store

    if (record := built_record(workload, n, seed, noise, spec)) is not None:
        return record
    root = store_root(workload, n)
    sources = trained_sources(workload, spec, log)
    shutil.rmtree(root, ignore_errors=True)
    store = Store(root / "store", create=True)
    store.add_base(BASE, smollm2_dir())
    log(f"deriving {n} {workload.name} adapters (ranks {'/'.join(map(str, workload.ranks))} on "
        f"{', '.join(workload.targets)})")
    t = time.perf_counter()
    names = derive_tenants(sources, workload, n, root / "sources", seed, noise)
    derive_s = time.perf_counter() - t
    reg = register(store.root, root / "sources")
    shutil.rmtree(root / "sources")
    store.reload()
    missing = [name for name in names if name not in store.manifest.variants]
    if missing:
        raise RuntimeError(f"{store.root}: {len(missing)} of {n} adapters not registered (first: {missing[0]})")
    adapter_bytes = sum(f.bytes for name in names for f in store.variant(name).files)
    record = {"workload": workload.name, "tenants": n, "store": str(store.root), "names": names, "seed": seed,
              "noise": noise, "train_steps": spec.steps, "trained_on": CORPUS,
              "built_at": time.strftime("%Y-%m-%d %H:%M"), "derive_s": derive_s, "register": reg,
              "adapter_bytes": adapter_bytes}
    log(f"{n} adapters ({adapter_bytes / 2**20:.0f} MiB) registered with one command in {reg['seconds']:.1f} s: "
        f"{reg['output']}")
    (root / BUILT).write_text(json.dumps(record, indent=1) + "\n")
    return record


def trained_summary(workload: Workload, spec: TrainSpec = TrainSpec(), log: Callable[[str], None] = print) -> dict:
    """rank -> what its trained adapter learned (corpus, steps, mean loss of the first and of the last 4 steps:
    one batch's loss is noisy), from its train_log.json."""
    out = {}
    for rank, path in trained_sources(workload, spec, log).items():
        t = json.loads((path / "train_log.json").read_text())
        losses = [e["loss"] for e in t["log"]]
        out[rank] = {"corpus": CORPUS, "steps": t["steps"], "loss_first_4": sum(losses[:4]) / len(losses[:4]),
                     "loss_last_4": sum(losses[-4:]) / len(losses[-4:]), "seconds": t["seconds"]}
    return out
