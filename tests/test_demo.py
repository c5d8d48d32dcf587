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
    store = build_demo_store(tmp_path / "store", tasks=tasks, log=logs.append)
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
    build_demo_store(tmp_path / "store", tasks=tasks, log=logs.append)  # cached: nothing to do
    assert logs == []
