"""What a Trans-LoRA student learns and where it starts (serve/adapters/distill.py, translora._student_start): the
teacher's distributions where the two bases number tokens alike, and the source adapter as its start where it fits
the target; the completions alone and a fresh init otherwise, each said in the report."""

import pytest
import torch
from safetensors.torch import load_file

from serve.adapters import translora
from serve.adapters.data import IGNORE, collate, tokenize_examples
from serve.adapters.distill import Distillation, Teacher, kd_loss
from serve.adapters.load import load_lm
from serve.adapters.student_start import FROM_SOURCE
from serve.adapters.train import train_adapter
from serve.errors import ConfigError
from serve.variants.lora import ADAPTER_WEIGHTS
from tests.adapters import toy_task
from tests.models import write_tiny_causal, write_tiny_gpt2


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The source, a target of its shapes and tokenizer (other weights), one of another tokenizer."""
    tmp = tmp_path_factory.mktemp("distill")
    return write_tiny_causal(tmp / "source"), write_tiny_causal(tmp / "same", seed=1), write_tiny_gpt2(tmp / "gpt2")


@pytest.fixture(scope="module")
def source_adapter(bases, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapter") / "toy"
    train_adapter(bases[0], toy_task(), out, init="pissa", rank=4, steps=8, lr=5e-3, progress=lambda *_: None)
    translora.train_discriminator(bases[0], out, toy_task(), "toy", steps=2)
    return out


def test_the_kd_term_is_zero_on_the_teachers_own_logits_and_reads_only_completion_positions():
    g = torch.Generator().manual_seed(0)
    teacher, student = torch.randn(2, 6, 11, generator=g), torch.randn(2, 6, 11, generator=g)
    labels = torch.full((2, 6), IGNORE)
    labels[:, 3:] = 1  # positions 2.. predict a completion token
    assert kd_loss(teacher, teacher, labels, 2.0).item() == pytest.approx(0.0, abs=1e-6)
    moved = student.clone()
    moved[:, :2] += 100.0  # the prompt's positions, and the last one (it predicts nothing)
    moved[:, -1] -= 50.0
    assert kd_loss(moved, teacher, labels, 2.0) == kd_loss(student, teacher, labels, 2.0) > 0
    with pytest.raises(ConfigError):
        Distillation(temperature=0)


def test_a_student_distilled_is_closer_to_the_teachers_distribution_than_one_taught_its_completions(
        bases, source_adapter, tmp_path):
    """The same start, data, steps and rate: the KL term moves the student's distributions towards the
    teacher's where the completions alone only tell it the teacher's first choice."""
    data = list(translora.teach(bases[0], source_adapter, translora.read_assets(source_adapter)[0],
                                [e.prompt for e in toy_task(16, seed=3)], 0, lambda *_: None).values())
    teacher = Teacher(bases[0], source_adapter, Distillation(temperature=1.0, weight=1.0))
    model, tok = load_lm(bases[1])
    batch = collate(tokenize_examples(tok, data, 64), tok.pad_token_id)

    def kl_after(loss_of) -> float:
        out = tmp_path / ("kd" if loss_of else "ce")
        train_adapter(bases[1], data, out, init="lora", rank=4, steps=60, lr=1e-2, progress=lambda *_: None,
                      loss_of=loss_of)
        student, _ = load_lm(bases[1], out)
        with torch.no_grad():
            return kd_loss(student(**batch).logits, teacher.model(**batch).logits, batch["labels"], 1.0).item()

    kd, ce = kl_after(teacher.loss), kl_after(None)
    assert kd < ce, (kd, ce)


def test_a_transfer_to_the_same_tokens_and_shapes_distils_and_starts_from_the_source_adapter(
        bases, source_adapter, tmp_path, monkeypatch):
    monkeypatch.setattr(translora, "choose", lambda comparison, keep_unchanged: "student")  # the guard: elsewhere
    source = load_file(source_adapter / ADAPTER_WEIGHTS)
    report = translora.transfer(bases[0], source_adapter, bases[1], tmp_path / "moved", samples=4, max_attempts=48,
                                steps=1, lr=1e-9, use_filter=False)
    assert report.distilled.startswith("distribution") and report.started_from == FROM_SOURCE
    student = load_file(tmp_path / "moved" / ADAPTER_WEIGHTS)
    assert report.rank == 8 and student.keys() == source.keys()  # the converted PiSSA source: rank 2r
    assert all(torch.allclose(student[k], source[k], atol=1e-6) for k in source)  # one step at 1e-9 from it

    fresh = translora.transfer(bases[0], source_adapter, bases[1], tmp_path / "fresh", samples=4, max_attempts=48,
                               steps=1, use_filter=False, distillation=None, start_from_source=False, init="lora")
    assert fresh.distilled.startswith("sequence") and fresh.started_from == "lora" and fresh.rank == 4


def test_a_transfer_across_tokenizers_learns_the_completions_from_a_fresh_init_and_says_why(
        bases, source_adapter, tmp_path, monkeypatch):
    monkeypatch.setattr(translora, "choose", lambda comparison, keep_unchanged: "student")
    report = translora.transfer(bases[0], source_adapter, bases[2], tmp_path / "moved", samples=4, max_attempts=48,
                                steps=1, use_filter=False)
    assert report.distilled == "sequence (the completions alone: the two bases' tokenizers differ)"
    assert report.started_from.startswith("pissa (the source adapter does not fit the target: the two bases'")
