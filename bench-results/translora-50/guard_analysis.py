"""Would a paired test on the labels' log-loss have decided where the guard's accuracy could not? (issue 50)

For each transfer below, on the 32 validation examples the guard reads: every model's choice loss per example
(-log of the true label's share among the labels, each label scored as validation.score scores it), and the mean
paired lead of a model over the target alone and over the labels' frequencies (a model that knows only how often
each label comes), with its standard error. Reads a `manyfold bench translora --work DIR` after the runs of
bench-results/README.md's "The other shapes" section:

    PYTHONPATH=. python bench-results/translora-50/guard_analysis.py --work DIR
"""

import argparse
import math
from collections import Counter

import torch

from serve.adapters.data import PromptExample
from serve.adapters.load import load_lm
from serve.adapters.validation import completion_nll, labels_of, read_validation

CELLS = (("sentiment", 0, "deeper-5"), ("spam", 1, "deeper-5"), ("spam", 2, "deeper-5"), ("topics", 0, "deeper-5"))


def choice_losses(model, tok, held, labels) -> list[float]:
    n = len(labels)
    options = [PromptExample(prompt=e.prompt, completion=label) for e in held for label in labels]
    sums, _, ends = completion_nll(model, tok, options)
    out = []
    for i, e in enumerate(held):
        nll = torch.tensor([sums[i * n + j] - ends[i * n + j] for j in range(n)])
        out.append(float(nll[labels.index(e.completion)] + torch.logsumexp(-nll, 0)))
    return out


def lead(ref: list[float], model: list[float]) -> str:
    d = [r - m for r, m in zip(ref, model)]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
    return f"{mean:+.3f} (se {se:.3f}, z {mean / se:.2f})"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    work = p.parse_args().work
    print(f"{'transfer':28} {'model':10} {'choice loss':>11}  {'lead over the target alone':>28}  "
          f"{'lead over the label frequencies':>32}")
    for task, seed, target in CELLS:
        held = read_validation(f"{work}/{task}-s{seed}-source")
        labels = labels_of(held)
        counts = Counter(e.completion for e in held)
        prior = [-math.log(counts[e.completion] / len(held)) for e in held]
        scores = {}
        for who, adapter in (("alone", None), ("student", f"{work}/{target}-{task}-s{seed}-filtered"),
                             ("real", f"{work}/{target}-{task}-s{seed}-real")):
            model, tok = load_lm(f"{work}/smollm2-{target}", adapter)
            scores[who] = choice_losses(model, tok, held, labels)
            del model
        name = f"{task} s{seed} {target}"
        print(f"{name:28} {'frequencies':10} {sum(prior) / len(prior):11.3f}")
        print(f"{name:28} {'alone':10} {sum(scores['alone']) / len(held):11.3f}")
        for who in ("student", "real"):
            print(f"{name:28} {who:10} {sum(scores[who]) / len(held):11.3f}  {lead(scores['alone'], scores[who]):>28}"
                  f"  {lead(prior, scores[who]):>32}", flush=True)


if __name__ == "__main__":
    main()
