"""`manyfold bench emr`: EMR-Merging on the demo store's three MiniLM classifiers (BBC topic, tweet sentiment,
SMS spam: full fine-tunes of every weight), against the alternatives METHODS.md section 3 names.

1. Held-out accuracy per task and on average (the test splits, which the demo never trains on; up to
   `--examples` per task, a seeded sample where there are more, as some files are sorted by label): the
   individual fine-tunes; EMR as served (mean rescalers); EMR with the global rescalers; EMR without rescalers
   (lambda 1); task arithmetic (lambda 0.3); TIES-Merging (top 20% of each task vector by magnitude, sign elected
   by mass, disjoint mean, lambda 1); weight averaging; and the base with each task's head as the floor. Every
   merged model keeps each task's own head.
2. Bytes per extra task: EMR's packed mask, rescaler and head, against the task's FM-Delta file and its fp32
   weights; tau_uni once per group.
3. Time of one forward of `--rows` rows of 64 tokens mixing the three EMR tasks and the base (rows round robin),
   against the base alone and against dense forwards of the reconstructed task models (one a task, plus the
   base rows' own), and the same forward with the masked delta for every EMR row (no task's weights formed:
   serve/engine/families/emr_slots.py DENSE_MIN_TOKENS), and where that delta's time goes (kernels.emr_delta over every
   Linear, its unpacking alone).
"""

import random
import statistics
import tempfile
from pathlib import Path

import torch

from kernels.emr_delta import emr_delta_torch, masked
from serve.bench.report import NO_GPU, finish, machine, median_time
from serve.codecs import emr
from serve.data.datasets import CLASSIFICATION
from serve.demo import EMR_GROUPS, TASKS, build_demo_store, examples_accuracy
from serve.engine.families import emr_slots
from serve.engine.step.batch import BASE_ROW, BatchPlan
from serve.engine.model import BaseModelRuntime
from serve.store.tensors import SafetensorsSource
from serve.variants import variant_kind
from serve.variants.base import MASKS_SUFFIX
from serve.variants.full import extract_full_variant

GROUP = EMR_GROUPS[0]  # minilm-emr: topic, sentiment, spam
TA_LAMBDA, TIES_TOP, TIES_LAMBDA = 0.3, 0.2, 1.0
SEQ = 64


def _test_sets(n: int, seed: int = 0) -> dict[str, list]:
    out = {}
    for task, _ in GROUP.tasks:
        examples = CLASSIFICATION[task]("test").examples
        out[task] = examples if len(examples) <= n else random.Random(seed).sample(examples, n)
    return out


def ties_merge(taus: dict[str, dict[str, torch.Tensor]], top: float) -> dict[str, torch.Tensor]:
    """TIES-Merging's merged task vector: trim each task to its top `top` share by magnitude (over all its
    weights), elect each weight's sign by the larger summed mass, average the entries that agree with it."""
    trimmed = {}
    for t, tau in taus.items():
        flat = torch.cat([v.abs().flatten() for v in tau.values()])
        keep = max(1, int(top * flat.numel()))
        threshold = torch.kthvalue(flat, flat.numel() - keep + 1).values
        trimmed[t] = {n: torch.where(v.abs() >= threshold, v, 0.0) for n, v in tau.items()}
    merged = {}
    for n in next(iter(taus.values())):
        stack = torch.stack([trimmed[t][n] for t in taus])  # [tasks, ...]
        sign = torch.where(stack.sum(0) >= 0, 1.0, -1.0).to(stack.dtype)
        agree = (torch.sign(stack) == sign) & (stack != 0)
        merged[n] = torch.where(agree, stack, 0.0).sum(0) / agree.sum(0).clamp(min=1)
    return merged


def accuracy_table(store, work: Path, examples: int) -> tuple[dict, dict]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    base_dir = store.base_dir(GROUP.base)
    base = SafetensorsSource(base_dir)
    max_len = {t.dataset: t.max_len for t in TASKS}
    dirs = {t: extract_full_variant(store, v, work / t) for t, v in GROUP.tasks}
    bundles = {r: emr.merge(base_dir, dirs, work / f"bundle-{r}", rescaler=r) for r in ("mean", "global")}
    names = bundles["mean"].manifest.names  # checkpoint name -> base name, the same for every task
    shared = {c: b for c, b in names.items() if base[b].dtype.is_floating_point}
    w_pre = {c: base[b].double() for c, b in shared.items()}
    taus = {t: {c: SafetensorsSource(d)[c].double() - w_pre[c] for c in shared} for t, d in dirs.items()}
    merged = {
        "task arithmetic (lambda 0.3)": {c: TA_LAMBDA * sum(taus[t][c] for t in taus) for c in shared},
        "TIES (top 20%, lambda 1)": {c: TIES_LAMBDA * v for c, v in ties_merge(taus, TIES_TOP).items()},
        "weight averaging": {c: sum(taus[t][c] for t in taus) / len(taus) for c in shared},
        "base + own head (floor)": {c: torch.zeros_like(w) for c, w in w_pre.items()},
    }
    unit = bundles["mean"].manifest.model_copy(update={"tasks": [t.model_copy(update={"rescaler": 1.0})
                                                                 for t in bundles["mean"].manifest.tasks]})
    methods = {
        "individual fine-tunes": lambda t: None,
        "EMR (as served: mean rescalers)": lambda t: emr.task_tensors(bundles["mean"], t, base),
        "EMR (global rescalers)": lambda t: emr.task_tensors(bundles["global"], t, base),
        "EMR without rescalers": lambda t: emr.task_tensors(emr.EmrBundle(bundles["mean"].path, unit), t, base),
        **{m: (lambda t, d=d: {c: (w_pre[c] + d[c]).float() for c in shared}) for m, d in merged.items()},
    }
    tests = _test_sets(examples)
    tok = AutoTokenizer.from_pretrained(base_dir)
    acc: dict[str, dict[str, float]] = {}
    for method, weights in methods.items():
        acc[method] = {}
        for t, d in dirs.items():
            model = AutoModelForSequenceClassification.from_pretrained(d).eval()
            w = weights(t)
            if w is not None:
                model.load_state_dict(w, strict=False)  # the shared weights; the head stays the task's own
            acc[method][t] = examples_accuracy(model, tok, tests[t], max_len[t])
        acc[method]["average"] = statistics.mean(acc[method][t] for t in dirs)
    m = bundles["mean"]
    masks, heads = m.tensors(emr.MASKS_FILE), m.tensors(emr.HEADS_FILE)
    sizes = {}
    for k, task in enumerate(m.manifest.tasks):
        mask = sum(masks[n][k].numel() for n in masks)
        head = sum(heads[h].numel() * heads[h].element_size() for h in heads if h.startswith(f"{task.name}/"))
        full = dict(GROUP.tasks)[task.name]
        sizes[task.name] = {"mask_bytes": mask, "rescaler_bytes": 8, "head_bytes": head,
                            "bits_per_merged_weight": 8 * mask / m.manifest.merged_params,
                            "fmdelta_bytes": sum(f.bytes for f in store.variant(full).files),
                            "fp32_bytes": (dirs[task.name] / "model.safetensors").stat().st_size}
    sizes["tau_uni_bytes"] = (m.path / emr.TAU_FILE).stat().st_size
    sizes["merged_weights"] = m.manifest.merged_params
    sizes["examples"] = {t: len(v) for t, v in tests.items()}
    return acc, sizes


@torch.no_grad()
def timing_table(store, work: Path, rows: int, repeats: int) -> dict:
    from transformers import AutoModel

    rt = BaseModelRuntime(GROUP.base, store.base_dir(GROUP.base))
    entry = store.variant(GROUP.name)
    group = variant_kind("emr").load(store, entry, rt.view, torch.empty)
    members = list(group.members.values())  # topic, sentiment, spam
    who = [None, *members] * (rows // 4)  # base, then each task, round robin
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, rt.tokenizer.vocab_size, (rows, SEQ), generator=g)
    ids[:, 0], ids[:, -1] = rt.tokenizer.cls_token_id, rt.tokenizer.sep_token_id
    slots = [rt.attach(v) for v in who]
    plan = BatchPlan(slots, rt.device)
    dense = {m.name: AutoModel.from_pretrained(emr.extract(store.variant_dir(GROUP.name), m.name.split("/")[1],
                                                           work / f"dense-{m.index}", store.base_dir(GROUP.base)))
             .eval() for m in members}
    rows_of = {m.name: [i for i, v in enumerate(who) if v is m] for m in members}
    base_rows = [i for i, v in enumerate(who) if v is None]
    try:
        mixed = rt.call(plan, input_ids=ids).last_hidden_state
        for m in members:  # the mixed forward is each task's model, row for row, before anything is timed
            ref = dense[m.name](input_ids=ids[rows_of[m.name]]).last_hidden_state
            torch.testing.assert_close(mixed[rows_of[m.name]], ref, atol=1e-4, rtol=1e-4)
        base_plan = BatchPlan([BASE_ROW] * rows, rt.device)
        base_rows_plan = BatchPlan([BASE_ROW] * len(base_rows), rt.device)
        times = {
            "base alone": median_time(lambda: rt.call(base_plan, input_ids=ids), repeats, warmup=True),
            "EMR: 3 tasks + base, one forward": median_time(lambda: rt.call(plan, input_ids=ids), repeats, warmup=True),
            "EMR, formed every forward (none held)": _none_held(rt, lambda: median_time(
                lambda: rt.call(plan, input_ids=ids), repeats, warmup=True)),
            "EMR, masked delta only (no task formed)": _masked_only(lambda: median_time(
                lambda: rt.call(plan, input_ids=ids), repeats, warmup=True)),
            "dense: one forward a task + the base's": median_time(lambda: (
                rt.call(base_rows_plan, input_ids=ids[base_rows]),
                [dense[m.name](input_ids=ids[rows_of[m.name]]) for m in members]), repeats, warmup=True),
        }
        linears = {n: mod for n, mod in rt.view.modules.items() if isinstance(mod, torch.nn.Linear)}
        task_ids = torch.tensor([v.index if v is not None else -1 for v in who]).repeat_interleave(SEQ)
        scale = torch.tensor([m.scales["rescaler"] for m in members], dtype=torch.float32)
        weights = {f"{n}.weight": mod for n, mod in linears.items() if f"{n}.weight" in group.tensors}
        xs = {n: torch.randn(rows * SEQ, mod.in_features, generator=g) for n, mod in weights.items()}

        def deltas():
            for n, mod in weights.items():
                y = torch.zeros(rows * SEQ, mod.out_features)
                emr_delta_torch(xs[n], group.tensors[n], group.tensors[n + MASKS_SUFFIX], scale, task_ids, y)

        def unpacking():
            for n in weights:
                masks = group.tensors[n + MASKS_SUFFIX]
                masked(masks[task_ids[task_ids >= 0].unique()], group.tensors[n])

        times["of which emr_delta over every Linear"] = median_time(deltas, repeats, warmup=True)
        times["of which its unpacking of the masks"] = median_time(unpacking, repeats, warmup=True)
    finally:
        for s in slots:
            rt.detach(s)
    return {k: v * 1e3 for k, v in times.items()}


def _none_held(rt: BaseModelRuntime, measure):
    """measure() with no formed weights held between forwards (slots.emr_formed_mib 0): each forward forms its
    tasks' weights, as the first forward of a task does."""
    family = next(f for k, f in rt.families.items() if k.startswith("emr:"))
    saved = family.formed.budget
    family.formed.budget = 0
    family.formed.clear()
    try:
        return measure()
    finally:
        family.formed.budget = saved


def _masked_only(measure):
    """measure() with no task's weights formed (serve/engine/families/emr_slots.py DENSE_MIN_TOKENS): the masked delta
    for every EMR row, as served before tasks were formed."""
    saved = dict(emr_slots.DENSE_MIN_TOKENS)
    emr_slots.DENSE_MIN_TOKENS.update({k: None for k in saved})
    try:
        return measure()
    finally:
        emr_slots.DENSE_MIN_TOKENS.update(saved)


def run_emr_bench(out: Path, examples: int = 500, rows: int = 16, repeats: int = 5) -> dict:
    store = build_demo_store(log=lambda m: print(m, flush=True))
    with tempfile.TemporaryDirectory() as tmp:
        acc, sizes = accuracy_table(store, Path(tmp), examples)
        ms = timing_table(store, Path(tmp), rows, repeats)
    report = {"machine": machine(), "torch_threads": torch.get_num_threads(), "group": GROUP.name,
              "tasks": [t for t, _ in GROUP.tasks], "accuracy": acc, "bytes": sizes, "rows": rows, "tokens": SEQ,
              "forward_ms_median": ms, "repeats": repeats,
              "gpu": NO_GPU}
    return finish(report, out, print_report)


def print_report(r: dict) -> None:
    tasks = r["tasks"]
    print(f"\nEMR-Merging: {r['group']} on {r['machine']} ({r['torch_threads']} torch threads)")
    n = r["bytes"]["examples"]
    print(f"held-out accuracy ({', '.join(f'{t} {n[t]}' for t in tasks)} test examples)")
    print(f"{'method':<36}" + "".join(f"{t:>11}" for t in tasks) + f"{'average':>11}")
    for method, a in r["accuracy"].items():
        print(f"{method:<36}" + "".join(f"{100 * a[t]:>10.1f}%" for t in [*tasks, 'average']))
    ind, e = r["accuracy"]["individual fine-tunes"]["average"], r["accuracy"]["EMR (as served: mean rescalers)"]["average"]
    others = {m: a["average"] for m, a in r["accuracy"].items() if m.startswith(("task arithmetic", "TIES"))}
    print(f"EMR vs the individual fine-tunes: {100 * (e - ind):+.1f} points (the goal: within 2); vs "
          + ", ".join(f"{m.split(' (')[0]} {100 * (e - v):+.1f}" for m, v in others.items()) + " (the goal: +5)")
    b = r["bytes"]
    print(f"\nbytes per extra task (tau_uni once per group: {b['tau_uni_bytes'] / 1e6:.1f} MB over "
          f"{b['merged_weights']:,} merged weights)")
    print(f"{'task':<12}{'mask':>12}{'bits/weight':>12}{'head':>10}{'FM-Delta':>12}{'fp32':>12}")
    for t in tasks:
        s = b[t]
        print(f"{t:<12}{s['mask_bytes'] / 1e6:>10.2f}MB{s['bits_per_merged_weight']:>12.3f}{s['head_bytes']:>9}B"
              f"{s['fmdelta_bytes'] / 1e6:>10.1f}MB{s['fp32_bytes'] / 1e6:>10.1f}MB")
    print(f"\none forward, {r['rows']} rows x {r['tokens']} tokens (median of {r['repeats']}):")
    base = r["forward_ms_median"]["base alone"]
    for k, v in r["forward_ms_median"].items():
        print(f"  {k:<42}{v:>9.1f} ms{'' if k.startswith('of which') else f'{v / base:>8.2f}x base'}")
    print(f"GPU: {r['gpu']}")
