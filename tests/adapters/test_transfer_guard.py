"""The guard on every Trans-LoRA transfer, both ways, through the commands a user runs: a student that beats the
target alone on the validation set is registered; one that does not is refused by name and nothing is
registered; where the source adapter applied unchanged fits and the student does not beat it, the source adapter
is registered unchanged (--always-student: the student wherever it beats the target alone).

The source is a tiny Llama with a LoRA that learnt a copying task; the target a perturbed copy of it (same
tokenizer and shapes, so the unchanged adapter fits). A student that learnt nothing is made with lr 0; one that
learns is taught by a teacher that knows the task's rule. The comparison itself always runs for real. The task's
completions are free text, so the guard compares losses; where they are labels it compares accuracies first
(tests/adapters/test_validation.py)."""

import random

import json
import re

import pytest

from serve.adapters import translora
from serve.adapters.data import PromptExample
from serve.adapters.train import train_adapter
from serve.adapters.validation import trained_on
from serve.cli import main
from serve.store.store import Store
from serve.variants import variant_kind
from tests.adapters import VOCAB
from tests.models import write_perturbed, write_tiny_causal

FIGURES = r"student (\d+\.\d\d), target alone (\d+\.\d\d), source adapter unchanged (\d+\.\d\d)"


def copy_task(n: int, seed: int) -> list[PromptExample]:
    """Five words, then the first two again."""
    rng = random.Random(seed)
    return [PromptExample(prompt=" ".join(words), completion=copied(" ".join(words)))
            for words in (rng.choices(VOCAB, k=5) for _ in range(n))]


def copied(prompt: str) -> str:
    return " " + " ".join(prompt.split()[:2])


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    source = write_tiny_causal(tmp / "llama")
    return source, write_perturbed(source, tmp / "llama-next", seed=3, scale=0.05)


@pytest.fixture(scope="module")
def source_adapter(bases, tmp_path_factory):
    """A LoRA that learnt the copying task on the source (never on the validation set kept beside it)."""
    out = tmp_path_factory.mktemp("adapter") / "toy"
    examples = copy_task(48, seed=1)
    train_adapter(bases[0], trained_on(examples, 5), out, init="lora", rank=4, steps=40, lr=1e-2, progress=lambda *_: None)
    translora.train_discriminator(bases[0], out, examples, "toy", steps=2)
    return out


@pytest.fixture
def store(bases, source_adapter, tmp_path, monkeypatch):
    monkeypatch.setattr(translora.Discriminator, "accepts", lambda self, xs: [True] * len(xs))
    s = Store(tmp_path / "store", create=True)
    s.add_base("old", bases[0])
    s.add_base("new", bases[1])
    variant_kind("lora").add(s, "toy", "old", source_adapter)
    return s


def an_oracle_teacher(source_base, adapter_dir, task, inputs, seed, tick, length=None):
    """Completes each input by the copying task's rule, so the student has something true to learn."""
    return {x: PromptExample(prompt=x, completion=copied(x)) for x in inputs if x.split()}


GUARD_ONLY = ("--from-init", "--no-distill")
"""The student as these tests set it up (from its init, on the completions): the guard is what they test
(test_distill.py tests the start and the distillation)."""


def store_translora(store: Store, *extra: str) -> int:
    return main(["store", "translora", "--store", str(store.root), "--from", "old", "--to", "new", "--samples", "8",
                 "--max-attempts", "16", *GUARD_ONLY, *extra])


def test_a_student_that_beats_the_target_alone_is_registered_as_a_student(store, capsys, monkeypatch):
    monkeypatch.setattr(translora, "teach", an_oracle_teacher)
    code = store_translora(store, "--steps", "30", "--lr", "1e-2", "--always-student")
    out = capsys.readouterr().out
    assert code == 0 and re.match(r"toy: moved to 'toy.new' \(\d of 16 inputs accepted; ", out)  # blanks dropped
    student, target_alone, _ = map(float, re.search(FIGURES, out).groups())
    assert student < target_alone
    store.reload()
    entry = store.variant("toy.new")
    assert entry.base == "new" and entry.kind == "pissa" and entry.translora == "student"


def test_a_student_no_better_than_the_target_alone_is_refused_by_name_and_not_registered(store, capsys):
    code = store_translora(store, "--steps", "2", "--lr", "0", "--always-student")  # a student that learns nothing
    captured = capsys.readouterr()
    line = captured.out.strip()
    assert code == 1 and line.startswith("toy: failed: no better than the target alone (student ")
    student, target_alone, unchanged = map(float, re.search(FIGURES, line).groups())
    assert student == target_alone and unchanged < target_alone
    assert line.endswith("the source adapter unchanged does better: without --always-student it is kept")
    assert captured.err.startswith("manyfold: error: 1 adapter could not move") and captured.err.count("\n") == 1
    store.reload()
    assert "toy.new" not in store.manifest.variants


def test_a_source_adapter_the_student_does_not_beat_is_registered_unchanged_marked_not_transferred(store, capsys):
    code = store_translora(store, "--steps", "2", "--lr", "0")
    out = capsys.readouterr().out
    assert code == 0 and out.startswith("toy: kept unchanged as 'toy.new', not transferred (validation: student ")
    store.reload()
    entry, source = store.variant("toy.new"), store.variant("toy")
    assert entry.base == "new" and entry.kind == "lora" and entry.translora == "unchanged"
    weights = [{f.sha256 for f in e.files if f.path == f"variants/{e.name}/adapter_model.safetensors"}
               for e in (entry, source)]
    assert len(weights[0]) == 1 and weights[0] == weights[1]  # the source's own weights, byte for byte
    assert source.translora is None  # an adapter added directly, as in manifests written before the field


def test_translora_refuses_a_student_no_better_than_the_target_alone_naming_the_adapter(
        bases, source_adapter, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(translora.Discriminator, "accepts", lambda self, xs: [True] * len(xs))
    code = main(["translora", "--source-base", str(bases[0]), "--adapter", str(source_adapter), "--target-base",
                 str(bases[1]), "--out", str(tmp_path / "moved"), "--samples", "4", "--steps", "2", "--lr", "0",
                 "--always-student", *GUARD_ONLY])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"manyfold: error: {source_adapter}: failed: no better than the target alone (student ")
    assert not (tmp_path / "moved").exists()


def test_the_student_kept_is_its_best_point_on_the_validation_curve(bases, source_adapter, tmp_path, monkeypatch):
    monkeypatch.setattr(translora.Discriminator, "accepts", lambda self, xs: [True] * len(xs))
    monkeypatch.setattr(translora, "teach", an_oracle_teacher)
    report = translora.transfer(bases[0], source_adapter, bases[1], tmp_path / "moved", samples=8,
                                max_attempts=16, steps=30, lr=1e-2, distillation=None, start_from_source=False)
    curve = report.validation["curve"]
    assert report.validation["examples"] == 21 and [p["step"] for p in curve][:3] == [0, 5, 10]
    best = min(curve, key=lambda p: p["loss"])
    assert report.validation["best_step"] == best["step"] > 0
    assert report.compared["student"] == pytest.approx(best["loss"], abs=1e-3)  # as served, not as trained
    assert curve[0]["loss"] == pytest.approx(report.compared["target_alone"], abs=1e-3)  # PiSSA starts as the target


def test_translora_says_how_many_inputs_passed_the_filter(bases, source_adapter, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(translora.Discriminator, "accepts", lambda self, xs: [True] * len(xs))
    monkeypatch.setattr(translora, "teach", an_oracle_teacher)
    code = main(["translora", "--source-base", str(bases[0]), "--adapter", str(source_adapter), "--target-base",
                 str(bases[1]), "--out", str(tmp_path / "moved"), "--samples", "8", "--max-attempts", "32",
                 "--steps", "30", "--lr", "1e-2", *GUARD_ONLY])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "moved" / translora.REPORT_FILE).read_text())
    line = (f"{report['accepted']} of {report['attempts']} generated inputs accepted "
            f"({report['generation']['acceptance_rate']:.1%} passed the filter); ")
    batches = report["generation"]["batches"]
    assert code == 0 and line in out and [b["temperature"] for b in batches] == [0.7, 1.0][:len(batches)]
