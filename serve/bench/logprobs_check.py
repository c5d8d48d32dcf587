"""`manyfold bench logprobs`: the engine's log probabilities for every kind against a reference that runs no engine.

For each kind (the base, LoRA on all seven linears at mixed ranks, PiSSA, a full fine-tune, EMR tasks, a NeuZip
base lossless and lossy) rows generate greedily in one batch through the engine (prompts through its prefill,
tokens through its decode steps: on CUDA the graphed ones), each token with its top 5 log probabilities. The
reference is transformers in fp32 with the variant's weights: the adapter merged by PEFT, the fine-tune's own
directory, the EMR task as `emr extract` writes it, the NeuZip base as it decodes; it reads each row's prompt and
the engine's tokens teacher-forced, in one forward. The rule is vLLM's `check_logprobs_close`: wherever the greedy
tokens differ, each is in the other's top 5; beside it, the largest difference of log probability on the
reference's token where the engine's top 5 hold it, per kind.

The model's logits must not sit near ties, or any rounding picks another token: the check's base is a model
built from its config whose final norm is scaled (by LOGIT_SCALE), so that its top tokens stand apart, and whose
tokenizer maps each token to one word (tokens are compared by id).
"""

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from serve.bench.engine_models import ALL_LINEARS, build_model_dir, module_dims, write_adapter
from serve.bench.engine_traffic import write_top2_finetune

TOP = 5
LOGIT_SCALE = 16.0
"""The final norm's weight is multiplied by this: a random model's logits (std about 0.5) then spread to about
8, and its top token stands clear of the next."""
FINETUNE_SCALE = 0.3
"""The check's fine-tunes move their top two layers by this share of each tensor's spread: far enough that a kind
applied wrongly, or not at all, would leave the reference's top tokens (its `shift` says how far it moved)."""
MIXED_RANKS = {"q_proj": 16, "down_proj": 64}
"""rank_pattern of the mixed-rank adapter (rank 8 elsewhere)."""


@dataclass
class KindCheck:
    kind: str
    model: str
    positions: int = 0
    mismatches: int = 0
    """Positions whose greedy tokens differ (each must sit in the other's top 5)."""
    failures: int = 0
    """Mismatches where one token is not in the other's top 5."""
    max_abs_diff: float = 0.0
    """The largest |engine - reference| log probability of the reference's token, where the engine's top 5 hold it."""
    max_abs_diff_top5: float = 0.0
    """The same over every token of the engine's top 5 (the likeliest token's log probability is near 0 for both
    where the model is sure; the others show the rounding)."""
    shift: float = 0.0
    """The largest |reference - the base's reference| log probability over the vocabulary at the same positions:
    how far the kind moves the model, against which max_abs_diff is small or the check tells nothing."""

    @property
    def passed(self) -> bool:
        return self.positions > 0 and self.failures == 0


def scaled_base(shape: str, out: Path, device: torch.device) -> Path:
    """The check's base: `shape` from its config, bf16, the final norm scaled by LOGIT_SCALE."""
    from safetensors.torch import load_file, save_file

    d = build_model_dir(shape, out, device)
    marker = d / "scaled.json"
    if not marker.exists():
        f = d / "model.safetensors"
        tensors = load_file(f)
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * LOGIT_SCALE
        save_file(tensors, f, metadata={"format": "pt"})
        marker.write_text(json.dumps({"logit_scale": LOGIT_SCALE}))
    return d


def write_mixed_rank_adapter(model_dir: Path, out: Path, seed: int) -> Path:
    """A PEFT LoRA on all seven linears of every layer, rank 8 with MIXED_RANKS where it names the module."""
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    if (out / "adapter_config.json").exists():
        return out
    dims = module_dims(model_dir, ALL_LINEARS)
    tensors = {}
    for k, rank in enumerate((8, *sorted(set(MIXED_RANKS.values())))):
        part = write_adapter(out / f"part-{rank}", {m: d for m, d in dims.items()
                                                    if MIXED_RANKS.get(m.rsplit(".", 1)[1], 8) == rank},
                             rank, seed + k)
        tensors.update(load_file(part / "adapter_model.safetensors"))
    LoraConfig(r=8, lora_alpha=16, target_modules=list(ALL_LINEARS), rank_pattern=MIXED_RANKS,
               alpha_pattern={m: 2 * r for m, r in MIXED_RANKS.items()}, task_type="CAUSAL_LM").save_pretrained(out)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return out


def check_store(model_dir: Path, work: Path) -> tuple[Path, dict[str, tuple[str, Path, Path | None]]]:
    """The store every kind is served from (built once under `work`) -> (its root, model -> (kind, the reference's
    model directory, the PEFT adapter merged into it or None))."""
    from serve.adapters.data import TextExample
    from serve.adapters.train import train_adapter
    from serve.codecs import emr
    from serve.codecs.neuzip_file import add_base, compress_dir, decompress_dir
    from serve.store.store import Store
    from serve.variants import variant_kind

    refs: dict[str, tuple[str, Path, Path | None]] = {"base": ("base", model_dir, None)}
    adapter = write_mixed_rank_adapter(model_dir, work / "lora-mixed", 1)
    refs["lora-mixed"] = ("lora, all seven linears, ranks 8/16/64", model_dir, adapter)
    pissa = work / "pissa"  # what `manyfold adapter train` writes: its converted (rank-2r LoRA) form
    refs["pissa"] = ("pissa (converted, rank 2 x 4)", model_dir, pissa)
    refs["full"] = ("full (top two layers)", write_top2_finetune(model_dir, work / "full", 3, FINETUNE_SCALE), None)
    tasks = {f"t{k}": write_top2_finetune(model_dir, work / f"task-{k}", 20 + k, FINETUNE_SCALE) for k in range(3)}
    bundle = work / "emr-bundle"
    for t in tasks:
        refs[f"emr/{t}"] = (f"emr task {t}", work / f"emr-{t}", None)
    refs["nz7"] = ("neuzip lossless (k=7)", model_dir, None)
    refs["nz3"] = ("neuzip lossy (k=3)", work / "nz3-decoded", None)
    root = work / "store"
    if (root / "manifest.json").exists():
        return root, refs
    store = Store(root, create=True)
    store.add_base("base", model_dir)
    variant_kind("lora").add(store, "lora-mixed", "base", adapter)
    words = " ".join(f"w{i}" for i in range(3, 40))
    train_adapter(model_dir, [TextExample(text=words)] * 4, pissa, init="pissa", rank=4, steps=2, lr=5e-2,
                  batch_size=2, max_length=32, target_modules=list(ALL_LINEARS))
    variant_kind("pissa").add(store, "pissa", "base", pissa)
    variant_kind("full").add(store, "full", "base", refs["full"][1])
    variant_kind("emr").add(store, "emr", "base", emr.merge(model_dir, tasks, bundle).path)
    for t in tasks:
        emr.extract(bundle, t, work / f"emr-{t}", model_dir)
    for bits in (7, 3):
        add_base(store, f"nz{bits}", model_dir, bits)
    nz3 = work / "nz3-coded"
    compress_dir(model_dir, 3, nz3)
    decompress_dir(nz3, refs["nz3"][1])
    return root, refs


def engine_generations(store_root: Path, device: torch.device, models: list[str], prompts: list[list[int]],
                       new_tokens: int) -> tuple[dict[str, list[tuple[list[int], list[dict[int, float]]]]], dict]:
    """Every (model, prompt) row at once through one Engine, greedy -> (model -> per prompt (its tokens, each
    token's top 5 as {id: log probability}), each base's steps by how they ran)."""
    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.engine.types import SamplingParams

    engine = Engine(ServeConfig(store=store_root, device=str(device), batch={"max_batch_size": 64},
                                slots={"adapter_mib": 1024, "weights_mib": 2048}))
    for rt in engine.bases.values():
        rt.eos_ids = set()
    tokenizer = next(iter(engine.bases.values())).tokenizer
    params = SamplingParams(max_tokens=new_tokens, logprobs=TOP)

    async def everything():
        rows = [(m, p) for m in models for p in prompts]
        gens = await asyncio.gather(*(engine.complete(m, params, prompt=p) for m, p in rows))
        await engine.drain(5)
        return rows, gens

    rows, gens = asyncio.run(everything())
    out: dict[str, list] = {m: [] for m in models}
    for (m, _), g in zip(rows, gens):
        tops = [{_word_id(tokenizer, text): lp for text, lp in lp_.top} for lp_ in g.logprobs]
        out[m].append((g.token_ids, tops))
    steps = {name: dict(rt.step_counts) for name, rt in engine.bases.items()}
    return out, steps


def _word_id(tokenizer, piece: str) -> int:
    """A word-level tokenizer's id of a token's text (a piece may carry the space before it)."""
    return tokenizer.convert_tokens_to_ids(piece.strip())


@torch.no_grad()
def reference_logprobs(model_dir: Path, adapter: Path | None, device: torch.device, sequences: list[list[int]]
                       ) -> list[torch.Tensor]:
    """Each sequence through transformers in fp32 (the adapter merged by PEFT): [len, vocab] log probabilities of
    the token after each position."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    out = []
    for seq in sequences:
        logits = model(input_ids=torch.tensor([seq], device=device)).logits[0].float()
        out.append(torch.log_softmax(logits, -1).cpu())
    del model
    return out


def compare(kind: str, model: str, prompts: list[list[int]], generations: list, reference: list[torch.Tensor],
            base: list[torch.Tensor] | None = None) -> KindCheck:
    """check_logprobs_close over every generated position of every row; base: the base's reference over the same
    sequences (for the kind's shift)."""
    check = KindCheck(kind, model)
    for i, (prompt, (tokens, tops), ref) in enumerate(zip(prompts, generations, reference)):
        if base is not None:
            check.shift = max(check.shift, float((ref[len(prompt) - 1:] - base[i][len(prompt) - 1:]).abs().max()))
        for j, (tok, top) in enumerate(zip(tokens, tops)):
            lp = ref[len(prompt) - 1 + j]  # [vocab]: the reference's prediction of this position
            ref_top = lp.topk(TOP).indices.tolist()
            check.positions += 1
            if ref_top[0] != tok:
                check.mismatches += 1
                if tok not in ref_top or ref_top[0] not in top:
                    check.failures += 1
            if ref_top[0] in top:
                check.max_abs_diff = max(check.max_abs_diff, abs(top[ref_top[0]] - float(lp[ref_top[0]])))
            check.max_abs_diff_top5 = max([check.max_abs_diff_top5] + [abs(v - float(lp[t])) for t, v in top.items()])
    return check


def run_logprobs_check(out: Path, work: Path, device: str = "cpu", shape: str = "smollm2-135m", rows: int = 4,
                       prompt_tokens: int = 24, new_tokens: int = 16) -> dict:
    from serve.bench.engine import device_name
    from serve.bench.report import finish

    dev = torch.device(device)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = scaled_base(shape, work / shape, dev)
    store_root, refs = check_store(model_dir, work)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_tokens + 3 * i,), generator=g).tolist() for i in range(rows)]
    generated, steps = engine_generations(store_root, dev, list(refs), prompts, new_tokens)
    checks = []
    for model, (kind, ref_dir, adapter) in refs.items():
        sequences = [p + tokens for p, (tokens, _) in zip(prompts, generated[model])]
        reference = reference_logprobs(ref_dir, adapter, dev, sequences)
        base = reference_logprobs(model_dir, None, dev, sequences) if model != "base" else None
        checks.append(compare(kind, model, prompts, generated[model], reference, base))
    report = {"machine": device_name(dev), "device": device, "shape": shape, "logit_scale": LOGIT_SCALE,
              "rows_per_kind": rows, "new_tokens": new_tokens, "steps": steps,
              "kinds": [dict(vars(c), passed=c.passed) for c in checks], "passed": all(c.passed for c in checks)}
    return finish(report, out, print_check)


def print_check(report: dict) -> None:
    print(f"\nlog probabilities against transformers in fp32 ({report['shape']}, final norm x{report['logit_scale']:g}) "
          f"on {report['machine']}; {report['rows_per_kind']} rows a kind, {report['new_tokens']} greedy tokens each, "
          f"every kind in one batch")
    print(f"{'kind':<42}{'positions':>10}{'greedy differ':>15}{'outside top 5':>15}{'max |dlogprob|':>16}"
          f"{'over top 5':>12}{'its shift':>11}  verdict")
    for k in report["kinds"]:
        print(f"{k['kind']:<42}{k['positions']:>10}{k['mismatches']:>15}{k['failures']:>15}{k['max_abs_diff']:>16.4f}"
              f"{k['max_abs_diff_top5']:>12.4f}{k['shift']:>11.2f}  {'pass' if k['passed'] else 'FAIL'}")
    print("max |dlogprob|: engine against reference on the reference's token (over top 5: on each of the engine's "
          "top 5); its shift: how far the kind moves the base's log probabilities (the reference against the base's)")
    print(f"steps: {report['steps']}")
