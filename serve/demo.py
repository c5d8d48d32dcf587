"""The demo store: MiniLM and SmolLM2 with their fine-tunes on real packaged data: full fine-tunes stored as
FM-Delta variants, and SmolLM2 PiSSA adapters trained with PEFT, served converted (rank 2r LoRA). SmolLM2 is
also served as a lossless NeuZip base (bf16) with the same adapters and bf16 copies of its full fine-tunes.

Built once into MANYFOLD_HOME/demo-store and reused; a store only counts as built once its manifest lists
every demo variant, so an interrupted build resumes where it stopped.
"""

import random
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from serve.data.cache import home
from serve.data.datasets import CLASSIFICATION, Dataset
from serve.data.models import minilm_dir, smollm2_dir
from serve.store.store import Store
from serve.variants.full import add_full_variant

BASE = "minilm"


@dataclass(frozen=True)
class DemoTask:
    variant: str
    dataset: str
    train_examples: int
    max_len: int


TASKS = (
    DemoTask("minilm-topic", "topic", 320, 128),
    DemoTask("minilm-sentiment", "sentiment", 480, 64),
    DemoTask("minilm-spam", "spam", 480, 64),
)

LM_BASE = "smollm2"


@dataclass(frozen=True)
class LmTask:
    """A full fine-tune of SmolLM2 that trains only its top layers (the rest stay bit-identical to the base,
    which FM-Delta stores for free): the first demo build stays within minutes on two cores."""

    variant: str
    corpus: str
    steps: int
    top_layers: int = 2
    batch_size: int = 4
    max_len: int = 128
    lr: float = 3e-4


LM_TASKS = (
    LmTask("smollm2-fortunes", "fortunes", 24),
    LmTask("smollm2-news", "news", 24),
)


@dataclass(frozen=True)
class AdapterTask:
    """A PiSSA adapter of SmolLM2 on one of serve.adapters.tasks' real data sets (randomised SVD init, a few
    dozen steps: a first demo build stays within minutes on two cores)."""

    variant: str
    task: str
    examples: int
    steps: int
    rank: int = 8
    init: str = "pissa_niter_4"
    lr: float = 5e-4
    batch_size: int = 4
    max_length: int = 96
    discriminator: bool = False
    """Trained with `adapter train --discriminator`'s assets (Trans-LoRA's seeds, validation set, discriminator),
    so that `manyfold store upgrade` can move it to another base."""


ADAPTER_TASKS = (
    AdapterTask("smollm2-fortunes-pissa", "fortunes", 256, 24),
    AdapterTask("smollm2-headlines-pissa", "headlines", 256, 24, discriminator=True),
    AdapterTask("smollm2-spam-pissa", "spam", 256, 24),
)


@dataclass(frozen=True)
class EmrGroup:
    """An EMR-Merging group of demo full fine-tunes, next to their FM-Delta forms: the same fine-tunes served two
    ways, to compare over HTTP (`GROUP/TASK` against the full variant)."""

    name: str
    base: str
    tasks: tuple[tuple[str, str], ...]
    """(task, the full variant it merges)."""


EMR_GROUPS = (
    EmrGroup("minilm-emr", BASE, (("topic", "minilm-topic"), ("sentiment", "minilm-sentiment"), ("spam", "minilm-spam"))),
    EmrGroup("smollm2-emr", LM_BASE, (("fortunes", "smollm2-fortunes"), ("news", "smollm2-news"))),
)


NZ_BASE = "smollm2-nz"
"""SmolLM2 in NeuZip form (lossless, bf16); its variants are the LM base's, named with this prefix."""
NZ_BITS = 7


def nz_name(variant: str) -> str:
    return NZ_BASE + variant.removeprefix(LM_BASE)


def lm_corpus(name: str) -> list[str]:
    from serve.data.datasets import bbc_topics, fortunes

    if name == "fortunes":
        return fortunes("train")
    if name == "news":
        return [e.text for e in bbc_topics("train").examples]
    raise ValueError(f"unknown corpus '{name}'")


def finetune_lm_top_layers(base_dir: Path, texts: list[str], out_dir: Path, task: LmTask, seed: int = 0,
                           log: Callable[[str], None] = print) -> float:
    """Next-token training of the top `task.top_layers` decoder layers and the final norm; -> last loss."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    n_layers = model.config.num_hidden_layers
    trainable = [f"model.layers.{i}." for i in range(n_layers - task.top_layers, n_layers)] + ["model.norm."]
    params = []
    for name, p in model.named_parameters():
        p.requires_grad = any(name.startswith(t) for t in trainable)
        if p.requires_grad:
            params.append(p)
    opt = torch.optim.AdamW(params, lr=task.lr)
    rng = random.Random(seed)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(task.steps):
        batch = rng.sample(texts, task.batch_size)
        enc = tok(batch, truncation=True, max_length=task.max_len, padding=True, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 8 == 0 or step == task.steps - 1:
            log(f"  {task.variant}: step {step + 1}/{task.steps} loss {loss.item():.3f}")
    model.eval()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return loss.item()


def demo_store_dir() -> Path:
    return home() / "demo-store"


def finetune_classifier(base_dir: Path, data: Dataset, out_dir: Path, n_train: int, max_len: int,
                        test: Dataset | None = None, lr: float = 1e-4, batch_size: int = 16,
                        seed: int = 0, top_layers: int | None = None,
                        log: Callable[[str], None] = print) -> float | None:
    """One epoch of fine-tuning with a fresh head; saves a HF dir, returns test accuracy.

    Every weight trains, or with top_layers only the top encoder layers, the pooler and the head (the rest
    stays bit-identical to the base, which FM-Delta stores and the engine holds for free)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the expected "classifier.* newly initialized" report
    hf_logging.disable_progress_bar()
    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForSequenceClassification.from_pretrained(
        base_dir, num_labels=len(data.labels), id2label=dict(enumerate(data.labels)),
        label2id={label: i for i, label in enumerate(data.labels)})
    label_id = {label: i for i, label in enumerate(data.labels)}
    examples = random.Random(seed).sample(data.examples, min(n_train, len(data.examples)))
    if top_layers is not None:
        n = model.config.num_hidden_layers
        keep = tuple(f"bert.encoder.layer.{i}." for i in range(n - top_layers, n)) + ("bert.pooler.", "classifier.")
        for name, p in model.named_parameters():
            p.requires_grad = name.startswith(keep)
    train_classifier_epoch(model, tok, examples, label_id, max_len, lr, batch_size, data.name, log)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    if test is None:
        return None
    return classifier_accuracy(model, tok, test, max_len)


def train_classifier_epoch(model, tok, examples: list, label_id: dict[str, int], max_len: int, lr: float,
                           batch_size: int, name: str, log: Callable[[str], None] = print) -> float:
    """One epoch of AdamW over the model's trainable parameters (a full model, or a PEFT model); -> last loss."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    loss = torch.tensor(float("nan"))
    steps = range(0, len(examples), batch_size)
    for i, start in enumerate(steps):
        chunk = examples[start:start + batch_size]
        enc = tok([e.text for e in chunk], truncation=True, max_length=max_len, padding=True, return_tensors="pt")
        loss = model(**enc, labels=torch.tensor([label_id[e.label] for e in chunk])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i % 10 == 0 or i == len(steps) - 1:
            log(f"  {name}: step {i + 1}/{len(steps)} loss {loss.item():.3f}")
    model.eval()
    return loss.item()


def classifier_accuracy(model, tok, data: Dataset, max_len: int, limit: int = 200, seed: int = 0) -> float:
    """Accuracy on a seeded sample of `limit` examples: some data files are sorted by label (the sentiment
    test split opens with 500 negatives), so their first examples would measure one class."""
    examples = data.examples if len(data.examples) <= limit else random.Random(seed).sample(data.examples, limit)
    return examples_accuracy(model, tok, examples, max_len)


@torch.no_grad()
def examples_accuracy(model, tok, examples: list, max_len: int) -> float:
    """Share of `examples` whose label the classifier predicts, in batches of 32."""
    correct = 0
    for start in range(0, len(examples), 32):
        chunk = examples[start:start + 32]
        enc = tok([e.text for e in chunk], truncation=True, max_length=max_len, padding=True, return_tensors="pt")
        pred = model(**enc).logits.argmax(-1).tolist()
        correct += sum(model.config.id2label[p] == e.label for p, e in zip(pred, chunk))
    return correct / max(1, len(examples))


def build_demo_store(root: Path | None = None, tasks: tuple[DemoTask, ...] = TASKS,
                     lm_tasks: tuple[LmTask, ...] = LM_TASKS, adapter_tasks: tuple[AdapterTask, ...] = ADAPTER_TASKS,
                     emr_groups: tuple[EmrGroup, ...] = EMR_GROUPS, log: Callable[[str], None] = print) -> Store:
    """Add the bases and every missing demo variant; returns the opened store. An EMR group is merged once every
    fine-tune it merges is in the store."""
    root = root or demo_store_dir()
    store = Store(root, create=True)
    if lm_tasks and LM_BASE not in store.manifest.bases:
        log(f"adding base '{LM_BASE}' (SmolLM2-135M-Instruct, converted once from the packaged GGUF)")
        store.add_base(LM_BASE, smollm2_dir())
    for task in lm_tasks:
        if task.variant in store.manifest.variants:
            continue
        log(f"fine-tuning '{task.variant}': top {task.top_layers} layers, {task.steps} steps on {task.corpus}")
        with tempfile.TemporaryDirectory() as tmp:
            finetune_lm_top_layers(store.base_dir(LM_BASE), lm_corpus(task.corpus), Path(tmp), task, log=log)
            _, stats = add_full_variant(store, task.variant, LM_BASE, tmp)
        log(f"  stored {stats.raw_bytes / 1e6:.1f} MB as {stats.file_bytes / 1e6:.1f} MB FM-Delta ({stats.ratio:.1%})")
    for task in adapter_tasks:
        if task.variant not in store.manifest.variants:
            add_demo_adapter(store, task, log)
    if BASE not in store.manifest.bases:
        log(f"adding base '{BASE}' (all-MiniLM-L6-v2)")
        store.add_base(BASE, minilm_dir())
    for task in tasks:
        if task.variant in store.manifest.variants:
            continue
        log(f"fine-tuning '{task.variant}' on {task.train_examples} {task.dataset} examples")
        load = CLASSIFICATION[task.dataset]
        with tempfile.TemporaryDirectory() as tmp:
            acc = finetune_classifier(store.base_dir(BASE), load("train"), Path(tmp), task.train_examples,
                                      task.max_len, test=load("test"), log=log)
            _, stats = add_full_variant(store, task.variant, BASE, tmp)
        log(f"  test accuracy {acc:.1%}; stored {stats.raw_bytes / 1e6:.1f} MB as {stats.file_bytes / 1e6:.1f} MB"
            f" FM-Delta ({stats.ratio:.1%})")
    for group in emr_groups:
        if group.name not in store.manifest.variants and all(v in store.manifest.variants for _, v in group.tasks):
            add_emr_group(store, group, log)
    if lm_tasks or adapter_tasks:
        add_neuzip_base(store, [t.variant for t in lm_tasks], [t.variant for t in adapter_tasks], log)
    return store


def add_neuzip_base(store: Store, full: list[str], adapters: list[str], log: Callable[[str], None] = print) -> None:
    """SmolLM2 as a lossless NeuZip base, with bf16 copies of the LM base's full variants (FM-Delta against the
    bf16 weights) and its adapters as they are."""
    from serve.codecs.neuzip_file import add_base, cast_to_bf16
    from serve.variants import variant_kind
    from serve.variants.full import extract_full_variant

    if NZ_BASE not in store.manifest.bases:
        log(f"adding base '{NZ_BASE}' (SmolLM2-135M-Instruct in bf16, NeuZip k={NZ_BITS})")
        _, stats, _ = add_base(store, NZ_BASE, smollm2_dir(), NZ_BITS)
        log(f"  {stats.codecs['neuzip']} weights coded: {stats.coded_raw_bytes / 1e6:.1f} MB of bf16 -> "
            f"{stats.coded_ratio:.1%}")
    for variant in full:
        if nz_name(variant) not in store.manifest.variants:
            log(f"adding '{nz_name(variant)}': '{variant}' in bf16")
            with tempfile.TemporaryDirectory() as tmp:
                cast_to_bf16(extract_full_variant(store, variant, Path(tmp) / "ft"))
                add_full_variant(store, nz_name(variant), NZ_BASE, Path(tmp) / "ft")
    for variant in adapters:
        if nz_name(variant) not in store.manifest.variants:
            entry = store.variant(variant)
            variant_kind(entry.kind).add(store, nz_name(variant), NZ_BASE, store.variant_dir(variant))


def add_emr_group(store: Store, group: EmrGroup, log: Callable[[str], None] = print) -> None:
    """Merge the group's full variants (decoded from the store) by EMR-Merging and add the bundle."""
    from serve.codecs.emr import merge
    from serve.variants import variant_kind
    from serve.variants.full import extract_full_variant

    log(f"merging '{group.name}' (EMR): {', '.join(v for _, v in group.tasks)}")
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {t: extract_full_variant(store, v, Path(tmp) / t) for t, v in group.tasks}
        bundle = merge(store.base_dir(group.base), dirs, Path(tmp) / "bundle")
        entry = variant_kind("emr").add(store, group.name, group.base, bundle.path)
    lambdas = ", ".join(f"{t.name} {t.rescaler:.2f}" for t in bundle.manifest.tasks)
    log(f"  stored {sum(f.bytes for f in entry.files) / 1e6:.1f} MB for {len(group.tasks)} tasks (rescalers: {lambdas})")


def add_demo_adapter(store: Store, task: AdapterTask, log: Callable[[str], None] = print) -> None:
    from serve.adapters.tasks import task_examples
    from serve.adapters.train import train_adapter
    from serve.variants import variant_kind

    if LM_BASE not in store.manifest.bases:
        store.add_base(LM_BASE, smollm2_dir())
    log(f"training '{task.variant}': PiSSA ({task.init}) rank {task.rank}, {task.steps} steps on {task.task}")
    examples = task_examples(task.task, "train", task.examples)
    trained = examples
    if task.discriminator:  # its validation set held out from the adapter too, as `adapter train --discriminator`
        from serve.adapters.translora import SEEDS
        from serve.adapters.validation import trained_on

        trained = trained_on(examples, SEEDS)
    with tempfile.TemporaryDirectory() as tmp:
        result = train_adapter(store.base_dir(LM_BASE), trained, Path(tmp) / "adapter", init=task.init,
                               rank=task.rank, steps=task.steps, lr=task.lr, batch_size=task.batch_size,
                               max_length=task.max_length)
        if task.discriminator:
            from serve.adapters.translora import train_discriminator

            log("  training its Trans-LoRA discriminator (so that `manyfold store upgrade` can move it)")
            train_discriminator(store.base_dir(LM_BASE), result.out_dir, examples, task.task)
        entry = variant_kind("pissa").add(store, task.variant, LM_BASE, result.out_dir)
    log(f"  loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} in {result.train_seconds:.0f} s; stored "
        f"{sum(f.bytes for f in entry.files) / 1e6:.1f} MB (rank {entry.rank}, converted)")
