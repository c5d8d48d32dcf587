"""GPT-2-style bases: GPT2LMHeadModel is causal by transformers' own mapping though its name does not end in
ForCausalLM, and its Conv1D weights are stored [in, out]. Such a base serves generation plain and as a
lossless NeuZip base, its full variants and LoRA adapters on Conv1D too, token for token as transformers (and
PEFT) generate on the same weights."""

import asyncio
from pathlib import Path

import pytest
import torch

from serve.codecs.neuzip_file import add_base, cast_to_bf16
from serve.config import ServeConfig
from serve.engine.engine import Engine
from serve.engine.types import SamplingParams
from serve.store.model_dir import is_causal_lm
from serve.store.store import Store
from tests.forwards import forward_rows
from serve.variants import variant_kind
from tests.models import write_lora, write_perturbed, write_tiny_gpt2

BASES = {"gpt2": None, "gpt2-nz": 7}  # name: NeuZip bits (None: uncompressed)
CONV1D = ["c_attn", "c_proj", "c_fc"]  # every Conv1D of a GPT-2 block (PEFT saves fan_in_fan_out=True)
PROMPTS = ["the cat sat on the mat and", "hello", "one two three four five six"]  # lengths differ: padded rows


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny bf16 GPT-2 with no pad token (as the real one), stored plain and in NeuZip form, each with the
    same full fine-tune and LoRA adapter. -> (engine, {model suffix: the directory transformers reads})."""
    from serve.variants.full import add_full_variant

    tmp = tmp_path_factory.mktemp("gpt2")
    base = write_tiny_gpt2(tmp / "gpt2", pad=False)
    finetune = write_perturbed(base, tmp / "gpt2-ft", seed=1, scale=0.5)
    for d in (base, finetune):
        cast_to_bf16(d)
    lora = write_lora(base, tmp / "gpt2-lora", seed=2, r=4, targets=CONV1D)
    store = Store(tmp / "store", create=True)
    for name, bits in BASES.items():
        if bits is None:
            store.add_base(name, base)
        else:
            add_base(store, name, base, bits)
        add_full_variant(store, f"{name}-ft", name, finetune)
        variant_kind("lora").add(store, f"{name}-lora", name, lora)
    return Engine(ServeConfig(store=store.root)), {"": base, "-ft": finetune, "-lora": (base, lora)}


def reference_greedy(model_dir, prompt: str, n: int) -> list[int]:
    """transformers' own greedy tokens for one prompt (PEFT's, for a (base, adapter) pair), up to the
    end-of-text token (which the engine leaves out)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, adapter = model_dir if isinstance(model_dir, tuple) else (model_dir, None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    return new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new


def test_transformers_mapping_decides_what_is_causal():
    assert is_causal_lm(["GPT2LMHeadModel"]) and is_causal_lm("LlamaForCausalLM")
    assert not is_causal_lm(["GPT2Model"]) and not is_causal_lm(["BertModel"]) and not is_causal_lm(None)


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("suffix", ["", "-ft", "-lora"])
def test_greedy_tokens_of_padded_rows_equal_transformers_generate(served, base, suffix):
    engine, dirs = served
    assert engine.bases[base].causal and (engine.bases[base].coded is not None) == (BASES[base] is not None)
    params = SamplingParams(max_tokens=10, temperature=0)

    async def together():
        return await asyncio.gather(*(engine.complete(base + suffix, params, prompt=p) for p in PROMPTS))

    assert [g.token_ids for g in asyncio.run(together())] == [reference_greedy(dirs[suffix], p, 10) for p in PROMPTS]


def test_a_lossless_neuzip_gpt2_gives_the_plain_bases_logits_exactly(served):
    engine, _ = served
    rt = engine.bases["gpt2"]
    ids = torch.tensor([rt.prompts.encode(p)[:5] for p in PROMPTS[::2]] * 2)  # equal lengths: no padding
    rows = ["", "-lora", "-ft", ""]  # ids rows 0 and 2 are one prompt, 1 and 3 another
    plain = forward_rows(engine, "gpt2", ["gpt2" + s for s in rows], ids)
    coded = forward_rows(engine, "gpt2-nz", ["gpt2-nz" + s for s in rows], ids)
    assert torch.equal(plain, coded)
    assert not torch.equal(plain[0], plain[2]) and not torch.equal(plain[1], plain[3])  # the variants really differ


def test_a_conv1d_adapter_is_checked_in_its_own_orientation(served, tmp_path):
    """fan_in_fan_out says the base weight is [in, out]: an adapter that leaves it out is read against [out, in]
    and refused in one line naming the module (c_attn maps 48 -> 144)."""
    import json
    import shutil

    from serve.errors import VariantIncompatible

    engine, dirs = served
    bad = Path(shutil.copytree(dirs["-lora"][1], tmp_path / "bad"))
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "fan_in_fan_out": False}))
    with pytest.raises(VariantIncompatible, match=r"'.*h\.0\.attn\.c_attn' maps 48 -> 144; base 'gpt2' has 144 -> 48") as e:
        variant_kind("lora").add(engine.catalog.files, "gpt2-bad", "gpt2", bad)
    assert "\n" not in str(e.value)
