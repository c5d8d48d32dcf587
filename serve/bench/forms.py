"""`manyfold bench forms`: the forms `store add --kind auto` weighs, for the demo's fine-tunes and the load test's.

For each fine-tune: every candidate's resident and stored bytes, its agreement with the fine-tune on the
calibration set (CALIBRATION texts of the task's test split the fine-tune never saw, as a user would give its
validation data to --calibration; a language model is compared on the first 32, 64 tokens each),
its held-out accuracy (classifiers: the rest of the test split, up to --examples) or loss (language models),
and the form `auto` chooses at tolerance 0, 0.5% and 2% (serve/forms/auto.py's rule, on the same measurements).
Then the cost of one forward of ROWS rows x SEQ tokens, half base rows and half a form's, per form, against the
base alone. The load test's fine-tunes are trained here by its recipe (loadtests/variants.py: 64 examples, one
epoch, seed = index; every weight, or the top two layers and the head), one per task.
"""

import random
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from serve.bench.report import NO_GPU, finish, machine, median_time
from serve.config import SlotsConfig
from serve.data.cache import home
from serve.data.datasets import CLASSIFICATION, bbc_topics, fortunes
from serve.demo import BASE, EMR_GROUPS, build_demo_store, finetune_classifier
from serve.forms.agreement import MAX_TOKENS, Calibration, Reference
from serve.forms.auto import RANKS, Candidate, choose, exact_candidate, load_fine, measured_candidates, register
from serve.forms.lowrank import DeltaFactors
from serve.store.store import Store
from serve.variants.full import extract_full_variant

TOLERANCES = (0.0, 0.005, 0.02)
CALIBRATION = 128
ROWS, SEQ = 16, 64
TIMED = ("minilm-topic", "smollm2-fortunes")
"""The fine-tunes whose forms are timed in a mixed forward: one classifier, one language model."""
LM_HELD_OUT = 32
"""A language model's held-out loss: on this many test texts (128 tokens each at most; two forwards a form)."""


@dataclass(frozen=True)
class FineTune:
    name: str
    source: str
    base: str
    path: Path
    task: str
    """A CLASSIFICATION key, or an LM corpus ("fortunes", "news")."""


def _unseen(task: str, examples: int) -> tuple[list, list]:
    """(calibration, held-out): disjoint parts of the task's test split, shuffled with seed 0. The fine-tune trained
    on neither: on its own training texts a form agrees far more often than on new ones (measured, minilm-topic
    rank 4: 97.7% on the first 128 training texts, 91% on test texts), so a calibration set drawn from them lets
    `auto` pick forms that lose accuracy."""
    if task == "fortunes":
        items: list = fortunes("test")
    elif task == "news":
        items = [e.text for e in bbc_topics("test").examples]
    else:
        items = list(CLASSIFICATION[task]("test").examples)
    random.Random(0).shuffle(items)
    return items[:CALIBRATION], items[CALIBRATION:CALIBRATION + examples]


def fine_tunes(demo: Store, work: Path, log) -> list[FineTune]:
    out = []
    for group in EMR_GROUPS:
        for task, variant in group.tasks:
            if not (work / variant / "config.json").is_file():
                extract_full_variant(demo, variant, work / variant)
            out.append(FineTune(variant, "demo", group.base, work / variant, task))
    for scenario, top in (("full", None), ("top2", 2)):
        for seed, task in enumerate(("topic", "sentiment", "spam")):
            name = f"lt-{scenario}-{task}"
            if not (work / name / "config.json").is_file():
                log(f"fine-tuning {name} by the load test's recipe")
                finetune_classifier(demo.base_dir(BASE), CLASSIFICATION[task]("train"), work / name, 64, 64,
                                    seed=seed, top_layers=top, log=lambda m: None)
            out.append(FineTune(name, f"load test ({scenario})", BASE, work / name, task))
    return out


@torch.no_grad()
def held_out(model, tok, items: list, causal: bool) -> float:
    """Accuracy on the held-out examples (classifier), or mean token loss on the first LM_HELD_OUT texts."""
    from serve.demo import examples_accuracy

    if not causal:
        return examples_accuracy(model, tok, items, 128)
    texts = items[:LM_HELD_OUT]
    losses = []
    for i in range(0, len(texts), 16):
        enc = tok(texts[i:i + 16], truncation=True, max_length=MAX_TOKENS, padding=True, return_tensors="pt")
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        losses.append(model(**enc, labels=labels).loss.item())
    return statistics.fmean(losses)


def group_store(demo: Store, ft: FineTune, fine_tunes_dir: Path, root: Path) -> Store:
    """A store of the fine-tune's base and one EMR group of the demo's other fine-tunes of that base."""
    from serve.codecs.emr import merge
    from serve.variants import variant_kind

    store = Store(root, create=True)
    store.add_base(ft.base, demo.base_dir(ft.base))
    group = next(g for g in EMR_GROUPS if g.base == ft.base)
    others = {t: fine_tunes_dir / v for t, v in group.tasks if v != ft.name}
    merge(demo.base_dir(ft.base), others, root / "bundle")
    variant_kind("emr").add(store, "others", ft.base, root / "bundle")
    return store


def place(demo: Store, ft: FineTune, work: Path, cache: Path, examples: int, log, mergekit: str | None = None,
          repeats: int | None = None) -> dict:
    """Every candidate measured (agreement and held-out quality), auto's choice at each tolerance, and with
    `repeats` the mixed forward of the forms worth timing."""
    store = group_store(demo, ft, cache, work / f"store-{ft.name}")
    fine = load_fine(ft.path)
    cal_items, test = _unseen(ft.task, examples)
    texts = tuple(x if isinstance(x, str) else x.text for x in cal_items)
    reference = Reference(fine.model, fine.tokenizer, Calibration(texts, f"{len(texts)} {ft.task} test texts"),
                          fine.causal)
    with store.stage() as staged:
        _, exact = exact_candidate(store, ft.name, ft.base, ft.path, staged)
    measured, factors = measured_candidates(store, ft.base, ft.name, fine, exact.resident_bytes,
                                            SlotsConfig().max_rank, work / f"emr-{ft.name}")
    candidates = sorted([exact, *measured], key=lambda c: c.resident_bytes)
    probe = type(fine.model).from_pretrained(ft.path, dtype=torch.float32).eval()
    rows = [{"form": "fine-tune itself", "held_out": held_out(fine.model, fine.tokenizer, test, fine.causal)}]
    for c in candidates:
        if c.state is not None:
            probe.load_state_dict(c.state())
            c.agreement = reference.measure(probe)
        quality = rows[0]["held_out"] if c.state is None else held_out(probe, fine.tokenizer, test, fine.causal)
        rows.append({**c.record().model_dump(), "held_out": quality})
        log(f"  {ft.name} {c.form}: {rows[-1]}")
    chosen = {f"{t:.1%}": choose(candidates, fine, reference, t, log) for t in TOLERANCES}
    if mergekit:
        ranks = sorted({8, *(c.rank for c in chosen.values() if c.rank is not None)})
        rows += [mergekit_row(mergekit, store, ft, fine, reference, r, cache, test) for r in ranks]
    out = {"name": ft.name, "source": ft.source, "base": ft.base, "causal": fine.causal,
           "calibration": reference.source, "dropped_by_lora": len(factors.dropped), "candidates": rows,
           "auto": {t: c.form for t, c in chosen.items()}}
    if repeats:
        timed = [c for c in candidates if c in chosen.values() or c.remerged or c.rank == RANKS[-1]]
        out["forward_ms_median"] = step_costs(store, ft, timed, factors, work, repeats)
    return out


def mergekit_row(tool: str, store: Store, ft: FineTune, fine, reference: Reference, rank: int, work: Path,
                 test: list) -> dict:
    """mergekit-extract-lora's adapter at `rank`, measured as the candidates are (serve/bench/mergekit.py)."""
    from serve.bench import mergekit

    base = mergekit.base_like(store.base_dir(ft.base), ft.path, work / f"mk-base-{ft.name}", fine.causal)
    adapter = mergekit.extract(tool, ft.path, base, rank, work / f"mk-{ft.name}-r{rank}")
    model, nbytes = mergekit.load(adapter, base, fine.architecture, work)
    agreement = reference.measure(model)
    return {"form": f"mergekit r{rank}", "resident_bytes": nbytes, "stored_bytes": nbytes,
            "agreement": round(agreement.agreement, 6), "kl": None if agreement.kl is None else round(agreement.kl, 6),
            "held_out": held_out(model, fine.tokenizer, test, fine.causal)}


def step_costs(store: Store, ft: FineTune, forms: list[Candidate], factors: DeltaFactors, work: Path,
               repeats: int) -> dict[str, float]:
    """Milliseconds of one forward of ROWS x SEQ: half base rows, half rows of each form (registered in the store
    its candidates were measured in, as `auto` registers them), against the base alone."""
    from serve.engine.step.batch import BASE_ROW, BatchPlan
    from serve.engine.model import BaseModelRuntime
    from serve.variants import variant_kind
    from serve.variants.full import add_full_variant

    rt = BaseModelRuntime(ft.base, store.base_dir(ft.base))
    ids = torch.randint(1000, rt.tokenizer.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    times = {"base alone": median_time(lambda: rt.call(BatchPlan([BASE_ROW] * ROWS, rt.device), input_ids=ids),
                                       repeats, warmup=True)}
    for k, c in enumerate(forms):
        name = f"f{k}"
        if c.state is None:
            entry, model = add_full_variant(store, name, ft.base, ft.path)[0], name
        else:
            entry, model = register(store, c, name, ft.base, ft.path, factors, work, SlotsConfig(), None)
        loaded = variant_kind(entry.kind).load(store, entry, rt.view, torch.empty)
        variant = loaded.members[model] if loaded.members else loaded
        slots = [rt.attach(variant if i % 2 else None) for i in range(ROWS)]
        try:
            plan = BatchPlan(slots, rt.device)
            times[c.form] = median_time(lambda: rt.call(plan, input_ids=ids), repeats, warmup=True)
        finally:
            for s in slots:
                rt.detach(s)
    return {k: v * 1e3 for k, v in times.items()}


def run_forms_bench(out: Path, examples: int = 300, repeats: int = 5, only: str | None = None,
                    mergekit: str | None = None) -> dict:
    log = lambda m: print(m, flush=True)  # noqa: E731
    demo = build_demo_store(log=log)
    cache = home() / "bench-forms"  # the fine-tunes and mergekit's adapters, kept for the next run
    fts = [f for f in fine_tunes(demo, cache, log) if only is None or any(o in f.name for o in only.split(","))]
    with tempfile.TemporaryDirectory(prefix="manyfold-forms-") as tmp:
        work = Path(tmp)
        placed = [place(demo, ft, work, cache, examples, log, mergekit, repeats if ft.name in TIMED else None)
                  for ft in fts]
    timing = {p["name"]: p.pop("forward_ms_median") for p in placed if "forward_ms_median" in p}
    report = {"machine": machine(), "torch_threads": torch.get_num_threads(), "examples": examples,
              "calibration": CALIBRATION, "lm_held_out": LM_HELD_OUT, "tolerances": list(TOLERANCES),
              "fine_tunes": placed,
              "forward_ms_median": timing, "rows": ROWS, "tokens": SEQ, "repeats": repeats, "gpu": NO_GPU,
              "mergekit": mergekit_version(mergekit) if mergekit else "not run (--mergekit PATH)"}
    return finish(report, out, print_report)


def mergekit_version(tool: str) -> str:
    import subprocess

    pip = Path(tool).parent / "pip"
    shown = subprocess.run([str(pip), "show", "mergekit"], capture_output=True, text=True).stdout
    version = next((line.split(":", 1)[1].strip() for line in shown.splitlines() if line.startswith("Version:")), "?")
    return f"mergekit {version} ({tool})"


def print_report(r: dict) -> None:
    print(f"\nforms of each fine-tune on {r['machine']} (agreement on {r['calibration']} test texts, held-out "
          f"accuracy on up to {r['examples']} others, or a language model's mean token loss on {r['lm_held_out']})")
    for ft in r["fine_tunes"]:
        print(f"\n{ft['name']} ({ft['source']}, base {ft['base']}; agreement on {ft['calibration']}); auto chooses "
              + ", ".join(f"{f} at {t}" for t, f in ft["auto"].items()))
        print(f"  {'form':<16}{'resident':>11}{'stored':>11}{'agreement':>11}{'KL':>9}{'held-out':>10}")
        for c in ft["candidates"]:
            agree = "-" if c.get("agreement") is None else f"{c['agreement']:.2%}"
            kl = "-" if c.get("kl") is None else f"{c['kl']:.4f}"
            quality = f"{c['held_out']:.4f}" if ft["causal"] else f"{c['held_out']:.1%}"
            size = (lambda b: f"{b / 1e6:.2f} MB" if b is not None else "-")
            print(f"  {c['form']:<16}{size(c.get('resident_bytes')):>11}{size(c.get('stored_bytes')):>11}"
                  f"{agree:>11}{kl:>9}{quality:>10}")
    for name, times in r["forward_ms_median"].items():
        base = times["base alone"]
        print(f"\n{name}: one forward of {r['rows']} rows x {r['tokens']} tokens, half base rows and half the "
              f"form's (median of {r['repeats']})")
        for form, ms in times.items():
            print(f"  {form:<16}{ms:>9.1f} ms{ms / base:>7.2f}x base")
    if r.get("auto_note"):
        print(r["auto_note"])
    print(f"mergekit-extract-lora: {r['mergekit']}")
    print(f"GPU: {r['gpu']}")
