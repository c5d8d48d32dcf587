"""The full fine-tunes' pool (fixed shapes, as on CUDA): fine-tunes copied into stacks bounded by bytes; rows beyond
the budget wait, idle fine-tunes make room least recently used first; a tied embedding and LM head are one stack;
every fine-tune's rows give what the fine-tune gives run alone."""

import pytest
import torch
from torch.func import functional_call

from serve.config import SlotsConfig
from serve.engine.step.batch import BatchPlan, RowSlot
from serve.engine.model import BaseModelRuntime
from serve.engine.families.weight_pool import WeightPool
from serve.errors import VariantIncompatible
from serve.variants.base import LoadedVariant
from tests.models import write_tiny_causal


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_causal(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def rt(model_dir) -> BaseModelRuntime:
    return BaseModelRuntime("tiny", model_dir)


def finetune(rt: BaseModelRuntime, name: str, seed: int, only: str) -> LoadedVariant:
    """Every tensor whose name holds `only` moved; the tied LM head as its embedding (one parameter, one value)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {k: t + torch.randn(t.shape, generator=g) * 0.3 for k, t in rt.view.tensors.items()
               if only in k and k != "lm_head.weight"}
    return LoadedVariant(name, "full", "weights", tensors)


def pool_of(rt: BaseModelRuntime, variants: list[LoadedVariant], room: float) -> WeightPool:
    """A fixed-shape pool holding `room` of the largest variant's bytes."""
    pool = WeightPool(rt.view, rt.device, SlotsConfig(weights_mib=1))
    pool.fixed_shapes = True
    pool.budget = int(room * max(pool.row_bytes(pool.bucket_key(v)) for v in variants))
    rt.families["weights"] = pool
    return pool


def test_rows_beyond_the_budget_wait_and_idle_fine_tunes_make_room(rt):
    f1, f2 = finetune(rt, "f1", 1, "layers.1."), finetune(rt, "f2", 2, "layers.1.")
    pool = pool_of(rt, [f1, f2], room=1.5)  # one fine-tune of this bucket fits, not two
    s1 = pool.attach(f1)
    assert s1 is not None and pool.attach(f2) is None  # f1 runs: f2's row waits
    pool.detach(s1)
    version = pool.version
    s2 = pool.attach(f2)  # f1 is idle: it leaves, f2 takes the room
    assert s2 is not None and pool.slot_of("f1") is None and pool.nbytes <= pool.budget
    assert pool.version != version  # its stacks moved: a graph reading them is captured again
    pool.detach(s2)
    assert pool.slot_of("f2") == s2  # idle, and kept warm for its next row


def test_a_fine_tune_larger_than_the_pool_is_refused_by_name(rt):
    f = finetune(rt, "big", 1, "layers.")
    pool = pool_of(rt, [f], room=0.5)
    with pytest.raises(VariantIncompatible, match="full variant 'big' needs .* MiB in the full fine-tune pool; "
                                                  "slots.weights_mib is"):
        pool.check(f)


def test_every_fine_tune_in_one_forward_gives_what_it_gives_alone_a_tied_embedding_one_stack(rt, model_dir):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    top = finetune(rt, "top", 1, "layers.1.")
    embed = finetune(rt, "embed", 2, "embed_tokens")  # tied: the LM head changes with it
    every = finetune(rt, "every", 3, "")
    pool = pool_of(rt, [top, embed, every], room=10)
    bucket = pool.new_bucket(pool.bucket_key(embed))
    assert bucket.modules["lm_head"]["weight"] == bucket.modules["model.embed_tokens"]["weight"]  # one stack
    variants = [None, top, embed, every, top, None]
    rows = [RowSlot() if v is None else RowSlot("weights", pool.attach(v)) for v in variants]
    ids = torch.randint(3, plain.config.vocab_size, (len(rows), 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = rt.call(BatchPlan(rows, rt.device), input_ids=ids).logits
        for i, v in enumerate(variants):
            params = {} if v is None else v.tensors  # tied: the embedding's value is the LM head's too
            want = functional_call(plain, params, (ids[i:i + 1],), strict=False).logits[0]
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
    assert len({round(float(got[i].sum()), 3) for i in range(4)}) == 4  # the fine-tunes really differ
