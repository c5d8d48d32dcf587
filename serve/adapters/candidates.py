"""Trans-LoRA's candidate inputs: the target base, shown the adapter's seed inputs (their shared frame cut away),
writes more like them, batch by batch at the schedule's temperatures (generation_schedule.py), and a judge (the
discriminator) keeps those it takes for real. translora.py says why each choice."""

import math
import os
import random
from collections.abc import Callable
from pathlib import Path

import torch

from serve.adapters.generation_schedule import BATCH, TEMPERATURES, AttemptPlan, Sampling, sample_inputs, shown_seeds
from serve.adapters.load import load_lm, on_device, writing_dtype

SEP = "###"


def input_frame(inputs: list[str]) -> tuple[str, str]:
    """(prefix, suffix) that every input has, each cut at whitespace so that no part of a word is taken
    ("Article: The ..." and "Article: Then ..." share "Article: "); the suffix is sought after the prefix."""
    prefix = os.path.commonprefix(inputs)
    prefix = prefix[: max((i + 1 for i, c in enumerate(prefix) if c.isspace()), default=0)]
    suffix = os.path.commonprefix([x[len(prefix):][::-1] for x in inputs])[::-1]
    suffix = suffix[next((i for i, c in enumerate(suffix) if c.isspace()), len(suffix)):]
    return prefix, suffix


def generation_prompt(parts: list[str], name: str) -> str:
    blocks = "".join(f"{SEP}\n{s.strip()}\n" for s in parts)
    return f"Examples of inputs from the {name} data set, one after each {SEP} line:\n{blocks}{SEP}\n"


class _StopAfter:
    """A transformers stopping criterion: a row is done once its continuation holds `stop` (decoded text, so it
    works whatever pieces the tokenizer writes it in)."""

    def __init__(self, tok, stop: str, prompt_len: int):
        self.tok, self.stop, self.prompt_len = tok, stop, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        texts = self.tok.batch_decode(input_ids[:, self.prompt_len:], skip_special_tokens=True)
        return torch.tensor([self.stop in t for t in texts], dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def generate(model, tok, prompts: list[str], max_new_tokens: int, temperature: float | None, seed: int,
              stop: str | None = None) -> list[str]:
    """Each prompt's continuation, sampled at `temperature` (greedy where None); with `stop`, a row ends once it
    has written it (the batch, once all have)."""
    torch.manual_seed(seed)
    enc = on_device(tok(prompts, return_tensors="pt", padding=True), model)
    kwargs = ({"do_sample": False} if temperature is None else
              {"do_sample": True, "temperature": temperature, "top_p": 0.95})
    if stop is not None:
        kwargs["stopping_criteria"] = [_StopAfter(tok, stop, enc["input_ids"].shape[1])]
    out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, **kwargs)
    return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def _longest(tok, texts: list[str]) -> int:
    return max(len(tok(t)["input_ids"]) for t in texts)


def generate_candidates(model, tok, seeds: list[str], name: str, count: int, seed: int,
                        temperatures: tuple[float, ...] = TEMPERATURES, batch: int = BATCH,
                        groups: list[list[int]] | None = None) -> list[str]:
    """`count` candidate inputs written by `model` after the seeds, in the seeds' frame ("" where it wrote
    nothing): batches take `temperatures` in turn, and each row's prompt shows its own subset of the seeds
    (generation_schedule.shown_seeds), of one group's seeds only where `groups` (label_groups) is given, the
    groups in turn; the same `seed` writes the same candidates."""
    prefix, suffix = input_frame(seeds)
    parts = [s[len(prefix): len(s) - len(suffix)] for s in seeds]
    max_new = max(8, int(1.5 * _longest(tok, parts)))
    out: list[str] = []
    for b in range(math.ceil(count / batch)):
        n = min(batch, count - len(out))
        rng = random.Random(seed + len(out))
        prompts = [generation_prompt(shown_seeds(parts, rng, groups[(seed + len(out) + i) % len(groups)]
                                                 if groups else None), name) for i in range(n)]
        texts = generate(model, tok, prompts, max_new, temperatures[b % len(temperatures)], seed + len(out),
                          stop=SEP)
        out += [f"{prefix}{t}{suffix}" if t else "" for t in (t.split(SEP)[0].strip() for t in texts)]
    return out


def synthetic_inputs(target_base: str | Path, judge: Callable[[list[str]], list[bool]] | None, seed_inputs: list[str],
                     name: str, plan: AttemptPlan, seed: int, tick: Callable[[str, int, int], None],
                     groups: list[list[int]] | None = None, out_of_time: Callable[[], bool] = lambda: False
                     ) -> Sampling:
    """The inputs the target base wrote after the seeds and `judge` (the discriminator's accepts) took (all that
    are fresh without one), batch by batch as generation_schedule plans, with every batch's fates. The target
    writes in bf16 where the CPU has it natively (load.writing_dtype): writing candidates is most of a transfer's
    time on a CPU."""
    target, tok = load_lm(target_base, dtype=writing_dtype())

    def write(n: int, temperature: float, at: int) -> list[str]:
        return generate_candidates(target, tok, seed_inputs, name, n, at, temperatures=(temperature,),
                                   groups=groups)

    return sample_inputs(write, judge or (lambda xs: [True] * len(xs)), plan, set(seed_inputs), seed,
                         lambda done, total: tick("writing inputs", done, total), out_of_time)
