"""The load-test stores: all-MiniLM-L6-v2 and many short real fine-tunes of it, plus each variant as an
uncompressed HF model directory (what the baselines load). Cached in MANYFOLD_HOME/loadtest-store-<scenario>.

Scenarios: "full" (every weight trained), "top2" (the top two encoder layers, the pooler and the head), and
"mixed": about 3/4 PEFT LoRA classifier adapters (rank 8 on query and value, head through modules_to_save) and
1/4 top-two-layer full fine-tunes, all served from the one base.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from serve.data.cache import home
from serve.data.datasets import CLASSIFICATION, Dataset

if TYPE_CHECKING:  # torch, transformers and peft load inside the builders: the plans stay cheap to import
    from serve.store.store import Store

BASE = "minilm"
TASKS = ("topic", "sentiment", "spam")
KINDS = ("full", "lora")


@dataclass(frozen=True)
class Scenario:
    what: str
    """How the table describes the variant set."""
    top_layers: int | None
    """Full fine-tunes train only these top encoder layers (+ pooler and head); None: every weight."""
    full_every: int = 1
    """Every full_every-th variant is a full fine-tune, the others LoRA adapters (1: all full)."""
    variants: int = 20
    """Default --variants."""
    rate_rps: float = 8.0
    """Default --rate."""
    kind_in_name: bool = False
    """Names say the kind (lt-lora-topic-07); the older scenarios keep their names (lt-topic-07)."""
    max_chars: int = 2000
    """Default --max-chars: each request's input is the start of a test text, this many characters at most."""


SCENARIOS = {
    "full": Scenario("every weight trained", None),
    "top2": Scenario("top 2 layers + head trained", 2),
    "mixed": Scenario("LoRA r8 adapters and top-2-layer full fine-tunes", 2, full_every=4, variants=52,
                      rate_rps=40.0, kind_in_name=True, max_chars=400),
}
"""mixed sends short inputs (400 characters: ~48 tokens a request on average; the variants trained on 64). With
2000 (~140 tokens on average, BBC articles ~360) compute caps every system at 4.5-6 req/s on this 2-core machine
(measured at 24 req/s offered: Manyfold 5.7, LRU 4.5, multiplexing 5.0). It offers 40 req/s, more than any system
completes here, so that each one's throughput is its ceiling: at 20 req/s Manyfold kept up with the offered load
in some runs (20.1 completed/s, its model replica at 0.8 of a core), which measures the offer, not Manyfold.
--max-chars and --rate override these."""

LORA_RANK = 8
LORA_TARGETS = ("query", "value")
LORA_LR = 1e-2
"""One epoch of 64 examples is 4 steps: at 1e-3 a fresh head barely moves (topic stays near chance); at 1e-2
the adapters learn something (measured on one seed: topic 11% -> 48% over 5 classes; spam stays at 88%, the
share of ham, its loss 0.66 -> 0.47). Served accuracy is not what the load test measures."""


@dataclass(frozen=True)
class PlannedVariant:
    name: str
    kind: str  # "full" or "lora"
    task: str  # a key of CLASSIFICATION
    seed: int


def variant_plan(n: int, scenario: str = "full") -> list[PlannedVariant]:
    """The scenario's n variants: tasks round-robin, kinds by `full_every` (the last of each group of
    full_every is full, so the mix is full_every - 1 adapters to 1 full fine-tune), seed = index."""
    sc = SCENARIOS[scenario]
    out = []
    for i in range(n):
        task = TASKS[i % len(TASKS)]
        kind = "full" if i % sc.full_every == sc.full_every - 1 else "lora"
        name = f"lt-{kind}-{task}-{i:02d}" if sc.kind_in_name else f"lt-{task}-{i:02d}"
        out.append(PlannedVariant(name, kind, task, i))
    return out


def variant_names(n: int, scenario: str = "full") -> list[str]:
    return [v.name for v in variant_plan(n, scenario)]


def variant_task(name: str) -> str:
    """The data set a load-test variant was trained on, from its name (lt-topic-03, lt-lora-spam-07)."""
    tasks = [part for part in name.split("-") if part in CLASSIFICATION]
    if len(tasks) != 1:
        raise ValueError(f"'{name}' names no load-test task ({', '.join(TASKS)})")
    return tasks[0]


def mix(plan: list[PlannedVariant]) -> dict[str, int]:
    """{kind: count} of a plan, every kind listed."""
    return {k: sum(v.kind == k for v in plan) for k in KINDS}


def mix_text(counts: dict[str, int], top_layers: int | None = None, short: bool = False) -> str:
    """'39 LoRA + 13 full' (short), or the table's line naming what each kind trained."""
    if short:
        return f"{counts['lora']} LoRA + {counts['full']} full"
    full = f"{counts['full']} full fine-tunes ({f'top {top_layers} layers + head' if top_layers else 'every weight'})"
    if not counts["lora"]:
        return full
    return (f"{counts['lora']} LoRA adapters (rank {LORA_RANK} on {', '.join(LORA_TARGETS)} + head; the baselines "
            f"load each merged into a full model) + {full}")


def finetune_classifier_lora(base_dir: Path, data: Dataset, out_dir: Path, n_train: int, max_len: int,
                             lr: float = LORA_LR, batch_size: int = 16, seed: int = 0, rank: int = LORA_RANK,
                             targets: tuple[str, ...] = LORA_TARGETS,
                             log: Callable[[str], None] = print) -> float:
    """One epoch of a PEFT LoRA classifier adapter (task SEQ_CLS, a fresh head saved through modules_to_save)
    on n_train examples, sampled as serve.demo.finetune_classifier samples them; saves the adapter directory
    (adapter_config.json + adapter_model.safetensors, and config.json whose id2label names the classes).
    -> the last batch's loss."""
    import torch
    from peft import LoraConfig, get_peft_model
    from serve.demo import train_classifier_epoch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the expected "classifier.* newly initialized" report
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    label_id = {label: i for i, label in enumerate(data.labels)}
    model = AutoModelForSequenceClassification.from_pretrained(
        base_dir, num_labels=len(data.labels), id2label=dict(enumerate(data.labels)), label2id=label_id)
    peft = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=rank, lora_alpha=2 * rank,
                                            target_modules=list(targets), modules_to_save=["classifier"]))
    examples = random.Random(seed).sample(data.examples, min(n_train, len(data.examples)))
    loss = train_classifier_epoch(peft, tok, examples, label_id, max_len, lr, batch_size, data.name, log)
    out_dir = Path(out_dir)
    peft.save_pretrained(out_dir, safe_serialization=True)
    model.config.save_pretrained(out_dir)  # id2label for the store
    return loss


def merge_lora_classifier(base_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """A LoRA classifier adapter merged into its base (merge_and_unload) and saved with its head as a plain
    BertForSequenceClassification directory, the base's tokenizer files beside it: what the baselines load."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from serve.store.model_dir import is_tokenizer_file
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    id2label = {int(k): v for k, v in json.loads((Path(adapter_dir) / "config.json").read_text())["id2label"].items()}
    model = AutoModelForSequenceClassification.from_pretrained(
        base_dir, num_labels=len(id2label), id2label=id2label, label2id={v: k for k, v in id2label.items()})
    merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
    out_dir = Path(out_dir)
    partial = out_dir.with_name(out_dir.name + ".partial")  # only a complete directory gets the name
    shutil.rmtree(partial, ignore_errors=True)
    merged.save_pretrained(partial, safe_serialization=True)
    for p in Path(base_dir).iterdir():
        if p.is_file() and is_tokenizer_file(p.name):
            shutil.copy2(p, partial / p.name)
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
    return out_dir


def build_loadtest_store(n_variants: int = 20, examples: int = 64, scenario: str = "full",
                         log=print) -> tuple[Store, Path]:
    """-> (the store, a directory with each variant uncompressed as a HF model directory)."""
    from serve.data.models import minilm_dir
    from serve.demo import finetune_classifier
    from serve.store.store import Store
    from serve.variants import variant_kind
    from serve.variants.full import add_full_variant, extract_full_variant

    sc = SCENARIOS[scenario]
    root = home() / f"loadtest-store-{scenario}"
    store = Store(root / "store", create=True)
    plain = root / "uncompressed"
    plain.mkdir(parents=True, exist_ok=True)
    if BASE not in store.manifest.bases:
        store.add_base(BASE, minilm_dir())
    base_dir = store.base_dir(BASE)
    data: dict[str, Dataset] = {}
    for v in variant_plan(n_variants, scenario):
        if v.name not in store.manifest.variants or not (plain / v.name / "model.safetensors").is_file():
            data.setdefault(v.task, CLASSIFICATION[v.task]("train"))
        if v.kind == "full":
            if v.name not in store.manifest.variants:
                log(f"fine-tuning {v.name} ({examples} {v.task} examples, seed {v.seed})")
                with tempfile.TemporaryDirectory() as tmp:
                    finetune_classifier(base_dir, data[v.task], Path(tmp), examples, 64, seed=v.seed,
                                        top_layers=sc.top_layers, log=lambda m: None)
                    add_full_variant(store, v.name, BASE, tmp)
            if not (plain / v.name / "model.safetensors").is_file():
                extract_full_variant(store, v.name, plain / v.name)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            adapter = Path(tmp) / "adapter"
            if v.name not in store.manifest.variants:
                log(f"training LoRA adapter {v.name} ({examples} {v.task} examples, seed {v.seed})")
                finetune_classifier_lora(base_dir, data[v.task], adapter, examples, 64, lr=LORA_LR,
                                         seed=v.seed, log=lambda m: None)
                variant_kind("lora").add(store, v.name, BASE, adapter)
            if not (plain / v.name / "model.safetensors").is_file():
                if not adapter.is_dir():
                    variant_kind("lora").extract(store, v.name, adapter)
                merge_lora_classifier(base_dir, adapter, plain / v.name)
    return store, plain
