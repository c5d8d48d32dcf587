"""The load-test store: all-MiniLM-L6-v2 and many short real full fine-tunes of it, plus each fine-tune
uncompressed (what the baselines load). Cached in MANYFOLD_HOME/loadtest-store."""

import tempfile
from pathlib import Path

from serve.data.datasets import CLASSIFICATION, home
from serve.data.models import minilm_dir
from serve.demo import finetune_classifier
from serve.store.store import Store
from serve.variants.full import add_full_variant, extract_full_variant

BASE = "minilm"
TASKS = ("topic", "sentiment", "spam")


def variant_names(n: int) -> list[str]:
    return [f"lt-{TASKS[i % len(TASKS)]}-{i:02d}" for i in range(n)]


SCENARIOS = {"full": None, "top2": 2}
"""Variants train every weight ("full") or only the top two encoder layers, the pooler and the head."""


def build_loadtest_store(n_variants: int = 20, examples: int = 64, scenario: str = "full",
                         log=print) -> tuple[Store, Path]:
    """-> (the store, a directory with each variant uncompressed as a HF model directory)."""
    root = home() / f"loadtest-store-{scenario}"
    store = Store(root / "store", create=True)
    plain = root / "uncompressed"
    if BASE not in store.manifest.bases:
        store.add_base(BASE, minilm_dir())
    for i, name in enumerate(variant_names(n_variants)):
        task = TASKS[i % len(TASKS)]
        if name not in store.manifest.variants:
            log(f"fine-tuning {name} ({examples} {task} examples, seed {i})")
            with tempfile.TemporaryDirectory() as tmp:
                finetune_classifier(store.base_dir(BASE), CLASSIFICATION[task]("train"), Path(tmp), examples, 64,
                                    seed=i, top_layers=SCENARIOS[scenario], log=lambda m: None)
                add_full_variant(store, name, BASE, tmp)
        if not (plain / name / "model.safetensors").is_file():
            extract_full_variant(store, name, plain / name)
    return store, plain
