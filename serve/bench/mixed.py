"""`manyfold bench mixed`: what one forward for rows of many variants costs, on SmolLM2-135M.

For 8 and 32 rows (64-token prompts), the prefill and one decode step (one new token a row over the prompt's
KV cache), side by side in one process:
  base              every row on the base
  8 adapters        8 distinct rank-16 LoRA adapters (all linear layers), rows round-robin, one forward
  one at a time     the same rows, one forward per adapter (each over its own rows): what serving a
                    variant per forward costs
  peft mixed        PEFT's own mixed-batch forward (`adapter_names=`), the same 8 adapters: the anchor
  8 top-2 full      8 full fine-tunes of the top two layers, rows round-robin, one forward (only the
                    two layers each changed run with its tensors)
Every mixed forward's logits are checked against the one-at-a-time forwards before anything is timed.
"""

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache

from serve.bench.fmdelta import machine
from serve.config import SlotsConfig
from serve.engine.batch import BASE_ROW, BatchPlan, RowSlot
from serve.engine.model import BaseModelRuntime
from serve.variants.base import LoadedVariant

ADAPTERS, RANK, PROMPT_TOKENS = 8, 16, 64
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(rt: BaseModelRuntime, n: int, rank: int, seed: int = 0) -> list[LoadedVariant]:
    """n rank-r adapters on every linear layer, with trained-looking magnitudes (A ~ 1/sqrt(in), B small)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        tensors, scales = {}, {}
        for name, m in rt.view.modules.items():
            if name.rsplit(".", 1)[-1] in LINEAR:
                out_f, in_f = m.weight.shape
                tensors[f"{name}.A"] = torch.randn(rank, in_f, generator=g) / in_f ** 0.5
                tensors[f"{name}.B"] = torch.randn(out_f, rank, generator=g) * 0.01
                scales[name] = 2.0
        out.append(LoadedVariant(f"adapter-{i}", "lora", "lora", tensors, scales))
    return out


def make_top2_finetunes(rt: BaseModelRuntime, n: int, seed: int = 0) -> list[LoadedVariant]:
    g = torch.Generator().manual_seed(seed)
    layers = rt.model.config.num_hidden_layers
    top = (f"layers.{layers - 2}.", f"layers.{layers - 1}.")
    out = []
    for i in range(n):
        tensors = {k: t + torch.randn(t.shape, generator=g) * 1e-3
                   for k, t in rt.view.tensors.items() if any(p in k for p in top)}
        out.append(LoadedVariant(f"top2-{i}", "full", "weights", tensors))
    return out


def peft_model(rt: BaseModelRuntime, adapters: list[LoadedVariant]):
    """The same adapters as a PEFT model on a copy of the base (PEFT wraps the modules it targets)."""
    import copy

    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(rt.model)  # its copied hooks see no plan outside rt.call: plain transformers
    model = None
    for v in adapters:
        cfg = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(LINEAR))
        model = get_peft_model(base, cfg, adapter_name=v.name) if model is None else model
        if v.name not in model.peft_config:
            model.add_adapter(v.name, cfg)
        state = {}
        for key, t in v.tensors.items():
            module, part = key.rsplit(".", 1)
            state[f"base_model.model.{module}.lora_{part}.{v.name}.weight"] = t
        missing = model.load_state_dict(state, strict=False)
        assert not missing.unexpected_keys, missing.unexpected_keys[:3]
    return model.eval()


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Forwards:
    """Prefill and decode-step closures over one set of rows, each row with its own variant slot."""

    def __init__(self, rt: BaseModelRuntime, ids: torch.Tensor, slots: list[RowSlot]):
        self.rt, self.ids, self.slots = rt, ids, slots
        self.plan = BatchPlan(slots, rt.device)
        with torch.no_grad():
            self.cache = DynamicCache()
            out = rt.call(self.plan, input_ids=ids, past_key_values=self.cache, use_cache=True)
        self.prefill_logits = out.logits[:, -1]
        self.next_ids = out.logits[:, -1:].argmax(-1)  # [rows, 1]

    @torch.no_grad()
    def prefill(self) -> torch.Tensor:
        return self.rt.call(self.plan, input_ids=self.ids, logits_to_keep=1).logits

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        out = self.rt.call(self.plan, input_ids=self.next_ids, past_key_values=self.cache, use_cache=True)
        self.cache.crop(-1)  # back to the prompt: every timed step is the same step
        return out.logits


def bench_rows(rt: BaseModelRuntime, rows: int, adapters: list[LoadedVariant], top2: list[LoadedVariant],
               peft, repeats: int) -> dict:
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, rt.model.config.vocab_size, (rows, PROMPT_TOKENS), generator=g)
    a_slots = [rt.attach(v) for v in adapters]
    f_slots = [rt.attach(v) for v in top2]
    try:
        base = Forwards(rt, ids, [BASE_ROW] * rows)
        mixed = Forwards(rt, ids, [a_slots[i % ADAPTERS] for i in range(rows)])
        singles = [Forwards(rt, ids[i::ADAPTERS], [a_slots[i]] * len(ids[i::ADAPTERS])) for i in range(ADAPTERS)]
        full = Forwards(rt, ids, [f_slots[i % ADAPTERS] for i in range(rows)])
        diff = max((mixed.prefill_logits[i::ADAPTERS] - s.prefill_logits).abs().max().item()
                   for i, s in enumerate(singles))
        names = [adapters[i % ADAPTERS].name for i in range(rows)]
        with torch.no_grad():
            peft_logits = peft(input_ids=ids, adapter_names=names).logits[:, -1]
        peft_diff = (peft_logits - mixed.prefill_logits).abs().max().item()

        def peft_prefill():
            with torch.no_grad():
                return peft(input_ids=ids, adapter_names=names, logits_to_keep=1)

        peft_cache = DynamicCache()
        with torch.no_grad():
            peft(input_ids=ids, adapter_names=names, past_key_values=peft_cache, use_cache=True)

        def peft_step():
            with torch.no_grad():
                out = peft(input_ids=mixed.next_ids, adapter_names=names, past_key_values=peft_cache, use_cache=True)
            peft_cache.crop(-1)
            return out

        result = {}
        for what, forwards in [("base", [base]), ("8 adapters", [mixed]), ("one at a time", singles),
                               ("8 top-2 full", [full])]:
            result[what] = {"prefill_s": timed(lambda: [f.prefill() for f in forwards], repeats),
                            "step_s": timed(lambda: [f.step() for f in forwards], repeats)}
        result["peft mixed"] = {"prefill_s": timed(peft_prefill, repeats), "step_s": timed(peft_step, repeats)}
        return {"rows": rows, "modes": result, "max_abs_diff_mixed_vs_single": diff,
                "max_abs_diff_peft_vs_mixed": peft_diff}
    finally:
        for s in a_slots + f_slots:
            rt.detach(s)


def run_mixed_bench(out: Path, rows: tuple[int, ...] = (8, 32), repeats: int = 5) -> dict:
    from serve.data.models import smollm2_dir

    torch.manual_seed(0)
    rt = BaseModelRuntime("smollm2", smollm2_dir(), slots=SlotsConfig(max_adapters=ADAPTERS))
    adapters = make_adapters(rt, ADAPTERS, RANK)
    top2 = make_top2_finetunes(rt, ADAPTERS)
    peft = peft_model(rt, adapters)
    results = [bench_rows(rt, n, adapters, top2, peft, repeats) for n in rows]
    report = {"machine": machine(), "model": "SmolLM2-135M-Instruct fp32", "adapters": ADAPTERS, "rank": RANK,
              "prompt_tokens": PROMPT_TOKENS, "repeats": repeats, "threads": torch.get_num_threads(),
              "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    return report


def print_table(report: dict) -> None:
    print(f"machine: {report['machine']}")
    print(f"{report['model']}, {report['prompt_tokens']}-token prompts, {report['adapters']} adapters of rank "
          f"{report['rank']} on every linear layer; medians of {report['repeats']}")
    print(f"{'rows':>4} {'mode':<15} {'prefill s':>10} {'x base':>7} {'step ms':>9} {'x base':>7}")
    for r in report["results"]:
        base = r["modes"]["base"]
        for mode, m in r["modes"].items():
            print(f"{r['rows']:>4} {mode:<15} {m['prefill_s']:>10.3f} {m['prefill_s'] / base['prefill_s']:>7.2f} "
                  f"{1e3 * m['step_s']:>9.1f} {m['step_s'] / base['step_s']:>7.2f}")
        print(f"     max |logit diff|: mixed vs one at a time {r['max_abs_diff_mixed_vs_single']:.1e}, "
              f"PEFT vs mixed {r['max_abs_diff_peft_vs_mixed']:.1e}")
