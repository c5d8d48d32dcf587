"""`manyfold bench mixed`: what one forward for rows of many variants costs, on SmolLM2-135M.

For 8 and 32 rows (64-token prompts), the prefill and one decode step (one new token a row over the prompt's
KV cache), side by side in one process, for two adapter sets: LoRA on q_proj and v_proj (PEFT's default targets
for Llama) and on every linear layer (PiSSA's usual choice, 5x the adapter bytes):
  base              every row on the base
  8 adapters        8 distinct rank-16 LoRA adapters, rows round-robin, one forward
  one at a time     the same rows, one forward per adapter (each over its own rows): what serving a
                    variant per forward costs
  peft mixed        PEFT's own mixed-batch forward (`adapter_names=`), the same 8 adapters: the anchor
  8 top-2 full      8 full fine-tunes of the top two layers, rows round-robin, one forward (only the
                    two layers each changed run with its tensors)
Every mixed forward's logits are checked against the one-at-a-time forwards, and PEFT's, before anything is
timed; the change the adapters make to the logits is reported beside them.
"""

import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from serve.bench.report import finish, machine
from serve.engine.step.batch import BASE_ROW, BatchPlan, RowSlot
from serve.engine.model import BaseModelRuntime
from serve.variants.base import LoadedVariant

ADAPTERS, RANK, PROMPT_TOKENS, PREFILL_REPEATS = 8, 16, 64, 3
TARGETS = {"q,v": ("q_proj", "v_proj"),
           "all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}


def make_adapters(rt: BaseModelRuntime, n: int, rank: int, targets: tuple[str, ...], seed: int = 0
                  ) -> list[LoadedVariant]:
    """n rank-r adapters on the target layers, with trained-looking magnitudes (A ~ 1/sqrt(in), B small)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        tensors, scales = {}, {}
        for name, m in rt.view.modules.items():
            if name.rsplit(".", 1)[-1] in targets:
                out_f, in_f = m.weight.shape
                tensors[f"{name}.A"] = torch.randn(rank, in_f, generator=g) / in_f ** 0.5
                tensors[f"{name}.B"] = torch.randn(out_f, rank, generator=g) * 0.01
                scales[name] = 2.0
        out.append(LoadedVariant(f"adapter-{'-'.join(targets)}-{i}", "lora", "lora", tensors, scales))
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


def peft_model(model_dir, adapters: list[LoadedVariant], targets: tuple[str, ...]):
    """The same adapters as a PEFT model on the base as transformers loads it (PEFT wraps the modules it targets;
    the runtime's own modules are already wrapped by the engine)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model = None
    for v in adapters:
        cfg = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(targets))
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


def bench_rows(rt: BaseModelRuntime, rows: int, adapter_sets: dict[str, tuple[list[LoadedVariant], object]],
               top2: list[LoadedVariant], repeats: int) -> dict:
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, rt.model.config.vocab_size, (rows, PROMPT_TOKENS), generator=g)
    base = Forwards(rt, ids, [BASE_ROW] * rows)
    modes, checks, held = {"base": [base]}, {}, []
    for label, (adapters, peft) in adapter_sets.items():
        slots = [rt.attach(v) for v in adapters]
        held += slots
        mixed = Forwards(rt, ids, [slots[i % ADAPTERS] for i in range(rows)])
        singles = [Forwards(rt, ids[i::ADAPTERS], [slots[i]] * len(ids[i::ADAPTERS])) for i in range(ADAPTERS)]
        names = [adapters[i % ADAPTERS].name for i in range(rows)]
        with torch.no_grad():
            peft_logits = peft(input_ids=ids, adapter_names=names).logits[:, -1]
        checks[label] = {
            "max_abs_diff_mixed_vs_single": max((mixed.prefill_logits[i::ADAPTERS] - s.prefill_logits).abs().max().item()
                                                for i, s in enumerate(singles)),
            "max_abs_diff_peft_vs_mixed": (peft_logits - mixed.prefill_logits).abs().max().item(),
            "max_abs_change_vs_base": (mixed.prefill_logits - base.prefill_logits).abs().max().item()}
        modes[f"8 adapters {label}"] = [mixed]
        modes[f"one at a time {label}"] = singles
        modes[f"peft mixed {label}"] = [PeftForwards(peft, ids, names, mixed.next_ids)]
    slots = [rt.attach(v) for v in top2]
    held += slots
    modes["8 top-2 full"] = [Forwards(rt, ids, [slots[i % ADAPTERS] for i in range(rows)])]
    try:
        timings = {m: {"prefill_s": t} for m, t in time_modes(modes, "prefill", PREFILL_REPEATS).items()}
        for m, t in time_modes(modes, "step", repeats).items():
            timings[m]["step_s"] = t
    finally:
        for s in held:
            rt.detach(s)
    return {"rows": rows, "modes": timings, "checks": checks}


def time_modes(modes: dict[str, list], what: str, repeats: int) -> dict[str, float]:
    """Median seconds of each mode's `what` (prefill or step, over all its forwards), the modes taking turns
    repeat by repeat, so that a busy moment on a shared machine falls on all of them alike."""
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(repeats + 1):
        for mode, forwards in modes.items():
            t0 = time.perf_counter()
            for f in forwards:
                getattr(f, what)()
            if r:  # the first round warms up
                times[mode].append(time.perf_counter() - t0)
    return {m: statistics.median(t) for m, t in times.items()}


class PeftForwards:
    """PEFT's mixed-batch forward over the same rows: prefill, and one decode step over the prompt's cache."""

    def __init__(self, peft, ids: torch.Tensor, names: list[str], next_ids: torch.Tensor):
        self.peft, self.ids, self.names, self.next_ids = peft, ids, names, next_ids
        self.cache = DynamicCache()
        with torch.no_grad():
            peft(input_ids=ids, adapter_names=names, past_key_values=self.cache, use_cache=True)

    @torch.no_grad()
    def prefill(self):
        return self.peft(input_ids=self.ids, adapter_names=self.names, logits_to_keep=1)

    @torch.no_grad()
    def step(self):
        out = self.peft(input_ids=self.next_ids, adapter_names=self.names, past_key_values=self.cache, use_cache=True)
        self.cache.crop(-1)
        return out


def run_mixed_bench(out: Path, rows: tuple[int, ...] = (8, 32), repeats: int = 5) -> dict:
    from serve.data.models import smollm2_dir

    torch.manual_seed(0)
    rt = BaseModelRuntime("smollm2", smollm2_dir())
    adapter_sets = {}
    for i, (label, targets) in enumerate(TARGETS.items()):
        adapters = make_adapters(rt, ADAPTERS, RANK, targets, seed=i)
        adapter_sets[label] = (adapters, peft_model(smollm2_dir(), adapters, targets))
    top2 = make_top2_finetunes(rt, ADAPTERS)
    results = [bench_rows(rt, n, adapter_sets, top2, repeats) for n in rows]
    report = {"machine": machine(), "model": "SmolLM2-135M-Instruct fp32", "adapters": ADAPTERS, "rank": RANK,
              "targets": {k: list(v) for k, v in TARGETS.items()}, "prompt_tokens": PROMPT_TOKENS,
              "repeats": {"step": repeats, "prefill": PREFILL_REPEATS}, "threads": torch.get_num_threads(),
              "results": results}
    return finish(report, out, print_table)


def print_table(report: dict) -> None:
    print(f"machine: {report['machine']}; torch threads {report['threads']}")
    print(f"{report['model']}, {report['prompt_tokens']}-token prompts, {report['adapters']} LoRA adapters of rank "
          f"{report['rank']} on q,v or on all linear layers; medians of {report['repeats']['prefill']} prefills "
          f"and {report['repeats']['step']} decode steps, the modes taking turns")
    print(f"{'rows':>4} {'mode':<18} {'prefill s':>10} {'x base':>7} {'step ms':>9} {'x base':>7}")
    for r in report["results"]:
        base = r["modes"]["base"]
        for mode, m in r["modes"].items():
            print(f"{r['rows']:>4} {mode:<18} {m['prefill_s']:>10.3f} {m['prefill_s'] / base['prefill_s']:>7.2f} "
                  f"{1e3 * m['step_s']:>9.1f} {m['step_s'] / base['step_s']:>7.2f}")
        for label, c in r["checks"].items():
            print(f"     {label}: max |logit diff| mixed vs one at a time {c['max_abs_diff_mixed_vs_single']:.1e}, "
                  f"PEFT vs mixed {c['max_abs_diff_peft_vs_mixed']:.1e}; adapters change logits by up to "
                  f"{c['max_abs_change_vs_base']:.2f}")
