"""Metrics stay bounded with thousands of variants, and the bounded residency gauge shows the held ones."""

from prometheus_client.parser import text_string_to_metric_families

from serve.engine.types import ModelInfo
from serve.metrics import MAX_MODEL_LABELS, Metrics


def test_the_residency_gauge_keeps_its_cap_and_shows_held_variants_first():
    models = [ModelInfo(f"v-{i}", "lora", "b", "cold", None) for i in range(2000)]
    models[1999] = ModelInfo("v-1999", "lora", "b", "hot", None)
    models[1500] = ModelInfo("v-1500", "lora", "b", "warm", None)
    text = Metrics().render([], models).decode()
    resident = next(f for f in text_string_to_metric_families(text) if f.name == "manyfold_variant_resident")
    shown = {s.labels["model"] for s in resident.samples}
    assert len(shown) == MAX_MODEL_LABELS and {"v-1999", "v-1500", "v-0"} <= shown
    held = {(s.labels["model"], s.labels["tier"]) for s in resident.samples if s.value == 1.0}
    assert {("v-1999", "hot"), ("v-1500", "warm")} <= held
