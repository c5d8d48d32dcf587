"""EMR rows whose task's weights are formed for a module (DENSE_MIN_TOKENS) equal rows corrected by the masked
delta and `emr extract`'s model, and the base's forward skips the rows a family claims."""

import pytest
import torch

from serve.codecs import emr
from serve.engine.families import emr_slots
from serve.engine.step.batch import BASE_ROW, BatchPlan
from serve.engine.model import BaseModelRuntime
from serve.store.store import Store
from serve.variants import variant_kind
from tests.models import write_perturbed, write_tiny_causal

TASKS = {"a": 1, "b": 2}


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """(runtime, loaded group, {task: extracted model dir}) for a tiny LM and a two-task EMR group."""
    root = tmp_path_factory.mktemp("emr-slots")
    lm = write_tiny_causal(root / "tiny-lm")
    store = Store(root / "store", create=True)
    store.add_base("tiny-lm", lm)
    finetunes = {t: write_perturbed(lm, root / t, seed=s, scale=0.5) for t, s in TASKS.items()}
    bundle = emr.merge(lm, finetunes, root / "bundle").path
    variant_kind("emr").add(store, "g", "tiny-lm", bundle)
    rt = BaseModelRuntime("tiny-lm", store.base_dir("tiny-lm"))
    loaded = variant_kind("emr").load(store, store.variant("g"), rt.view, torch.empty)
    return rt, loaded, {t: emr.extract(bundle, t, root / f"{t}-merged") for t in TASKS}


@torch.no_grad()
def _mixed_logits(rt, loaded, who: list[str | None], ids: torch.Tensor) -> torch.Tensor:
    rows = [BASE_ROW if t is None else rt.attach(loaded.members[f"g/{t}"]) for t in who]
    try:
        return rt.call(BatchPlan(rows, rt.device), input_ids=ids).logits
    finally:
        for r in rows:
            rt.detach(r)


@pytest.mark.parametrize("min_tokens", [1, 24, None], ids=["every-task-formed", "only-task-a-formed", "masked-only"])
def test_formed_rows_equal_masked_rows_and_the_extracted_models(group, monkeypatch, min_tokens):
    from transformers import AutoModelForCausalLM

    rt, loaded, extracted = group
    monkeypatch.setitem(emr_slots.DENSE_MIN_TOKENS, "cpu", min_tokens)
    who = [None, "a", "b", "a", "a"]  # 8 tokens a row: task a has 24 in the forward, task b 8
    ids = torch.randint(0, rt.tokenizer.vocab_size, (len(who), 8), generator=torch.Generator().manual_seed(0))
    logits = _mixed_logits(rt, loaded, who, ids)
    for t, d in extracted.items():
        rows = [i for i, w in enumerate(who) if w == t]
        ref = AutoModelForCausalLM.from_pretrained(d).eval()(input_ids=ids[rows]).logits
        torch.testing.assert_close(logits[rows], ref, atol=1e-4, rtol=1e-4)


def test_the_base_skips_rows_a_family_claims(group, monkeypatch):
    rt, loaded, _ = group
    monkeypatch.setitem(emr_slots.DENSE_MIN_TOKENS, "cpu", 1)
    name, linear = next((n, m) for n, m in rt.view.modules.items()
                        if isinstance(m, torch.nn.Linear) and f"{n}.weight" in loaded.tensors)
    seen: list[int] = []
    handle = linear.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    try:
        _mixed_logits(rt, loaded, [None, "a", None, "b"], torch.zeros((4, 3), dtype=torch.long))
    finally:
        handle.remove()
    assert seen == [2 * 3]  # the two base rows' tokens; the task rows ran through their formed weights


def test_formed_weights_are_held_between_forwards_within_their_budget(group, monkeypatch):
    """The next batch of a hot task runs on the weights the last one formed; a budget too small for them all
    holds what fits and forms the rest each forward, with the same answers."""
    rt, loaded, _ = group
    monkeypatch.setitem(emr_slots.DENSE_MIN_TOKENS, "cpu", 1)
    who = ["a", None, "b"]
    ids = torch.randint(0, rt.tokenizer.vocab_size, (3, 5), generator=torch.Generator().manual_seed(1))
    first = _mixed_logits(rt, loaded, who, ids)
    held = rt.families[loaded.family].formed
    before = held.formed
    assert torch.equal(_mixed_logits(rt, loaded, who, ids), first) and held.formed == before and held.nbytes > 0
    one = max(w.numel() * w.element_size() for w in held._held.values())
    monkeypatch.setattr(held, "budget", one)
    held.clear()
    assert torch.equal(_mixed_logits(rt, loaded, who, ids), first)
    assert 0 < held.nbytes <= one and held.formed > before
