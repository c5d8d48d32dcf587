"""The contract every registered variant kind meets, parametrised over the registry (as peft's TEST_CASES):
added atomically and verifiable, loaded into its family's form, and applied in the shared forward it equals
the dense model the fine-tune stands for (the fine-tune itself, or W + s B A merged by PEFT)."""

from pathlib import Path

import pytest
import torch

from serve.config import SlotsConfig
from serve.engine.step.batch import BASE_ROW, BatchPlan
from serve.engine.model import BaseModelRuntime
from serve.store.store import Store
from serve.variants import VARIANT_KINDS, variant_kind
from tests.adapters import write_tiny_lm
from tests.models import write_lora, write_perturbed

PROMPT = torch.tensor([[1, 7, 8, 9, 10, 11, 7, 12]])


def make_full(base: Path, out: Path) -> Path:
    return write_perturbed(base, out, seed=3, scale=0.5, only="layers.1.")


def make_lora(base: Path, out: Path) -> Path:
    return write_lora(base, out, seed=4, r=4, targets=["q_proj", "v_proj", "down_proj"], lora_alpha=8)


def make_pissa(base: Path, out: Path) -> Path:
    from serve.adapters.data import TextExample
    from serve.adapters.train import train_adapter

    data = [TextExample(text="the cat sat on the mat and ran to the house")] * 4
    train_adapter(base, data, out, init="pissa", rank=4, steps=3, lr=5e-2, batch_size=2, max_length=16,
                  target_modules=["q_proj", "up_proj"])
    return out


def make_emr(base: Path, out: Path) -> Path:
    from serve.codecs.emr import merge

    tasks = {"t1": write_perturbed(base, out.parent / "emr-t1", seed=5, scale=0.5),
             "t2": write_perturbed(base, out.parent / "emr-t2", seed=6, scale=0.5, only="layers.1.")}
    return merge(base, tasks, out).path


MAKERS = {"full": make_full, "lora": make_lora, "pissa": make_pissa, "emr": make_emr}


def dense_reference(base: Path, variant_dir: Path):
    """The model a variant stands for, as transformers (and PEFT, merged into dense weights) build it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if (variant_dir / "adapter_config.json").exists():
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), variant_dir).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(variant_dir)
    return model.eval()


def test_every_registered_kind_has_a_contract_case():
    assert set(MAKERS) == set(VARIANT_KINDS)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    lm = write_tiny_lm(root / "tiny-lm")  # weights at std 0.2: fp32 noise well below 1e-5
    store = Store(root / "store", create=True)
    store.add_base("tiny-lm", lm)
    return root, store, BaseModelRuntime("tiny-lm", store.base_dir("tiny-lm"))


@pytest.mark.parametrize("kind", sorted(VARIANT_KINDS))
def test_kind_contract(base, kind, tmp_path):
    root, store, rt = base
    made = MAKERS[kind](root / "tiny-lm", tmp_path / f"made-{kind}")
    k = variant_kind(kind)
    entry = k.add(store, f"v-{kind}", "tiny-lm", made, slots=SlotsConfig())
    assert (entry.kind, entry.base) == (kind, "tiny-lm")
    assert Store(store.root).variant(f"v-{kind}") == entry  # in the manifest, with its files' digests
    k.verify(store, entry)

    loaded = k.load(store, entry, rt.view, torch.empty)
    assert loaded.family.split(":")[0] == k.family and loaded.nbytes > 0
    rt.check(loaded)
    model = next(iter(entry.models()))  # the variant, or a group's first member ("v-emr/t1")
    row = rt.attach(loaded.member(model))
    try:
        with torch.no_grad():
            plan = BatchPlan([BASE_ROW, row], rt.device)
            got = rt.call(plan, input_ids=PROMPT.repeat(2, 1)).logits  # [2, seq, vocab]
            dense = made if model == entry.name else k.extract(store, model, tmp_path / "member")
            ref = dense_reference(root / "tiny-lm", dense)(input_ids=PROMPT).logits[0]
            plain = rt.call(BatchPlan([BASE_ROW], rt.device), input_ids=PROMPT).logits[0]
    finally:
        rt.detach(row)
    torch.testing.assert_close(got[1], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], plain, atol=1e-5, rtol=1e-5)  # the base row beside it is untouched
    assert (got[1] - got[0]).abs().max() > 1e-3  # the variant really changes the output

    out = k.extract(store, f"v-{kind}", tmp_path / "extracted")
    again = k.add(store, f"v-{kind}-again", "tiny-lm", out, slots=SlotsConfig())
    reloaded = k.load(store, again, rt.view, torch.empty)
    assert reloaded.tensors.keys() == loaded.tensors.keys()
    assert all(torch.equal(reloaded.tensors[n], t) for n, t in loaded.tensors.items())
