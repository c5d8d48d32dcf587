"""End to end on the real packaged MiniLM and real data: fine-tune, store as FM-Delta, get it back exactly."""

import pytest
import torch

from serve.data.datasets import CLASSIFICATION
from serve.data.models import minilm_dir
from serve.demo import DemoTask, build_demo_store, finetune_classifier
from serve.store.tensors import SafetensorsSource
from serve.variants.full import extract_full_variant
from tests.conftest import same_bits

pytestmark = pytest.mark.slow


def test_real_finetune_roundtrips_through_the_store(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tasks = (DemoTask("minilm-spam", "spam", 48, 32),)
    logs: list[str] = []
    store = build_demo_store(tmp_path / "store", tasks=tasks, lm_tasks=(), adapter_tasks=(), log=logs.append)
    assert any("FM-Delta" in m for m in logs)
    entry = store.variant("minilm-spam")
    assert entry.labels == ["ham", "spam"] and entry.base == "minilm"
    stored = sum(f.bytes for f in entry.files)
    assert stored < 0.75 * entry.raw_bytes  # a real full fine-tune compresses well

    # The same fine-tune, trained again with the same seed, is bit-identical to what the store returns.
    ref_dir = tmp_path / "ref"
    finetune_classifier(minilm_dir(), CLASSIFICATION["spam"]("train"), ref_dir, 48, 32, log=lambda m: None)
    out = extract_full_variant(store, "minilm-spam", tmp_path / "out")
    ref, got = SafetensorsSource(ref_dir), SafetensorsSource(out)
    assert set(ref) == set(got) and all(same_bits(ref[k], got[k]) for k in ref)

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        probs = model(**tok(["WINNER! claim your free prize now"], return_tensors="pt")).logits.softmax(-1)
    assert probs.shape == (1, 2) and model.config.id2label[0] == "ham"

    logs.clear()
    build_demo_store(tmp_path / "store", tasks=tasks, lm_tasks=(), adapter_tasks=(), log=logs.append)  # cached
    assert logs == []


def test_smollm2_top_layer_variant_serves_transformers_identical_tokens(tmp_path):
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serve.config import ServeConfig
    from serve.data.models import smollm2_dir
    from serve.demo import LmTask, finetune_lm_top_layers, lm_corpus
    from serve.engine.engine import Engine
    from serve.engine.types import SamplingParams
    from serve.store.store import Store
    from serve.variants.full import add_full_variant

    store = Store(tmp_path / "store", create=True)
    store.add_base("smollm2", smollm2_dir())
    task = LmTask("smollm2-ft", "fortunes", steps=2, lr=1e-3)
    finetune_lm_top_layers(store.base_dir("smollm2"), lm_corpus("fortunes"), tmp_path / "ft", task, log=lambda m: None)
    add_full_variant(store, "smollm2-ft", "smollm2", tmp_path / "ft")

    engine = Engine(ServeConfig(store=store.root))
    messages = [{"role": "user", "content": "Tell me something wise."}]
    params = SamplingParams(max_tokens=12, temperature=0)

    async def serve_both():
        base = await engine.complete("smollm2", params, messages=messages)
        ft = await engine.complete("smollm2-ft", params, messages=messages)
        async with engine.cache.use(engine.catalog.snapshot.key("smollm2-ft")) as entry:
            held = set(entry.weights)
        return base, ft, held

    base, ft, held = asyncio.run(serve_both())
    assert held and all(n.startswith(("model.layers.28.", "model.layers.29.", "model.norm.")) for n in held)
    for gen, model_dir in ((base, smollm2_dir()), (ft, tmp_path / "ft")):
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
        expected = out[0, ids["input_ids"].shape[1]:].tolist()
        eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
                  else [model.generation_config.eos_token_id])
        cut = next((i for i, t in enumerate(expected) if t in eos), len(expected))
        assert gen.token_ids == expected[:cut]


def test_smollm2_pissa_adapter_trained_on_real_data_serves_peft_identical_tokens(tmp_path):
    """A demo adapter in miniature: PiSSA on SmolLM2 with real SMS spam, stored converted, served beside the
    base in one batch; each row's greedy tokens equal transformers + PEFT."""
    import asyncio

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serve.config import ServeConfig
    from serve.data.models import smollm2_dir
    from serve.demo import AdapterTask, add_demo_adapter
    from serve.engine.engine import Engine
    from serve.engine.types import SamplingParams
    from serve.store.store import Store

    store = Store(tmp_path / "store", create=True)
    store.add_base("smollm2", smollm2_dir())
    add_demo_adapter(store, AdapterTask("spam-pissa", "spam", examples=16, steps=2, rank=4, lr=1e-3),
                     log=lambda m: None)
    assert store.variant("spam-pissa").kind == "pissa" and store.variant("spam-pissa").rank == 8

    engine = Engine(ServeConfig(store=store.root))
    prompt = "Is this message spam? WINNER! Claim your free prize now\nAnswer:"
    params = SamplingParams(max_tokens=6, temperature=0)

    async def both():
        return await asyncio.gather(engine.complete("smollm2", params, prompt=prompt),
                                    engine.complete("spam-pissa", params, prompt=prompt))

    base, adapted = asyncio.run(both())
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    ids = tok(prompt, return_tensors="pt")
    for gen, adapter in ((base, None), (adapted, store.variant_dir("spam-pissa"))):
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir())
        model = (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()
        out = model.generate(**ids, max_new_tokens=6, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        assert gen.token_ids == out[: next((i for i, t in enumerate(out) if t in eos), len(out))]


def test_smollm2_chat_without_max_tokens_runs_to_its_end_of_turn_token(tmp_path):
    """OpenAI has no default cap: a chat answer longer than the old 16-token default ends where the model ends it."""
    import asyncio

    from serve.config import ServeConfig
    from serve.data.models import smollm2_dir
    from serve.engine.engine import Engine
    from serve.engine.types import SamplingParams
    from serve.store.store import Store

    store = Store(tmp_path / "store", create=True)
    store.add_base("smollm2", smollm2_dir())
    engine = Engine(ServeConfig(store=store.root))
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    gen = asyncio.run(engine.complete("smollm2", SamplingParams(max_tokens=None, temperature=0), messages=messages))
    assert gen.finish_reason == "stop" and len(gen.token_ids) > 16, (gen.finish_reason, gen.text)
    assert gen.text.rstrip().endswith(".")
