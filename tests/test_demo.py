"""End to end on the real packaged models and real data (tests/demo_store.py): what the demo trains is stored as
FM-Delta and comes back exactly, and each kind it trains serves the tokens transformers (and PEFT) give."""

import pytest
import torch

from serve.data.datasets import CLASSIFICATION
from serve.data.models import minilm_dir
from serve.demo import finetune_classifier
from serve.store.store import Store
from serve.store.tensors import SafetensorsSource
from serve.variants.full import extract_full_variant
from tests.conftest import same_bits
from tests.demo_store import ADAPTER, CLASSIFIER, TOP_LAYERS, build_small_demo_store

pytestmark = pytest.mark.slow


def test_real_finetune_roundtrips_through_the_store(demo_store, tmp_path):
    """The demo's classifier, trained again with the same seed, is bit-identical to what the store returns, and a
    second build of the same demo store trains and writes nothing."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    store = Store(demo_store)
    entry = store.variant(CLASSIFIER.variant)
    assert entry.labels == ["ham", "spam"] and entry.base == "minilm"
    stored = sum(f.bytes for f in entry.files)
    assert stored < 0.75 * entry.raw_bytes  # a real full fine-tune compresses well

    ref_dir = tmp_path / "ref"
    finetune_classifier(minilm_dir(), CLASSIFICATION["spam"]("train"), ref_dir, CLASSIFIER.train_examples,
                        CLASSIFIER.max_len, log=lambda m: None)
    out = extract_full_variant(store, CLASSIFIER.variant, tmp_path / "out")
    ref, got = SafetensorsSource(ref_dir), SafetensorsSource(out)
    assert set(ref) == set(got) and all(same_bits(ref[k], got[k]) for k in ref)

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    with torch.no_grad():
        probs = model(**tok(["WINNER! claim your free prize now"], return_tensors="pt")).logits.softmax(-1)
    assert probs.shape == (1, 2) and model.config.id2label[0] == "ham"

    logs: list[str] = []
    manifest = (demo_store / "manifest.json").read_bytes()
    build_small_demo_store(demo_store, log=logs.append)  # cached
    assert logs == [] and (demo_store / "manifest.json").read_bytes() == manifest


def test_smollm2_top_layer_variant_serves_transformers_identical_tokens(demo_store, tmp_path):
    """The demo's top-layer fine-tune of SmolLM2, served: the engine holds only the layers it trained, and its
    greedy tokens (and the base's) equal transformers' on the fine-tune as a model directory."""
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serve.config import ServeConfig
    from serve.data.models import smollm2_dir
    from serve.engine.engine import Engine
    from serve.engine.types import SamplingParams

    ft_dir = extract_full_variant(Store(demo_store), TOP_LAYERS.variant, tmp_path / "ft")
    engine = Engine(ServeConfig(store=demo_store))
    messages = [{"role": "user", "content": "Tell me something wise."}]
    params = SamplingParams(max_tokens=12, temperature=0)

    async def serve_both():
        base = await engine.complete("smollm2", params, messages=messages)
        ft = await engine.complete(TOP_LAYERS.variant, params, messages=messages)
        async with engine.cache.use(engine.catalog.snapshot.key(TOP_LAYERS.variant)) as entry:
            held = set(entry.weights)
        return base, ft, held

    base, ft, held = asyncio.run(serve_both())
    top = f"model.layers.{30 - TOP_LAYERS.top_layers}."  # SmolLM2-135M has 30 layers
    assert held and all(n.startswith((top, "model.norm.")) for n in held), sorted(held)
    for gen, model_dir in ((base, smollm2_dir()), (ft, ft_dir)):
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
        expected = out[0, ids["input_ids"].shape[1]:].tolist()
        eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
                  else [model.generation_config.eos_token_id])
        cut = next((i for i, t in enumerate(expected) if t in eos), len(expected))
        assert gen.token_ids == expected[:cut]


def test_smollm2_pissa_adapter_trained_on_real_data_serves_peft_identical_tokens(demo_store):
    """The demo's PiSSA adapter on SmolLM2 (real SMS spam), stored converted, served beside the base in one
    batch; each row's greedy tokens equal transformers + PEFT."""
    import asyncio

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serve.config import ServeConfig
    from serve.data.models import smollm2_dir
    from serve.engine.engine import Engine
    from serve.engine.types import SamplingParams

    store = Store(demo_store)
    entry = store.variant(ADAPTER.variant)
    assert entry.kind == "pissa" and entry.rank == 2 * ADAPTER.rank  # converted: PiSSA's residual as a LoRA

    engine = Engine(ServeConfig(store=demo_store))
    prompt = "Is this message spam? WINNER! Claim your free prize now\nAnswer:"
    params = SamplingParams(max_tokens=6, temperature=0)

    async def both():
        return await asyncio.gather(engine.complete("smollm2", params, prompt=prompt),
                                    engine.complete(ADAPTER.variant, params, prompt=prompt))

    base, adapted = asyncio.run(both())
    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    ids = tok(prompt, return_tensors="pt")
    for gen, adapter in ((base, None), (adapted, store.variant_dir(ADAPTER.variant))):
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir())
        model = (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()
        out = model.generate(**ids, max_new_tokens=6, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        assert gen.token_ids == out[: next((i for i, t in enumerate(out) if t in eos), len(out))]


def test_smollm2_chat_without_max_tokens_runs_to_its_end_of_turn_token(demo_store):
    """OpenAI has no default cap: a chat answer longer than the old 16-token default ends where the model ends it."""
    import asyncio

    from serve.config import ServeConfig
    from serve.engine.engine import Engine
    from serve.engine.types import SamplingParams

    engine = Engine(ServeConfig(store=demo_store))
    messages = [{"role": "user", "content": "Write two sentences about the sea."}]
    gen = asyncio.run(engine.complete("smollm2", SamplingParams(max_tokens=None, temperature=0), messages=messages))
    assert gen.finish_reason == "stop" and len(gen.token_ids) > 16, (gen.finish_reason, gen.text)
    assert gen.text.rstrip().endswith(".")
