"""What a Trans-LoRA student learns from its teacher (the source base with the adapter): where the two bases
number tokens alike, the teacher's whole next-token distribution at every position of the synthetic examples'
completions (knowledge distillation: a KL term at a temperature), beside the sampled completions themselves;
where they do not, the completions alone (sequence-level), as before.

A completion the teacher sampled greedily says which token it ranked first; the distribution also says how
sure it was and what it would have said instead, which is what the adapter learnt and the target alone lacks.
The teacher runs beside the student during training, on the very batch the student sees (same token ids), so
nothing of vocabulary size is stored per example.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from serve.adapters.data import IGNORE
from serve.adapters.load import load_lm
from serve.errors import ConfigError

KD_TEMPERATURE = 2.0
"""Both distributions softened by this before the KL (Hinton et al.): chosen by `manyfold bench translora
--ablation`'s temperature rows (2 best on tweets; 1 better on headlines by less than the spread over seeds:
bench-results/translora-36-ablation.json)."""
KD_WEIGHT = 0.5
"""The KL term's share of the loss; the rest is the cross-entropy of the sampled completions."""


def same_tokens(source_base: str | Path, target_base: str | Path) -> str | None:
    """Why the teacher's distributions cannot be read position by position against the student's (None where
    they can): the two tokenizers must number every token alike and the two models score the same vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    if AutoTokenizer.from_pretrained(source_base).get_vocab() != AutoTokenizer.from_pretrained(target_base).get_vocab():
        return "the two bases' tokenizers differ"
    sizes = [AutoConfig.from_pretrained(b).vocab_size for b in (source_base, target_base)]
    if sizes[0] != sizes[1]:
        return f"the two bases score {sizes[0]} and {sizes[1]} tokens"
    return None


@dataclass(frozen=True)
class Distillation:
    temperature: float = KD_TEMPERATURE
    weight: float = KD_WEIGHT

    def __post_init__(self):
        if self.temperature <= 0 or not 0 <= self.weight <= 1:
            raise ConfigError(f"a distillation needs temperature > 0 and 0 <= weight <= 1; got {self}")


class Teacher:
    """The source base with the adapter merged in (a plain model: one matmul per linear, as the student's base),
    frozen; its logits on the student's batches."""

    def __init__(self, source_base: str | Path, adapter_dir: str | Path, distillation: Distillation):
        model, _ = load_lm(source_base, adapter_dir)
        self.model = model.merge_and_unload().eval()
        self.distillation = distillation

    def loss(self, student, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The student's loss on a batch: (1 - w) cross-entropy of the completions + w T^2 KL(teacher || student)
        at temperature T over the completions' positions (T^2 keeps the gradients' scale as T changes)."""
        out = student(**batch)
        with torch.no_grad():
            teacher = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        d = self.distillation
        kl = kd_loss(out.logits, teacher, batch["labels"], d.temperature)
        return (1 - d.weight) * out.loss + d.weight * kl


def kd_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 KL(softmax(teacher / T) || softmax(student / T)), averaged over the positions that predict a label
    (the logits at t predict the token at t + 1): [batch, seq, vocab] x 2, [batch, seq] -> a scalar."""
    scored = labels[:, 1:] != IGNORE
    s = student[:, :-1][scored].float() / temperature
    t = teacher[:, :-1][scored].float() / temperature
    if not len(s):
        return student.sum() * 0.0
    kl = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="batchmean")
    return kl * temperature ** 2
