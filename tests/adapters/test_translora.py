"""Trans-LoRA end to end on tiny random models of two architectures and tokenizers: a discriminator trained
beside an adapter, a transfer to another base, the attempt cap, and a store-wide transfer that resumes."""

import json
import random

import pytest
import torch

from serve.adapters import translora
from serve.adapters.data import PromptExample
from serve.adapters.train import train_adapter
from serve.store.store import Store
from serve.variants import variant_kind
from tests.models import WORDS, write_tiny_causal, write_tiny_gpt2

VOCAB = WORDS[7:]


def toy_task(n: int = 24, seed: int = 0) -> list[PromptExample]:
    """Five words, then " yes" if the first is in the first half of the vocabulary."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.choices(VOCAB, k=5)
        out.append(PromptExample(prompt=" ".join(words), completion=" yes" if VOCAB.index(words[0]) < 30 else " no"))
    return out


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("translora")
    return write_tiny_causal(tmp / "llama"), write_tiny_gpt2(tmp / "gpt2")


@pytest.fixture(scope="module")
def source_adapter(bases, tmp_path_factory):
    out = tmp_path_factory.mktemp("adapter") / "toy"
    train_adapter(bases[0], toy_task(), out, init="pissa", rank=4, steps=4, progress=lambda *_: None)
    info = translora.train_discriminator(bases[0], out, toy_task(), "toy", steps=4)
    assert info["real"] == 24 and info["generated"] == 24 and len(info["losses"]) == 4
    return out


def test_discriminator_keeps_seeds_and_task_beside_the_adapter(source_adapter):
    task, seeds, disc = translora.read_assets(source_adapter)
    assert task.name == "toy" and task.form == "prompt" and seeds == toy_task()[:5]
    assert (disc / "adapter_model.safetensors").is_file()


def test_transfer_across_architectures_and_tokenizers(bases, source_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    report = translora.transfer(bases[0], source_adapter, bases[1], tmp_path / "moved", samples=4, max_attempts=48,
                                steps=3)  # the default student: PiSSA
    assert 1 <= report.accepted <= 4 and report.attempts <= 48
    assert report.accepted + report.rejected == report.attempts and len(report.losses) == 3
    written = json.loads((tmp_path / "moved" / translora.REPORT_FILE).read_text())
    assert written["accepted"] == report.accepted and written["task"] == "toy"
    target = AutoModelForCausalLM.from_pretrained(bases[1])
    before = target.lm_head.weight.clone()
    model = PeftModel.from_pretrained(target, tmp_path / "moved").eval()
    ids = AutoTokenizer.from_pretrained(bases[1])("the cat sat", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape[-1] == len(WORDS)
    assert torch.equal(target.lm_head.weight, before)


def test_a_generator_that_never_passes_stops_at_the_cap(bases, source_adapter, tmp_path, monkeypatch):
    written = []
    real = translora.generate_candidates

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        written.extend(out)
        return out

    monkeypatch.setattr(translora, "generate_candidates", counting)
    monkeypatch.setattr(translora.Discriminator, "accepts", lambda self, xs: [False] * len(xs))
    with pytest.raises(translora.TransferFailed, match="no generated input passed the discriminator in 20 attempts"):
        translora.transfer(bases[0], source_adapter, bases[1], tmp_path / "never", samples=4, max_attempts=20)
    assert len(written) == 20 and not (tmp_path / "never").exists()


def test_store_transfer_skips_adapters_without_a_discriminator_and_resumes(bases, source_adapter, tmp_path,
                                                                         monkeypatch):
    store = Store(tmp_path / "store", create=True)
    store.add_base("llama", bases[0])
    store.add_base("llama2", write_tiny_causal(tmp_path / "llama2", seed=7, hidden=48))
    for name in ("a", "b"):
        variant_kind("pissa").add(store, name, "llama", source_adapter)
    train_adapter(bases[0], toy_task(), tmp_path / "plain", init="lora", rank=4, steps=2, progress=lambda *_: None)
    variant_kind("lora").add(store, "plain", "llama", tmp_path / "plain")

    calls = []
    real = translora.transfer

    def failing_second(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise KeyboardInterrupt  # the operator stops it half way
        return real(*args, **kwargs)

    monkeypatch.setattr(translora, "transfer", failing_second)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        for line in translora.transfer_store(store, "llama", "llama2", samples=2, max_attempts=48, steps=2):
            lines.append(line)
    assert lines == ["a: moved to 'a.llama2' (" + lines[0].split(" (", 1)[1]]
    store.reload()
    assert "a.llama2" in store.manifest.variants and "b.llama2" not in store.manifest.variants
    lines = list(translora.transfer_store(store, "llama", "llama2", samples=2, max_attempts=48, steps=2))
    assert lines[0] == "a: done before, as 'a.llama2'" and lines[1].startswith("b: moved to 'b.llama2'")
    assert lines[2] == "plain: skipped: no discriminator beside it (trained without --discriminator)"
    assert len(calls) == 3  # a once, b twice (interrupted, then done): nothing finished was redone
    assert store.variant("b.llama2").kind == "pissa" and store.variant("b.llama2").base == "llama2"
